"""Served evaluation: acceptance length and throughput of a running OpenAI-compatible server.

`evaluate_server(params, url)` sends the offline evaluation's prompts (the same suites and the
same selection: `evaluate.max_prompts`, `evaluate.max_prompt_tokens`, as chat messages; the
client loads the target's tokenizer, not its weights, to apply the length limit) to
`POST {url}/v1/chat/completions` with `"return_meta_info": true`, non-streaming. Prompt i carries
seed `evaluate.seed + i`. Each suite runs at two levels: one request in flight (`c1`), then
`evaluate.server_concurrency` (or `--concurrency`) in flight (`cN`; skipped when N = 1). One short
warm-up request precedes the timed levels. Per suite and level, over the level's successful answers:

  acceptance_length  τ = Σ meta_info.completion_tokens / Σ meta_info.spec_verify_ct   (pooled)
                     SGLang's per-request `spec_accept_length` is completion_tokens / spec_verify_ct,
                     so τ is the mean of per-request values weighted by their verify rounds;
                     null when the server returns no meta_info (no speculative decoding)
  tokens_per_s       Σ usage.completion_tokens / wall time of the level (first send -> last answer)
  requests_per_s     successful requests / wall time of the level
  latency_p50_s/p99  per-request end-to-end seconds, measured by the client (linear interpolation)
  errors             answers other than HTTP 200, and requests that timed out or lost their connection

meta_info.completion_tokens counts every output token, the one the prefill emits included; the
offline τ leaves that one out, so on short answers the served τ may read slightly higher. Before
each level the client asks the server to drop its prefix cache (`POST /flush_cache`, SGLang's;
ignored where absent), so level cN does not prefill faster merely because c1 sent the same prompts.
The bearer key, when `$<serve.api_key_env>` (DOMINOSPEC_API_KEY) is set, goes in `Authorization`.

`metrics/serve_eval.json` (or `out`), written atomically:

  {"server": url, "model": id, "date": ISO-8601 UTC, "concurrency": [1, N],
   "max_new_tokens", "temperature", "top_p", "top_k", "tau": definition,
   "server_info": {"avg_spec_accept_length_before": x | null, "avg_spec_accept_length_after": y | null},
   "empty_suites": {name: why},
   "suites": {name: {"c1": LEVEL, "cN": LEVEL}}, **extra}
  LEVEL = {"concurrency", "n_requests", "errors", "first_error", "completion_tokens", "prompt_tokens",
           "meta_info_requests" (answers carrying meta_info), "meta_completion_tokens", "spec_verify_ct",
           "acceptance_length", "wall_s",
           "tokens_per_s", "requests_per_s", "latency_p50_s", "latency_p99_s"}

`avg_spec_accept_length` is the server's own aggregate from `GET /server_info` (top level, or
SGLang's `internal_states[0]`), kept as a cross-check; it spans whatever the server ran.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import httpx
from tqdm import tqdm

from dominospec.errors import UserError
from dominospec.config import EvaluateParams, Params
from dominospec.eval.prompts import Messages, Suite, load_suite, suite_name

TAU_DEFINITION = "pooled: sum meta_info.completion_tokens / sum meta_info.spec_verify_ct (bonus included)"


def evaluate_server(params: Params, url: str, out: Optional[str] = None, prompts: Optional[str] = None,
                    concurrency: Optional[int] = None, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Params + server URL (+ prompts JSONL, output path, concurrency, keys added to the report) -> the
    serve_eval.json document (written)."""
    from dominospec.files import write_json

    cfg = params.evaluate
    top = concurrency if concurrency is not None else cfg.server_concurrency
    if top < 1:
        raise UserError(f"evaluate.server_concurrency (or --concurrency) must be >= 1, got {top}")
    levels = sorted({1, top})
    url = url.rstrip("/")
    key_env = params.serve.api_key_env  # the variable the built-in server reads its key from, too
    headers = {"Authorization": f"Bearer {os.environ[key_env]}"} if os.environ.get(key_env) else {}
    limits = httpx.Limits(max_connections=top + 2, max_keepalive_connections=top + 2)
    timeout = httpx.Timeout(600.0, connect=10.0)  # a long answer on a busy server takes minutes
    with httpx.Client(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        try:
            model = model_id(client, url)  # first: an unreachable server fails before any loading
            suites, empty = served_suites(params, prompts)
            template_kwargs = params.target.chat_template_kwargs
            warm_up(client, url, request_body(model, suites[0].messages[0], cfg, template_kwargs, 0,
                                              min(8, cfg.max_new_tokens)))
            before = server_accept_length(client, url)
            results = {s.name: {f"c{n}": run_level(client, url, model, s.name, s.messages, cfg, template_kwargs, n)
                                for n in levels} for s in suites}
            after = server_accept_length(client, url)
        except Unauthorized as err:
            state = "is set but the server refused it" if os.environ.get(key_env) else "is not set"
            raise UserError(f"{err} answered 401 Unauthorized: ${key_env} (serve.api_key_env) {state}; "
                            f"export {key_env}=<the server's API key>") from None

    report = {
        "server": url, "model": model, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "concurrency": levels, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "top_k": cfg.top_k, "tau": TAU_DEFINITION, "empty_suites": empty, "suites": results,
        "server_info": {"avg_spec_accept_length_before": before, "avg_spec_accept_length_after": after},
        **(extra or {}),
    }
    out_path = Path(out) if out else Path(params.paths.metrics) / "serve_eval.json"
    write_json(out_path, report)
    print_table(report)
    print(f"wrote {out_path}")
    return report


def served_suites(params: Params, prompts: Optional[str]) -> tuple[list[Suite], dict[str, str]]:
    """Params (+ prompts JSONL) -> (the offline evaluation's non-empty suites, {empty suite: why})."""
    from dominospec.data.target_meta import load_tokenizer

    cfg = params.evaluate
    specs = [prompts] if prompts else list(cfg.suites)
    if not specs or len({suite_name(s) for s in specs}) != len(specs):
        raise UserError(f"evaluate.suites must name distinct suites, got {specs}")
    tokenizer = load_tokenizer(params.target)  # the length limit counts rendered tokens, as offline
    loaded = [load_suite(s, tokenizer, params.target.chat_template_kwargs, params.paths.prepared, cfg.max_prompts,
                         cfg.max_prompt_tokens) for s in specs]
    empty = {s.name: f"no prompt of at most {cfg.max_prompt_tokens} tokens ({s.skipped_too_long} longer)"
             for s in loaded if not s.prompts}
    for name, why in empty.items():
        print(f"warning: suite {name!r} skipped: {why}")
    if len(empty) == len(loaded):
        raise UserError(f"evaluate --server: every suite is empty: {empty}")
    return [s for s in loaded if s.prompts], empty


def request_body(model: str, messages: Messages, cfg: EvaluateParams, chat_template_kwargs: dict[str, Any], i: int,
                 max_tokens: int) -> dict[str, Any]:
    """Prompt i of a suite -> the /v1/chat/completions request body (with `target.chat_template_kwargs` when
    set: the server renders the prompt as the offline evaluation does)."""
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "seed": cfg.seed + i, "return_meta_info": True, "stream": False,
    }
    if chat_template_kwargs:
        body["chat_template_kwargs"] = dict(chat_template_kwargs)
    if cfg.top_k > 0:
        body["top_k"] = cfg.top_k
    if cfg.stop_strings:
        body["stop"] = list(cfg.stop_strings)
    return body


