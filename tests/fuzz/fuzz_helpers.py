"""Shared pieces of the fuzz suite: the settings every property runs under, the tally of inputs
tried, and strategies for JSON-like values.

`fuzz(examples)` fixes a property's example count and makes it deterministic (derandomized: the same
inputs on every run, no example database); each call of the property body is one input tried, counted
in `TRIED` and printed at the end of the run (conftest.py).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

TRIED: Counter = Counter()  # property name -> inputs tried this run

FUZZ = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(examples: int) -> Callable:
    """Decorator under `@given`: `examples` inputs, derandomized, each one counted in TRIED."""

    def wrap(test: Callable) -> Callable:
        @functools.wraps(test)
        def counted(*args: Any, **kwargs: Any) -> Any:
            TRIED[test.__name__] += 1
            return test(*args, **kwargs)

        return settings(FUZZ, max_examples=examples)(counted)

    return wrap


LONE_SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"])  # JSON may escape them; UTF-8 cannot hold them
TEXT = st.one_of(st.text(max_size=12), st.builds(lambda a, s: a + s, st.text(max_size=6), LONE_SURROGATES),
                 st.sampled_from(["", " ", "\n", "\t \n", "user", "gpt", "human", "Assistant", "SYSTEM"]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(TEXT, kids, max_size=4),
                    max_leaves=10)
