"""Load on a running OpenAI-compatible server (benchmarks/load.py, and the serve tests): `run_load`
(N clients, each with its own keep-alive connection), `send` (one greedy completion), `Reply`,
`LoadResult`.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain speculative decoding briefly.",
           "List three prime numbers."]


@dataclass
class Reply:
    """One request's outcome."""

    status: int
    latency_s: float
    text: str = ""
    completion_tokens: int = 0
    stream: bool = False
    error: Optional[dict] = None


@dataclass
class LoadResult:
    clients: int
    requests: int  # per client
    wall_s: float
    replies: list[Reply] = field(default_factory=list)

    def statuses(self) -> Counter:
        return Counter(r.status for r in self.replies)

    def latency_ms(self, q: float) -> float:
        """Latency quantile (0..1) over the successful replies, nearest rank, in ms."""
        ok = sorted(r.latency_s for r in self.replies if r.status == 200)
        return 1000 * ok[min(len(ok) - 1, max(0, round(q * len(ok)) - 1))] if ok else float("nan")

    def summary(self) -> dict:
        ok = [r for r in self.replies if r.status == 200]
        tokens = sum(r.completion_tokens for r in ok)
        return {"clients": self.clients, "requests_per_client": self.requests, "statuses": dict(self.statuses()),
                "p50_ms": round(self.latency_ms(0.5), 1), "p99_ms": round(self.latency_ms(0.99), 1),
                "mean_ms": round(1000 * statistics.fmean(r.latency_s for r in ok), 1) if ok else None,
                "requests_per_s": round(len(ok) / self.wall_s, 2), "tokens_per_s": round(tokens / self.wall_s, 1),
                "wall_s": round(self.wall_s, 2)}


def send(client: Any, prompt: str, max_tokens: int, stream: bool) -> Reply:
    """One greedy completion request on an httpx.Client -> Reply (text, tokens; the error body when not 200)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return Reply(response.status_code, time.perf_counter() - start, stream=stream, error=response.json()["error"])
        if not stream:
            answer = json.loads(response.read())
            return Reply(200, time.perf_counter() - start, answer["choices"][0]["text"],
                         answer["usage"]["completion_tokens"])
        text, tokens, error = "", 0, None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                text += chunk["choices"][0]["text"]
    return Reply(200, time.perf_counter() - start, text, tokens, stream=True, error=error)


def run_load(url: str, clients: int, requests: int, max_tokens: int, prompts: list[str] = PROMPTS,
             stream_every: int = 2, api_key: Optional[str] = None, timeout_s: float = 120) -> LoadResult:
    """`clients` threads, each with its own keep-alive connection, x `requests` sequential greedy requests
    each, cycling through `prompts`; every `stream_every`-th streamed (0: none); all start together.
    Latency is send -> last byte (a stream's [DONE]); other statuses than 200 are kept, never retried."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    replies: list[Reply] = []
    lock, go = threading.Lock(), threading.Barrier(clients)

    def client_loop(c: int) -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
            go.wait()  # every client starts together
            for i in range(requests):
                k = c * requests + i
                reply = send(client, prompts[k % len(prompts)], max_tokens, stream=stream_every > 0 and k % stream_every == 1)
                with lock:
                    replies.append(reply)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return LoadResult(clients, requests, time.perf_counter() - start, replies)