def warm_up(client: httpx.Client, url: str, body: dict[str, Any]) -> None:
    """One short request: the server's first requests allocate and compile; keep them out of the timings."""
    try:
        send(client, url, body)
    except (NotOK, httpx.HTTPError) as err:
        raise UserError(f"{url}/v1/chat/completions: the warm-up request failed: {err}") from None


def run_level(client: httpx.Client, url: str, model: str, name: str, conversations: list[Messages],
              cfg: EvaluateParams, chat_template_kwargs: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Every prompt of a suite, `concurrency` in flight -> the level's metrics (UserError if all fail)."""
    bodies = [request_body(model, m, cfg, chat_template_kwargs, i, cfg.max_new_tokens)
              for i, m in enumerate(conversations)]
    _call(lambda: client.post("/flush_cache"), url)  # status ignored: not every server has one
    with tqdm(total=len(bodies), desc=f"{name} c{concurrency}", unit="req") as bar:
        def one(body: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]], Optional[str]]:
            start = time.perf_counter()
            try:
                answer, error = send(client, url, body), None
            except (NotOK, httpx.HTTPError) as err:  # unreachable, non-JSON, 401: raised, not counted
                answer, error = None, str(err)
            bar.update(1)
            return time.perf_counter() - start, answer, error

        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(one, bodies))
        wall = time.perf_counter() - start
    ok = [(latency, answer) for latency, answer, _ in answers if answer is not None]
    errors = [error for _, answer, error in answers if answer is None]
    if not ok:
        raise UserError(f"{url}/v1/chat/completions: all {len(bodies)} requests of suite {name!r} failed, "
                        f"first: {errors[0]}")
    metas = [answer["choices"][0].get("meta_info") or {} for _, answer in ok]
    metas = [m for m in metas if "spec_verify_ct" in m]
    meta_tokens = sum(int(m["completion_tokens"]) for m in metas)
    rounds = sum(int(m["spec_verify_ct"]) for m in metas)
    tokens = sum(int(answer["usage"]["completion_tokens"]) for _, answer in ok)
    latencies = [latency for latency, _ in ok]
    return {
        "concurrency": concurrency, "n_requests": len(bodies), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "completion_tokens": tokens, "prompt_tokens": sum(int(a["usage"].get("prompt_tokens", 0)) for _, a in ok),
        "meta_info_requests": len(metas), "meta_completion_tokens": meta_tokens, "spec_verify_ct": rounds,
        "acceptance_length": pooled_acceptance(meta_tokens, rounds),
        "wall_s": wall, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
    }


