"""Code prompts: documented Python functions as completion requests, in the humaneval suite's form."""

from __future__ import annotations

import sysconfig
import textwrap

import pytest

from dominospec.data.code_prompts import COMPLETE_FUNCTION, code_prompts
from dominospec.errors import UserError
from dominospec.eval.prompts import humaneval_conversations

MODULE = '''\
import os


def area(width, height):
    """Area of a width x height rectangle."""
    return width * height


def undocumented(x):
    return x


def only_a_docstring():
    """Nothing after it: no body to complete."""


class Shape:
    def __init__(self, sides):
        """Dunder methods are not tasks."""
        self.sides = sides

    async def perimeter(self, length):
        """Perimeter of a regular shape
whose docstring leaves the indentation."""
        return self.sides * length
'''


@pytest.fixture
def source_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "shapes.py").write_text(MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_shapes.py").write_text('def test_area():\n    """A test."""\n    assert True\n')
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "latin1.py").write_bytes(b'def g():\n    """caf\xe9"""\n    return 1\n')
    return tmp_path


def test_documented_functions_become_requests(source_tree):
    found = code_prompts(str(source_tree), limit=10)
    by_id = {p.id: p.content for p in found.prompts}
    assert set(by_id) == {"code:pkg/shapes.py:area", "code:pkg/shapes.py:Shape.perimeter"}
    stub = 'def area(width, height):\n    """Area of a width x height rectangle."""\n'
    assert by_id["code:pkg/shapes.py:area"] == COMPLETE_FUNCTION.format(prompt=stub)
    perimeter = by_id["code:pkg/shapes.py:Shape.perimeter"]
    assert "async def perimeter(self, length):" in perimeter and "return" not in perimeter  # the body is the task
    assert found.functions == 2 and dict(found.skipped) == {"unparsable_file": 2}  # tests/ is not walked


def test_the_limit_takes_a_fixed_spread_order(source_tree):
    one = code_prompts(str(source_tree), limit=1).prompts
    assert len(one) == 1 and one == code_prompts(str(source_tree), limit=1).prompts
    assert one[0] == code_prompts(str(source_tree), limit=5).prompts[0]


def test_the_standard_library_gives_thousands_of_distinct_requests():
    found = code_prompts("stdlib", limit=3000)
    assert str(found.root) == sysconfig.get_paths()["stdlib"]
    assert found.functions > 3000 and len(found.prompts) == 3000
    assert len({p.id for p in found.prompts}) == 3000
    modules = {p.id.split(":")[1] for p in found.prompts}
    assert len(modules) > 200  # spread over the library, not the first files in path order
    assert all("/site-packages/" not in p.id and not p.id.startswith("code:test/") for p in found.prompts)


def test_requests_are_asked_as_the_humaneval_suite_asks():
    first = next(iter(humaneval_conversations()))[0]["content"]
    head, tail = COMPLETE_FUNCTION.split("{prompt}")
    assert first.startswith(head) and first.endswith(tail)


def test_a_root_without_functions_or_without_a_folder_is_named(tmp_path):
    (tmp_path / "empty.py").write_text(textwrap.dedent("x = 1\n"))
    with pytest.raises(UserError, match="no documented Python functions under"):
        code_prompts(str(tmp_path), limit=5)
    with pytest.raises(UserError, match="code_prompts_root: .*missing.* is not a folder"):
        code_prompts(str(tmp_path / "missing"), limit=5)
