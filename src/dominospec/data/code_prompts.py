"""Code prompts for the target to answer: Python functions, each asked to be completed.

ShareGPT is mostly prose (few of its first turns hold code), so a draft that learns the target's
ShareGPT replies meets code out of its distribution: on HumanEval the H200 preset's draft accepted
clearly fewer tokens a round than on ShareGPT (both numbers are in
docs/journal/2026-12-02-the-h200-preset-again-with-draft-trees-in-the-engine.md). Self-distillation
needs prompts, not answers, and every Python installation carries thousands of documented functions. So
`code_prompts(root, limit)` turns each one into a request in the form the `humaneval` suite
asks: its signature and docstring, to be completed. The target writes the answer (the regenerate
stage), so the draft learns the target's own code.

    root/**/*.py --ast--> functions with a docstring and a body beyond it (not dunder methods)
                 --"def f(...):\n    \"\"\"doc\"\"\"\n" (dedented)--> one user message each
                 --the first `limit` in a fixed hash order (spread over the modules)--> CodePrompt

Nothing is imported or run: files are only parsed. Files that are not UTF-8 or not valid Python
for this interpreter are skipped and counted. Folders of tests and of third-party packages
(`site-packages`) are not walked, so `stdlib` means the standard library alone.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dominospec.errors import UserError

STDLIB = "stdlib"
# The request the `humaneval` suite sends (eval.prompts), so training prompts and that suite agree.
COMPLETE_FUNCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"
SKIPPED_FOLDERS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"})
MAX_PROMPT_CHARS = 2000  # longer signatures + docstrings are reference pages, not tasks


@dataclass(frozen=True)
class CodePrompt:
    """One function as a request: `id` = "code:<relative path>:<qualified name>"."""

    id: str
    content: str  # the user message


@dataclass
class CodePrompts:
    """The prompts taken, how many functions qualified, and the files skipped (reason -> count)."""

    root: Path
    prompts: list[CodePrompt]
    functions: int
    skipped: Counter = field(default_factory=Counter)


def resolve_root(root: str) -> Path:
    """`regenerate.code_prompts_root` -> a folder: "stdlib" = this interpreter's standard library."""
    path = Path(sysconfig.get_paths()["stdlib"]) if root == STDLIB else Path(root)
    if not path.is_dir():
        raise UserError(f"regenerate.code_prompts_root: {path} is not a folder of Python files (or use '{STDLIB}')")
    return path


def code_prompts(root: str, limit: int) -> CodePrompts:
    """A folder of .py files (or "stdlib") -> up to `limit` function-completion requests, in a fixed order."""
    folder = resolve_root(root)
    found: list[CodePrompt] = []
    skipped: Counter = Counter()
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder)
        if SKIPPED_FOLDERS.intersection(relative.parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source, filename=str(path))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            skipped["unparsable_file"] += 1
            continue
        except OSError:
            skipped["unreadable_file"] += 1
            continue
        lines = source.splitlines(keepends=True)
        for qualname, node in documented_functions(tree):
            stub = function_stub(lines, node)
            if stub is not None and len(stub) <= MAX_PROMPT_CHARS:
                found.append(CodePrompt(f"code:{relative.as_posix()}:{qualname}", COMPLETE_FUNCTION.format(prompt=stub)))
    if not found:
        raise UserError(f"regenerate.code_prompts_root: no documented Python functions under {folder}")
    found.sort(key=lambda p: hashlib.sha256(p.id.encode()).digest())  # spread over modules, same on every run
    return CodePrompts(folder, found[:limit], len(found), skipped)


def documented_functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module -> (qualified name, node) of every function and method with a docstring and more after it."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dunder = node.name.startswith("__") and node.name.endswith("__")
                if not dunder and ast.get_docstring(node) and len(node.body) >= 2:
                    out.append((prefix + node.name, node))

    visit(tree.body, "")
    return out


def function_stub(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Source lines + a documented function -> its `def` line(s) and docstring, dedented; None if not one block."""
    first = node.lineno - 1  # the def line (decorators dropped: they belong to the body's contract)
    docstring = node.body[0]
    last = docstring.end_lineno  # 1-based, inclusive
    if last is None or last <= first:
        return None
    stub = textwrap.dedent("".join(lines[first:last]))
    return stub if stub.endswith("\n") else stub + "\n"
