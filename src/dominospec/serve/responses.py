"""Response bodies in OpenAI's shape (and SGLang's `meta_info`), whole or as SSE chunks.

Non-streaming: `{id, object, created, model, choices: [{index, message{role, content} | text,
finish_reason, meta_info?}], usage{prompt_tokens, completion_tokens, total_tokens}}`.
Streaming: `data: {chunk}\\n\\n` lines; chat chunks carry `choices[0].delta` (the first one the
role), completion chunks `choices[0].text`; the last chunk has the finish_reason (and meta_info),
then an optional usage chunk (`stream_options.include_usage`), then `data: [DONE]\\n\\n`.

finish_reason: "stop" (stop token or stop string), "length" (max_tokens or the context is full),
"abort" (the client went away).

meta_info, SGLang's per-request names (tokenizer_manager):
  completion_tokens   tokens generated, the one the prefill emits included
  prompt_tokens       prompt length after the chat template
  spec_verify_ct      target verify forwards (GenerationStats.rounds)
  spec_accept_length  completion_tokens / spec_verify_ct, exactly SGLang's definition; it counts the
                      prefill's token too, so it is slightly above GenerationStats.acceptance_length
                      (round tokens / rounds); 0 when no verify round ran (SGLang's value)
  e2e_latency         seconds from the request's arrival to its last token
The two spec_* fields are left out in mode `ar`, as SGLang leaves them out without speculation.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from dominospec.engine import Generation

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "length": "length", "abort": "abort"}
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Envelope:
    """What every body of one request shares."""

    id: str
    created: int
    model: str
    chat: bool

    @classmethod
    def new(cls, model: str, chat: bool) -> "Envelope":
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model, chat)

    def wrap(self, choices: list[dict[str, Any]], chunk: bool, **extra: Any) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, **extra}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def meta_info(generation: Generation, e2e_latency: float, speculative: bool) -> dict[str, Any]:
    """A finished Generation -> SGLang's meta_info fields (see the module docstring)."""
    stats = generation.stats
    info: dict[str, Any] = {"completion_tokens": stats.new_tokens, "prompt_tokens": stats.prompt_tokens}
    if speculative:
        info["spec_verify_ct"] = stats.rounds
        info["spec_accept_length"] = stats.new_tokens / stats.rounds if stats.rounds else 0.0
    info["e2e_latency"] = e2e_latency
    return info


def completion_body(env: Envelope, generation: Generation, meta: Optional[dict[str, Any]]) -> dict[str, Any]:
    """Non-streaming answer."""
    choice: dict[str, Any] = {"index": 0}
    if env.chat:
        choice["message"] = {"role": "assistant", "content": generation.text}
    else:
        choice["text"] = generation.text
    choice.update(logprobs=None, finish_reason=FINISH_REASONS[generation.finish_reason])
    if meta is not None:
        choice["meta_info"] = meta
    return env.wrap([choice], chunk=False, usage=usage(generation.stats.prompt_tokens, generation.stats.new_tokens))


def chunk_body(env: Envelope, text: Optional[str] = None, first: bool = False, finish_reason: Optional[str] = None,
               meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One streaming chunk: a text delta, the chat role (first), or the finish (with meta_info)."""
    choice: dict[str, Any] = {"index": 0}
    if env.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice.update(logprobs=None, finish_reason=FINISH_REASONS[finish_reason] if finish_reason else None)
    if meta is not None:
        choice["meta_info"] = meta
    return env.wrap([choice], chunk=True)


def usage_chunk(env: Envelope, generation: Generation) -> dict[str, Any]:
    """The extra last chunk OpenAI sends with `stream_options.include_usage`."""
    return env.wrap([], chunk=True, usage=usage(generation.stats.prompt_tokens, generation.stats.new_tokens))


def sse(body: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
