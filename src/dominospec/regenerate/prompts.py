"""What the static decoder answers: prompts from every source, and the reply jobs made of them.

    conversation_prompts(data, count, max_turns)   every assistant turn k of a conversation (the first
                                                   max_turns; null: all) -> the messages before it: the
                                                   target answers user turn k given the conversation so far
    code_chat_prompts(code)                        each code request as one user turn
    magpie_prefix(tokenizer, kwargs)               the chat template's text up to a user turn's content:
                                                   the target continues it (Magpie), writing a prompt
    magpie_verdict(reply, ...)                     why a self-written prompt is dropped, or None
    reply_jobs(tokenizer, prompts, variants, ...)  prompts x variants -> (jobs, what each answers)

A variant is (temperature, index): the main reply at `regenerate.temperature` (index 0), then
`samples` replies at each of `sample_temperatures`. Every job's seed is a hash of (regenerate.seed,
the prompt's id, the variant), so a sampled reply is the same in every run and on every machine
(`picking`). A prompt whose rendering leaves no room before `max_length` gets no job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dominospec.config import RegenerateParams
from dominospec.data.chat import TemplateKwargs, render_text
from dominospec.data.code_prompts import CodePrompts
from dominospec.data.conversations import ASSISTANT
from dominospec.regenerate.decoder import Reply
from dominospec.regenerate.picking import seed_of
from dominospec.regenerate.static_decoder import ReplyJob

SENTINEL = "\u2063MAGPIE\u2063"  # a user turn's content, to find where the template puts it


@dataclass(frozen=True)
class Prompt:
    """Messages the target answers (they end before an assistant turn), from `source`, named `id`."""

    source: str  # "sharegpt" | "code" | "magpie" | "val"
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class JobOf:
    """Which prompt and variant a job answers."""

    prompt: int  # index into the prompts
    temperature: float
    index: int  # 0: the main reply; 1..: the samples at this temperature


def conversation_prompts(data: Any, count: int, max_turns: Optional[int], source: str) -> list[Prompt]:
    """The first `count` conversations -> one prompt per assistant turn (the first `max_turns`; None: all),
    in order; turn 0 keeps the conversation's id, turn k is `<id>/turn<k>`."""
    prompts = []
    for row in data.select(range(count)).select_columns(["id", "messages"]):
        messages, turn = row["messages"], 0
        for k, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            if max_turns and turn == max_turns:
                break
            name = row["id"] if turn == 0 else f"{row['id']}/turn{turn}"
            prompts.append(Prompt(source, name, tuple((m["role"], m["content"]) for m in messages[:k])))
            turn += 1
    return prompts


def code_chat_prompts(code: CodePrompts) -> list[Prompt]:
    """Code requests -> one user-turn prompt each (ids "code:...")."""
    return [Prompt("code", p.id, (("user", p.content),)) for p in code.prompts]


def magpie_prefix(tokenizer: Any, chat_template_kwargs: TemplateKwargs) -> str:
    """The chat template's rendering of a conversation of one user turn, cut where that turn's content
    starts (SmolLM2: its default system turn, then `<|im_start|>user\\n`)."""
    text = render_text(tokenizer, [{"role": "user", "content": SENTINEL}], False, chat_template_kwargs)
    if SENTINEL not in text:
        raise ValueError("the chat template does not render a user turn's content: no prefix to continue")
    return text[: text.index(SENTINEL)]


def magpie_verdict(reply: Reply, text: str, special_ids: set[int], min_tokens: int) -> Optional[str]:
    """A self-written prompt (its reply from the user prefix, decoded to `text`) -> why it is dropped, or None."""
    if reply.loop_cut:
        return "loop"
    if not reply.stopped:
        return "no_end_of_turn"  # it ran to magpie_max_prompt_tokens
    if not text.strip():
        return "empty"
    if len(reply.tokens) < min_tokens:
        return "too_short"
    if special_ids.intersection(reply.tokens):
        return "special_token"  # a role marker inside the prompt: the template's turns would not hold
    return None


def variants(cfg: RegenerateParams, greedy_only: bool = False) -> list[tuple[float, int]]:
    """The replies asked per prompt: (temperature, index), the main one first."""
    if greedy_only:
        return [(cfg.temperature, 0)]
    return [(cfg.temperature, 0)] + [(t, i + 1) for t in cfg.sample_temperatures for i in range(cfg.samples)]


def reply_jobs(
    tokenizer: Any, prompts: Sequence[Prompt], wanted: Sequence[tuple[float, int]], cfg: RegenerateParams,
    max_length: int, chat_template_kwargs: TemplateKwargs,
) -> tuple[list[ReplyJob], list[JobOf]]:  # fmt: skip
    """Prompts x variants -> (jobs, what each answers); budgets fit max_length (a prompt with no room: no job)."""
    texts = [render_text(tokenizer, p.as_messages(), True, chat_template_kwargs) for p in prompts]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    jobs, of = [], []
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        budget = min(cfg.max_new_tokens, max_length - len(ids))
        if budget < 1:
            continue
        ids = tuple(ids)  # one tuple shared by the prompt's variants
        for temperature, index in wanted:
            jobs.append(ReplyJob(ids, budget, temperature, seed_of(cfg.seed, prompt.source, prompt.id, temperature,
                                                                   index)))
            of.append(JobOf(i, temperature, index))
    return jobs, of


def sequence_id(prompt: Prompt, job: JobOf) -> str:
    """The row id of a reply: the prompt's id, with the variant for a sample."""
    return prompt.id if job.index == 0 else f"{prompt.id}/T{job.temperature:g}-{job.index}"
