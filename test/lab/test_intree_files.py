"""The files the upstream patch adds (tools/intree/files/): SGLang's code,
formatted at SGLang's settings, free of the plugin's vocabulary, and in step
with the plugin's settings. Fast: nothing here runs SGLang."""

from __future__ import annotations

import ast
import re

import black
import isort
import pytest

from hicache_async_ack import env
from hicache_async_ack import protocol as stamp
from hicache_async_ack_lab.intree import doc_edit, edits, module

ADDED = (module.MODULE_PATH, *module.TEST_PATHS)
FORBIDDEN = re.compile(r"hicache_async_ack|hicache-async-ack|[Pp]lugin|[Uu]pstream|protocol")


@pytest.mark.parametrize("rel", ADDED)
def test_formatted_with_sglangs_black_and_isort(rel):
    text = module.read(rel)
    assert black.format_str(text, mode=black.Mode()) == text
    assert isort.code(text, profile="black", known_first_party=["sglang"]) == text
    assert max(len(line) for line in text.splitlines()) <= 88


@pytest.mark.parametrize("rel", ADDED)
def test_written_in_sglangs_vocabulary(rel):
    """Only the error naming a peer that runs the plugin names it."""
    lines = module.read(rel).splitlines()
    hits = [line for line in lines if FORBIDDEN.search(line)]
    named = [line for line in hits if module.PEER_PLUGIN in line]
    assert len(named) == (rel == module.MODULE_PATH)
    assert [line for line in hits if line not in named] == []


def test_the_stamp_ranges_are_the_plugins():
    """Stock digests below 2**42, the module's depth << 42 | digest below 2**58,
    the plugin's stamps from 2**58 up (stamp.py): each side names the other."""
    consts = _consts(module.compose())
    assert consts["_DIGEST_BITS"] == stamp.DIGEST_BITS
    assert 1 << consts["_DIGEST_BITS"] == stamp.STOCK_LIMIT
    assert eval(consts["_FOREIGN_STAMP"]) == stamp.IN_TREE_LIMIT  # "1 << 58"
    assert (consts["MAX_DEPTH"] + 1) << stamp.DIGEST_BITS <= stamp.IN_TREE_LIMIT


def _consts(text: str) -> dict:
    """Module-level constants: literals as values, other expressions as text."""
    return {
        t.id: ast.literal_eval(n.value)
        if isinstance(n.value, ast.Constant)
        else ast.unparse(n.value)
        for n in ast.parse(text).body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }


def test_the_module_reads_the_settings_the_plugin_documents():
    text = module.compose()
    assert f"envs.{env.ENABLE_VAR}" in text and f"envs.{env.DEPTH_VAR}" in text
    consts = _consts(text)
    assert consts["MAX_DEPTH"] == edits.DEPTH_MAX == env.DEPTH_MAX
    assert re.search(rf"class {module.CLASS_NAME}\b", text)


def test_a_doc_with_hicache_rows_gets_the_settings_after_the_last():
    doc = "| a | b | c |\n| `SGLANG_HICACHE_X` | x | `1` |\n| `SGLANG_Y` | y | `2` |\n"
    lines = doc_edit.edit_doc(doc).splitlines()
    assert lines[1] == "| `SGLANG_HICACHE_X` | x | `1` |"
    assert [line.split(" | ")[0] for line in lines[2:4]] == [
        f"| `{env.ENABLE_VAR}`",
        f"| `{env.DEPTH_VAR}`",
    ]
    assert lines[4] == "| `SGLANG_Y` | y | `2` |"
    with pytest.raises(edits.EditError, match="already documents"):
        doc_edit.edit_doc("\n".join(lines) + "\n")


def test_the_gpu_checklist_is_one_command_that_parses_and_dry_runs(tmp_path):
    """scripts/gpu-checklist.sh (the PR's GPU checklist): valid bash; --dry-run
    lists the patch's tests and both arms per TP size without a GPU."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu-checklist.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    done = subprocess.run(
        [str(script), "--sglang-src", str(tmp_path), "--tp", "2,4", "--dry-run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    arms = [line for line in done.stdout.splitlines() if line.startswith("-- TP=")]
    assert [a.split(" (")[0] for a in arms] == [
        "-- TP=2 blocking",
        "-- TP=2 pipelined",
        "-- TP=4 blocking",
        "-- TP=4 pipelined",
    ]
    assert "test_hicache_ack_sync" in done.stdout
    missing = subprocess.run(
        [str(script), "--sglang-src", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 1 and "is not patched" in missing.stderr
