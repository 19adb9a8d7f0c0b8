"""README's supported/refused table, its commands table and docs/inputs.md's refused flags are the
code's registries rendered (vtrain_plugin.cli.support_table): a stale file fails here; `make docs`
rewrites it."""

from __future__ import annotations

import pytest

from vtrain_plugin.cli import support_table as st


@pytest.mark.parametrize("name", sorted(st.FILES))
def test_file_matches_the_registries(name: str) -> None:
    path = st.ROOT / name
    assert path.read_text(encoding="utf-8") == st.rendered(path, st.FILES[name]), f"{name} is stale: run make docs"


def test_table_in_the_first_screen() -> None:
    lines = (st.ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert lines.index("<!-- support-table:start -->") < 25


def test_every_refused_flag_is_listed() -> None:
    listed = st.render_refused_flags()
    refused = [f.name for f in st.TABLE.values() if f.effect is st.Effect.REFUSED]
    assert refused and all(f"`{name}`" in listed for name in refused)


def test_a_reason_gone_from_the_table_fails_the_render() -> None:
    with pytest.raises(KeyError, match="not a refused-flag reason"):
        st._reasons("a reason no flag has")


def test_replace_block_needs_its_markers() -> None:
    assert st.replace_block("a\n<!-- x:start -->\nold\n<!-- x:end -->\n", "x", "new") == \
        "a\n<!-- x:start -->\nnew\n<!-- x:end -->\n"
    with pytest.raises(ValueError):
        st.replace_block("no markers", "x", "new")
