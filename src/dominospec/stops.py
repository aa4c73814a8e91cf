"""When generation stops, and its text: end-of-sequence tokens and stop strings (the token budget is the
engine's, engine.round.admit).

The stop tokens: the tokenizer's EOS, the model's `generation_config.eos_token_id` and the chat template's
end-of-turn token (`<|im_end|>`, `<|eot_id|>`), found by rendering a short exchange; a stop token is part
of the output ids. `IncrementalDetokenizer` keeps stop strings at O(new tokens) a step (TGI / vLLM's
offsets): it decodes the tokens since `prefix_offset` with and without the new ones and releases the
difference unless it ends in U+FFFD. Invariant: `text` == decode(tokens[:read_offset]).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence


def end_of_turn_id(tokenizer: Any) -> Optional[int]:
    """Tokenizer -> id of the special token right after an assistant message in its chat template, or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "dominospec-end-of-turn-probe"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # templates may refuse odd conversations; then there is no marker to find
        return None
    at = text.rfind(marker)
    if at < 0:
        return None
    tail = tokenizer(text[at + len(marker) :], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    first = next((t for t in tail if not tokenizer.decode([t]).isspace()), None)
    return first if first in special else None


def stop_token_ids(tokenizer: Any, model: Any) -> tuple[int, ...]:
    """Tokenizer + HF model -> the token ids that end a generation, each once, in this order: the
    tokenizer's EOS, the model's generation EOS ids, the chat template's end-of-turn token. The
    engine and regenerate's batched decoder stop on the same ids (regenerate pads with the first)."""
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    candidates = [tokenizer.eos_token_id, *(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]),
                  end_of_turn_id(tokenizer)]
    return tuple(dict.fromkeys(int(t) for t in candidates if t is not None))


def cut_at_stop_string(text: str, stop_strings: tuple[str, ...], search_from: int = 0) -> Optional[int]:
    """Decoded text -> index where the earliest stop string starts (at or after `search_from`), or None."""
    hits = [i for s in stop_strings if (i := text.find(s, search_from)) >= 0]
    return min(hits) if hits else None


class IncrementalDetokenizer:
    """Token ids pushed in, text deltas out; `text` is everything released so far."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.tokens: list[int] = []
        self.prefix_offset = 0  # start of the context window (tokens already in `text`)
        self.read_offset = 0  # tokens[:read_offset] are in `text`
        self.text = ""

    def push(self, ids: Sequence[int]) -> str:
        """Newly committed ids -> the text they complete (possibly "", when bytes are still missing)."""
        self.tokens.extend(int(t) for t in ids)
        before, after = self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def preview(self) -> str:
        """`text` plus what the held-back tokens already decode to, without a trailing U+FFFD."""
        if self.read_offset == len(self.tokens):
            return self.text
        before, after = self._window()
        return self.text + after[len(before) :].rstrip("\ufffd")

    def _window(self) -> tuple[str, str]:
        """-> decode(tokens[prefix_offset:read_offset]), decode(tokens[prefix_offset:])."""
        window = self.tokens[self.prefix_offset :]
        done = self.read_offset - self.prefix_offset
        return (self.decode(window[:done]) if done else ""), (self.decode(window) if window else "")
