"""Composing sglang/srt/mem_cache/hicache_ack_sync.py from the plugin's sources
(tools/intree/module.py) as they change: what it cannot follow fails naming it;
a comment naming the package is left out. Sources are edited in copies."""

from __future__ import annotations

import re

import pytest

from hicache_async_ack.tools.intree import module as composer


def _compose_with(monkeypatch, tmp_path, label: str, edit) -> str:
    sources = []
    for name, path in composer.SOURCES:
        if name == label:
            copy = tmp_path / name
            copy.write_text(edit(path.read_text()))
            path = copy
        sources.append((name, path))
    monkeypatch.setattr(composer, "SOURCES", tuple(sources))
    return composer.compose()


@pytest.mark.parametrize(
    "label, edit, message",
    [
        (
            "ack_sync.py",
            lambda t: t.replace(
                "import itertools\n", "import itertools\n\nfrom .metrics import X\n"
            ),
            "ack_sync.py:",
        ),
        (
            "ack_sync.py",
            lambda t: t.replace('"""What is kept per', '"""What the plugin keeps per'),
            "names this package or its plugin form",
        ),
        (
            "env.py",
            lambda t: t.replace("DEPTH_MAX = 8", "DEPTH_LIMIT_ = 8"),
            "imports DEPTH_MAX from .env",
        ),
    ],
    ids=["unknown-local-import", "docstring-names-plugin", "name-gone"],
)
def test_the_composition_fails_naming_what_it_cannot_follow(
    monkeypatch, tmp_path, label, edit, message
):
    with pytest.raises(composer.ComposeError, match=re.escape(message)):
        _compose_with(monkeypatch, tmp_path, label, edit)


def test_a_comment_naming_the_package_is_left_out(monkeypatch, tmp_path):
    note = "# wired up by hicache_async_ack.sglang_plugin"
    text = _compose_with(
        monkeypatch,
        tmp_path,
        "core.py",
        lambda t: t.replace("class Stamp:", f"{note}\nclass Stamp:"),
    )
    assert note not in text and "class Stamp:" in text
