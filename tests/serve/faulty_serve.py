"""`dominospec serve` with two real faults injected, for tests/serve/test_faults.py.

Run as `python -m faulty_serve serve --params P` (tests/serve on the path). The server, its engine
and its worker are the real ones; only two functions are wrapped:
  - `SpecEngine.generate` raises RuntimeError("injected fault") after the first tokens have gone
    out (streaming clients see them) when the prompt's text holds GENERATION_FAULT;
  - the completions route's `tokenize` raises RuntimeError before any job exists when the prompt
    holds HANDLER_FAULT (the 500 comes from the request's own thread, not the engine's).
"""

from __future__ import annotations

from dominospec.cli import main
from dominospec.engine import SpecEngine
from dominospec.serve import app

GENERATION_FAULT, HANDLER_FAULT = "t77", "t78"  # single tokens of the tiny target (it splits t299 into t2 t0)

_generate, _tokenize = SpecEngine.generate, app.tokenize


def generate(self, input_ids, max_new_tokens, *args, on_tokens=None, **kwargs):
    if GENERATION_FAULT not in self.target.tokenizer.decode(list(input_ids)):
        return _generate(self, input_ids, max_new_tokens, *args, on_tokens=on_tokens, **kwargs)

    def failing(ids):
        if on_tokens is not None:
            on_tokens(ids)
        raise RuntimeError("injected fault")

    return _generate(self, input_ids, max_new_tokens, *args, on_tokens=failing, **kwargs)


def tokenize(tokenizer, prompt):
    if HANDLER_FAULT in prompt:
        raise RuntimeError("injected handler fault")
    return _tokenize(tokenizer, prompt)


if __name__ == "__main__":  # patched only in the server process: importing the markers changes nothing
    SpecEngine.generate, app.tokenize = generate, tokenize
    raise SystemExit(main())
