"""Every module of the three packages opens with a docstring that says what it is in at most three
lines (its first paragraph; the why follows in the next ones): docs/layout.md lists modules by it."""

from __future__ import annotations

import ast

import pytest

from vtrain_plugin.cli import support_table as st

MODULES = sorted(path for package in st.PACKAGES for path in (st.ROOT / package).rglob("*.py"))


def _first_paragraph_lines(path) -> int | None:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return len(doc.strip().split("\n\n")[0].splitlines()) if doc else None


def test_every_module_says_what_it_is_in_three_lines() -> None:
    assert len(MODULES) > 100
    found = {path.relative_to(st.ROOT).as_posix(): _first_paragraph_lines(path) for path in MODULES}
    assert [name for name, lines in found.items() if lines is None] == [], "modules without a docstring"
    assert {name: lines for name, lines in found.items() if lines > 3} == {}, "first paragraphs over 3 lines"


def test_a_module_without_a_docstring_fails_the_layout(tmp_path) -> None:
    path = st.ROOT / "vtrain_plugin" / "core" / "errors.py"
    assert st.module_summary(path) == "One exception family for everything a user can get wrong."
    bare = tmp_path / "bare.py"
    bare.write_text("x = 1\n")
    with pytest.raises(ValueError, match="no module docstring"):
        st.module_summary(bare)
