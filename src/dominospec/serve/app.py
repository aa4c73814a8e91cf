"""The built-in server's routes: SGLang's OpenAI-compatible subset on top of one `Service`.

    POST /v1/chat/completions   messages (+ chat_template_kwargs) -> chat template -> answer (stream or not)
    POST /v1/completions        prompt string, tokenized as is -> answer (stream or not)
    GET  /v1/models             the one served model (owned_by "dominospec")
    GET  /health                200 {} while the engine worker runs, else 503
    GET  /server_info           mode, draft, limits, counters, pooled avg_spec_accept_length

Everything else is 404 / 405 in OpenAI's error shape (errors.py); `Guards` (bearer key, body size)
wraps the whole app. Rendering and tokenizing run in a worker thread; torch only in the engine's.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from jinja2.exceptions import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from dominospec.errors import UserError
from dominospec.data.chat import TemplateKwargsError, render_prompt as render
from dominospec.serve.errors import ApiError, install_handlers
from dominospec.serve.guards import Guards
from dominospec.serve.requests import ChatRequest, CompletionRequest, parse_request
from dominospec.serve.service import Service


def build_app(service: Service) -> FastAPI:
    """Service -> the FastAPI app, guards (service.api_key, serve.max_body_bytes) and error handlers installed."""
    app = FastAPI(title="dominospec", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    app.add_middleware(Guards, api_key=service.api_key, max_body_bytes=service.limits.max_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not service.worker.alive:
            raise ApiError(503, "the engine worker has stopped", None, "engine_down")
        return {}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return service.server_info()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_request(await request.body(), ChatRequest)
        prompt_ids = await run_in_threadpool(render_chat, service.tokenizer, body.chat_messages(),
                                             body.template_kwargs(service.chat_template_kwargs))
        service.check_prompt(prompt_ids, "messages")
        return await service.answer(request, body, prompt_ids, chat=True, arrived=arrived)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()
        body = parse_request(await request.body(), CompletionRequest)
        prompt_ids = await run_in_threadpool(tokenize, service.tokenizer, body.prompt)
        service.check_prompt(prompt_ids, "prompt")
        return await service.answer(request, body, prompt_ids, chat=False, arrived=arrived)

    return app


def render_chat(tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any]) -> list[int]:
    """Chat messages + template variables -> prompt ids via the target's chat template; ApiError 400 when it
    refuses them."""
    try:
        return render(tokenizer, messages, chat_template_kwargs)
    except TemplateKwargsError as err:
        raise ApiError(400, str(err), "chat_template_kwargs", "invalid_value") from None
    except UserError as err:  # no chat template
        raise ApiError(400, f"{err}: use /v1/completions", "messages", "no_chat_template") from None
    except TemplateError as err:  # e.g. a template that requires alternating roles
        raise ApiError(400, f"'messages': the chat template refuses them: {err}", "messages", "invalid_value") from None


def tokenize(tokenizer: Any, prompt: str) -> list[int]:
    """Completion prompt -> ids, the tokenizer's own special tokens added (as SGLang's `encode`)."""
    return list(tokenizer(prompt)["input_ids"])
