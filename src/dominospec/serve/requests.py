"""Request bodies of `POST /v1/chat/completions` and `POST /v1/completions`: parsed and checked.

`parse_request(raw bytes, ChatRequest | CompletionRequest)` -> the model, or ApiError 400 naming
the field: broken JSON (NaN and Infinity included), a body that is not an object, a wrong type
(types are strict: "0.5" is not a float, true is not an int), a value out of range. Unknown fields
are ignored, as OpenAI clients send many (`user`, `logprobs: false`, ...). Limits that come from
params (`serve.max_tokens_limit`, `serve.max_prompt_tokens`) are checked by the app.

Accepted fields (SGLang's OpenAI subset):
  model             optional, any string: SGLang 0.5.23 does not check it (its clients send
                    "default"); the answer echoes it, or names the served model when absent
  messages (chat)   [{role, content: str | [{type: "text", text}]}], >= 1; role is one of SGLang's
                    (system user assistant developer tool function root latest_reminder), in any
                    case, passed to the chat template in lower case
  prompt (compl.)   a non-empty string, tokenized as is (no chat template)
  chat_template_kwargs (chat)  an object of chat-template variables (SGLang's and vLLM's extension,
                    e.g. Qwen3's {"enable_thinking": false}), over `target.chat_template_kwargs`
                    key by key; a key that is an argument of `apply_chat_template` (`tokenize`, ...) is 400
  max_tokens        >= 1 (chat: `max_completion_tokens` wins when both are given)
  temperature       >= 0; below 1e-6 decodes greedily (SGLang's rule)
  top_p             (0, 1];   top_k  -1 or 0 = off, else >= 1
  stop              a string or a list of at most 4 strings, each 1..256 characters
  seed              0 <= seed < 2**63;   n  only 1
  stream, stream_options.include_usage, return_meta_info   booleans
Sampling fields a chat request leaves out take the target's generation_config.json value, else
temperature 1, top_p 1, top_k off: SGLang's default `--sampling-defaults model`, which SGLang
applies to chat only; a completion request gets temperature 1, top_p 1, top_k off.

Where this subset still differs from SGLang 0.5.23 (`sglang/srt/entrypoints/openai/`), and why:
  stricter  n > 1, batched or token-id prompts, tool calls (content null, tools, tool_choice),
            non-text content parts (SGLang refuses images for a text model too): the engine runs
            one text sequence per request, without tools;
            more than 4 stop strings or one over 256 characters (OpenAI's limit; bounds the
            streamer's look-behind);
            strict JSON types ("0.5" is not a float, true is not an int; SGLang coerces them):
            a client bug is named instead of guessed at;
            max_tokens above serve.max_tokens_limit and prompts above serve.max_prompt_tokens
            (SGLang checks the context length only): a server's own limits, set them high to lift
            them; max_tokens 0 in chat (SGLang answers nothing).
  looser    top_k 0 means off (SGLang: -1 only), a null temperature/top_p in a completion request
            (SGLang: 400), any seed below 2**63: a request SGLang refuses gets an answer here, which
            no SGLang client relies on.
  ignored   every other field SGLang knows (logprobs, penalties, min_p, regex, lora_path, ...),
            as unknown fields are.
tests/serve/test_errors.py pins each alignment.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dominospec.engine import Sampling
from dominospec.serve.errors import ApiError, validation_error

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # bounds the streamer's stop-string look-behind
GREEDY_BELOW = 1e-6  # SGLang decodes greedily below this temperature
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


ROLES = ("system", "user", "assistant", "developer", "tool", "function", "root", "latest_reminder")  # SGLang's


class Message(Strict):
    role: str
    content: str

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role.lower() not in ROLES:
            raise ValueError(f"must be one of {', '.join(map(repr, ROLES))} (any case)")
        return role.lower()

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, content: Any) -> Any:
        """A list of text parts [{type: "text", text}] -> their concatenation."""
        if isinstance(content, list):
            text_parts = (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
            if not all(text_parts):
                raise ValueError('must be a string or a list of {"type": "text", "text": string} parts')
            content = "".join(p["text"] for p in content)
        if isinstance(content, str) and not is_unicode(content):
            raise ValueError("must be valid Unicode text: it holds a lone surrogate escape (\\ud800-\\udfff)")
        return content


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """The fields both endpoints share."""

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    top_p: Optional[float] = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1)
    stop: Any = ()  # -> tuple of strings (the validator runs on given values only)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    n: int = 1
    return_meta_info: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if not all(1 <= len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"every stop string must have 1..{MAX_STOP_CHARS} characters")
        if not all(map(is_unicode, stops)):
            raise ValueError("must be valid Unicode text: a stop string holds a lone surrogate escape")
        return tuple(stops)

    @field_validator("model")
    @classmethod
    def _model(cls, model: Optional[str]) -> Optional[str]:
        if model is not None and not is_unicode(model):  # it is echoed in the answer, which is UTF-8
            raise ValueError("must be valid Unicode text: it holds a lone surrogate escape")
        return model

    @field_validator("n")
    @classmethod
    def _n(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    uses_model_defaults: ClassVar[bool] = False  # SGLang applies generation_config sampling defaults to chat only

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def sampling(self, defaults: dict[str, Any]) -> Sampling:
        """Request fields, else (chat only) the target's generation_config `defaults`, else SGLang's
        -> Sampling."""
        defaults = defaults if self.uses_model_defaults else {}

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        temperature = float(pick("temperature", 1.0))
        top_k = int(pick("top_k", -1))
        return Sampling(temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                        top_p=float(pick("top_p", 1.0)), top_k=max(top_k, 0))


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    uses_model_defaults: ClassVar[bool] = True

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]

    def template_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The served chat-template variables (`target.chat_template_kwargs`) -> those of this request: its own
        `chat_template_kwargs` over them, key by key."""
        return {**defaults, **(self.chat_template_kwargs or {})}


class CompletionRequest(SamplingFields):
    prompt: str = Field(min_length=1)


def parse_request(raw: bytes, model: type[SamplingFields]) -> SamplingFields:
    """Request body bytes -> a validated `model`; ApiError 400 naming the field otherwise."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty: expected a JSON object", None, "invalid_json")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", None, "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise validation_error(err.errors()) from None


def sampling_defaults(generation_config: Any) -> dict[str, Any]:
    """A model's GenerationConfig -> the sampling values its generation_config.json sets explicitly."""
    if generation_config is None:
        return {}
    explicit = generation_config.to_diff_dict()
    return {key: explicit[key] for key in SAMPLING_KEYS if explicit.get(key) is not None}


def is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON's "\\udc00" escape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