def pooled_acceptance(completion_tokens: int, verify_rounds: int) -> Optional[float]:
    """Σ completion tokens, Σ verify rounds -> pooled τ; None without rounds (no speculative decoding)."""
    return completion_tokens / verify_rounds if verify_rounds > 0 else None


def percentile(values: list[float], q: float) -> float:
    """values, q in [0, 100] -> the q-th percentile, linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class NotOK(RuntimeError):
    """The server answered with a status other than 200 (401 aside)."""


class Unauthorized(Exception):
    """The server answered 401; the message is the URL asked."""


def model_id(client: httpx.Client, url: str) -> str:
    """GET /v1/models -> the first model id."""
    try:
        models = get_json(client, url, "/v1/models")
        return str(models["data"][0]["id"])
    except NotOK as err:
        raise UserError(f"{url}/v1/models: {err}") from None
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{url}/v1/models: no model listed (answer: {str(models)[:200]})") from None


def server_accept_length(client: httpx.Client, url: str) -> Optional[float]:
    """GET /server_info -> avg_spec_accept_length (top level or SGLang's internal_states[0]); None if absent."""
    try:
        info = get_json(client, url, "/server_info")
    except NotOK:
        return None
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states") or [{}]
    value = info.get("avg_spec_accept_length", states[0].get("avg_spec_accept_length"))
    return float(value) if isinstance(value, (int, float)) else None


def get_json(client: httpx.Client, url: str, path: str) -> Any:
    """GET url+path -> the decoded JSON answer (UserError: unreachable, non-JSON; Unauthorized: 401;
    NotOK: other status)."""
    return _checked(_call(lambda: client.get(path), url), url, path)


def send(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One chat completion -> its decoded answer (raises as get_json does; UserError: not a chat completion)."""
    path = "/v1/chat/completions"
    answer = _checked(_call(lambda: client.post(path, json=body), url), url, path)
    if not isinstance(answer, dict) or not answer.get("choices") or "usage" not in answer:
        raise UserError(f"{url}/v1/chat/completions: not an OpenAI chat completion: {str(answer)[:200]}")
    return answer


def _call(request: Callable[[], httpx.Response], url: str) -> httpx.Response:
    try:
        return request()
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.UnsupportedProtocol) as err:
        raise UserError(f"cannot reach the server at {url} ({err}); start one with `make serve`") from None


def _checked(response: httpx.Response, url: str, path: str) -> Any:
    if response.status_code == 401:
        raise Unauthorized(f"{url}{path}")
    try:
        answer = response.json()
    except ValueError:
        if response.status_code != 200:
            raise NotOK(f"HTTP {response.status_code}: {response.text[:200]!r}") from None
        raise UserError(f"{url}{path} answered non-JSON (is this an OpenAI-compatible server?): "
                        f"{response.text[:200]!r}") from None
    if response.status_code != 200:
        raise NotOK(f"HTTP {response.status_code}: {str(answer)[:200]}")
    return answer


def print_table(report: dict[str, Any]) -> None:
    """The report -> a short table on stdout, one line per suite and level."""
    print(f"{'suite':<16}{'conc':>5}{'reqs':>6}{'err':>5}{'tokens':>8}{'tau':>7}{'tok/s':>9}{'req/s':>8}"
          f"{'p50 s':>8}{'p99 s':>8}")
    for name, levels in report["suites"].items():
        for m in levels.values():
            tau = "n/a" if m["acceptance_length"] is None else f"{m['acceptance_length']:.2f}"
            print(f"{name:<16}{m['concurrency']:>5}{m['n_requests']:>6}{m['errors']:>5}{m['completion_tokens']:>8}"
                  f"{tau:>7}{m['tokens_per_s']:>9.1f}{m['requests_per_s']:>8.2f}{m['latency_p50_s']:>8.2f}"
                  f"{m['latency_p99_s']:>8.2f}")
    if all(m["acceptance_length"] is None for levels in report["suites"].values() for m in levels.values()):
        print("note: no meta_info.spec_verify_ct in the answers: the server runs without speculative decoding, "
              "acceptance_length is null")
