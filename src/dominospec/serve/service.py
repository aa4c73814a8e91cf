"""From a parsed request to its answer: checks against the limits, the job, and the response.

`Service` holds what the routes share: the engine worker, the tokenizer, the served name, the
limits of `serve:` and the static facts `/server_info` reports. Per request:
  1. `model` is not checked, as SGLang does not check it (its clients send "default"); the answer
     echoes it, or carries the served name when the request has none;
  2. the prompt (rendered and tokenized by the route) must fit `serve.max_prompt_tokens` and leave
     room in the target's context (400); max_tokens must lie in 1..serve.max_tokens_limit (400);
  3. the job is queued (503 queue_full when `serve.max_queue` jobs already wait);
  4. non-streaming: the answer once the worker is done (the client is polled every 0.25 s, and a
     vanished one cancels the job); streaming: SSE chunks as rounds commit tokens.
"""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dominospec.config import ServeParams
from dominospec.serve.errors import ApiError
from dominospec.serve.requests import ChatRequest, SamplingFields
from dominospec.serve.responses import (
    DONE, Envelope, chunk_body, completion_body, meta_info, sse, usage_chunk,
)
from dominospec.serve.streaming import TextStreamer
from dominospec.serve.worker import EngineWorker, Job

POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however the stream ends (done, error, disconnect)."""

    def __init__(self, job: Job, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


@dataclass
class Service:
    """What the routes share; see the module docstring."""

    worker: EngineWorker
    tokenizer: Any
    chat_template_kwargs: dict[str, Any]  # params target.chat_template_kwargs; a request's own win key by key
    name: str  # the served model name
    limits: ServeParams
    sampling_defaults: dict[str, Any]  # the target's generation_config sampling values
    context_length: int  # the target's max_position_embeddings
    info: dict[str, Any]  # static part of /server_info
    speculative: bool  # mode dflash / domino (meta_info and τ carry spec_* fields)
    api_key: Optional[str] = field(default=None, repr=False)  # bearer key of /v1/*; None = open

    # ---- request -> job ---------------------------------------------------------------------

    def answer_model(self, body: SamplingFields) -> str:
        """The `model` an answer carries: the request's, as SGLang echoes it, else the served name."""
        return body.model if body.model is not None else self.name

    def max_new_tokens(self, body: SamplingFields) -> int:
        requested = body.requested_max_tokens()
        limit = self.limits.max_tokens_limit
        if requested is None:
            return min(self.limits.default_max_tokens, limit)
        if requested > limit:
            chat_field = isinstance(body, ChatRequest) and body.max_completion_tokens is not None
            param = "max_completion_tokens" if chat_field else "max_tokens"
            raise ApiError(400, f"'{param}': at most {limit} tokens may be requested (serve.max_tokens_limit), "
                                f"got {requested}", param, "invalid_value")
        return requested

    def check_prompt(self, prompt_ids: list[int], param: str) -> None:
        n, limit = len(prompt_ids), self.limits.max_prompt_tokens
        if n == 0:
            raise ApiError(400, f"'{param}': the prompt is empty after tokenization", param, "invalid_value")
        if n > limit:
            raise ApiError(400, f"'{param}': the prompt has {n} tokens, more than {limit} (serve.max_prompt_tokens)",
                           param, "prompt_too_long")
        if n >= self.context_length:
            raise ApiError(400, f"'{param}': the prompt has {n} tokens but the target's context holds "
                                f"{self.context_length}: no room to generate", param, "context_length_exceeded")

    async def answer(self, request: Request, body: SamplingFields, prompt_ids: list[int], chat: bool,
                     arrived: float) -> Response:
        """A checked request and its prompt ids -> queued job -> JSON answer or SSE stream."""
        job = Job(prompt_ids=prompt_ids, max_new_tokens=self.max_new_tokens(body),
                  sampling=body.sampling(self.sampling_defaults), stop_strings=body.stop, seed=body.seed,
                  stream=body.stream, loop=asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except queue.Full:
            raise ApiError(503, f"the server is busy: {self.limits.max_queue} requests are already waiting "
                                "(serve.max_queue); retry later", None, "queue_full") from None
        env = Envelope.new(self.answer_model(body), chat)
        if body.stream:
            return JobStream(job, self._stream(job, env, body, arrived))
        return await self._complete(request, job, env, body, arrived)

    # ---- job -> response --------------------------------------------------------------------

    async def _complete(self, request: Request, job: Job, env: Envelope, body: SamplingFields,
                        arrived: float) -> Response:
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(job.events.get(), timeout=POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)  # client closed the request: nobody reads this
                    continue
                if kind == "error":
                    raise ApiError(500, f"generation failed: {type(payload).__name__}: {payload}", None, "internal_error")
                if kind == "done":
                    break
        finally:
            job.cancel()
        meta = self._meta(payload, arrived) if body.return_meta_info else None
        return JSONResponse(completion_body(env, payload, meta))

    async def _stream(self, job: Job, env: Envelope, body: SamplingFields, arrived: float) -> AsyncIterator[str]:
        streamer = TextStreamer(self._decode, body.stop)
        if env.chat:
            yield sse(chunk_body(env, first=True))
        while True:
            kind, payload = await job.events.get()
            if kind == "tokens":
                delta = streamer.push(payload)
                if delta:
                    yield sse(chunk_body(env, delta))
            elif kind == "error":
                error = ApiError(500, f"generation failed: {type(payload).__name__}: {payload}", None, "internal_error")
                yield sse(error.body())
                yield DONE
                return
            else:
                rest = streamer.finish(payload.text)
                if rest:
                    yield sse(chunk_body(env, rest))
                meta = self._meta(payload, arrived) if body.return_meta_info else None
                yield sse(chunk_body(env, finish_reason=payload.finish_reason, meta=meta))
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield sse(usage_chunk(env, payload))
                yield DONE
                return

    def _meta(self, generation: Any, arrived: float) -> dict[str, Any]:
        return meta_info(generation, time.perf_counter() - arrived, self.speculative)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)  # as SpecEngine decodes

    # ---- info routes ------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        card = {"id": self.name, "object": "model", "created": self.info["started"], "owned_by": "dominospec",
                "root": self.name, "max_model_len": self.context_length}
        return {"object": "list", "data": [card]}

    def server_info(self) -> dict[str, Any]:
        counts = self.worker.counters.snapshot()
        tau: Optional[float] = None
        if self.speculative:
            rounds = counts["verify_rounds"]
            tau = counts["completion_tokens"] / rounds if rounds else 0.0
        requests = {**counts, "waiting": self.worker.waiting}
        return {**self.info, "avg_spec_accept_length": tau, "internal_states": [{"avg_spec_accept_length": tau}],
                "requests": requests}
