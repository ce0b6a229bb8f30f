"""``hicache-async-ack doctor``: its verdict and exit status per cause, each against a
control that differs in that cause only. Subprocesses where the interpreter is the point
(an overlay-changed SGLang first on PYTHONPATH, a Python without SGLang, --measure's
gloo ranks); in process elsewhere (the launch stand-down causes, the switch, settings)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_async_ack import __version__
from hicache_async_ack.env import (
    ALLOW_UNTESTED_VAR,
    DEPTH_VAR,
    ENABLE_VAR,
    OFFLOAD_SYNC_VAR,
    PLUGINS_VAR,
    PREFETCH_VOTES_VAR,
    READ_ONCE_VAR,
)
from hicache_async_ack.names import ACK, OFFLOAD, VOTES
from hicache_async_ack.protocol import PROTOCOL_VERSION
from hicache_async_ack.tools import Exit, diagnose, exit_table, main

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_VARS = (ENABLE_VAR, DEPTH_VAR, ALLOW_UNTESTED_VAR, PREFETCH_VOTES_VAR, OFFLOAD_SYNC_VAR,
               READ_ONCE_VAR, PLUGINS_VAR)  # fmt: skip
LIVE_LAUNCH = ["--tp", "4", "--enable-hierarchical-cache"]
CHANGED = "srt/mem_cache/unified_radix_cache.py"  # under the sglang package
TIMEOUT_S = 300  # a hang guard on a busy box, not a speed check
WIDTH = 100


@pytest.fixture
def clean(monkeypatch):
    for var in PLUGIN_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def doctor_subprocess(args, python=sys.executable, **env):
    """``python -m hicache_async_ack doctor *args``: (exit status, output), in its own
    process group, killed on the timeout."""
    full = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARS}
    full.update(PYTHONDONTWRITEBYTECODE="1", **env)
    proc = subprocess.Popen([str(python), "-m", "hicache_async_ack", "doctor", *args], env=full,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def flat(text: str) -> str:
    """The output with its wrapping undone."""
    return " ".join(text.split())


def too_wide(text: str) -> list[str]:
    """Lines over WIDTH that are not one unbreakable word (a long path) after an indent."""
    return [x for x in text.splitlines() if len(x) > WIDTH and " " in x.strip()]


def sglang_overlay(tmp_path: Path, change: bool) -> Path:
    """A copy of the installed sglang package (symlinks, but along the path to the
    cache module) with one no-op statement appended to
    UnifiedRadixCache.check_hicache_events when ``change``; its folder goes first on
    PYTHONPATH."""
    import sglang

    src = Path(sglang.__path__[0])
    root = tmp_path / ("changed" if change else "same")

    def farm(src: Path, dst: Path, rel: str) -> None:
        dst.mkdir(parents=True)
        head, _, rest = rel.partition("/")
        for entry in src.iterdir():
            if entry.name != head and entry.name != "__pycache__":
                (dst / entry.name).symlink_to(entry)
        if rest:
            farm(src / head, dst / head, rest)
            return
        text = (src / head).read_text()
        if change:
            tree = ast.parse(text)
            cls = next(n for n in tree.body if getattr(n, "name", "") == "UnifiedRadixCache")
            fn = next(n for n in cls.body if getattr(n, "name", "") == "check_hicache_events")
            lines = text.splitlines(keepends=True)
            lines.insert(fn.end_lineno, " " * fn.body[-1].col_offset + "pass  # a no-op\n")
            text = "".join(lines)
        (dst / head).write_text(text)

    farm(src, root / "sglang", CHANGED)
    return root


# ------------------------------------------------ an SGLang whose method changed
@pytest.fixture(scope="module")
def overlay_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overlay")
    runs = {}
    for change in (True, False):
        path = f"{sglang_overlay(tmp, change)}{os.pathsep}{ROOT / 'python'}"
        runs[change] = doctor_subprocess(["--", *LIVE_LAUNCH], PYTHONPATH=path)
    return runs


def test_a_changed_check_hicache_events_exits_with_the_guards_code(overlay_runs):
    rc, out = overlay_runs[True]
    assert rc == Exit.GUARD, out
    verdict = flat(out.split("verdict:")[1])
    assert "INACTIVE" in verdict and "UnifiedRadixCache.check_hicache_events differs" in verdict
    assert re.search(r"ack_counts +standing down \(untested_release\)", out), out
    # the decode offload sync's methods are untouched: it is judged alone, and said live
    assert re.search(r"decode_offload +yes: ", out), out
    assert too_wide(out) == []


def test_the_same_overlay_unchanged_pipelines(overlay_runs):
    """Control: the overlay itself, without the no-op, changes nothing."""
    rc, out = overlay_runs[False]
    assert rc == Exit.LIVE, out
    assert re.search(r"ack_counts +live: pipelined over the one attn TP group \(world size 4", out)
    assert "verdict: ACTIVE (exit 0)" in out


# ------------------------------------------------ the wrong interpreter
def test_a_python_without_sglang_is_named_as_the_wrong_interpreter(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=TIMEOUT_S)  # fmt: skip
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "print(u.find_spec('sglang') is None)"], capture_output=True,
                           text=True, timeout=TIMEOUT_S)  # fmt: skip
    if probe.stdout.strip() != "True":
        pytest.skip("the base interpreter has SGLang of its own")
    rc, out = doctor_subprocess(["--", *LIVE_LAUNCH], python, PYTHONPATH=str(ROOT / "python"))
    assert rc == Exit.NO_SGLANG, out
    assert f"no SGLang importable by {python}: run doctor with the Python that runs SGLang" in flat(
        out
    )
    assert "same as" not in out and "INCOMPATIBLE" not in out and "0.5.20" not in out
    assert len(out.splitlines()) <= 4, out  # the header and the verdict, nothing else
    # control: the same command with the Python that has SGLang judges the launch
    assert diagnose(LIVE_LAUNCH).code != Exit.NO_SGLANG


# ------------------------------------------------ the switch, the settings
@pytest.mark.parametrize("spelling", ["0", "no", "False"])
def test_switched_off_judges_nothing_else(clean, capsys, spelling):
    clean.setenv(ENABLE_VAR, spelling)
    clean.setenv(DEPTH_VAR, "99")  # invalid, but never read with the switch off
    clean.setenv(PREFETCH_VOTES_VAR, "perhaps")
    assert main(["doctor", "--", "--tp", "1"]) == Exit.SWITCHED_OFF
    out = capsys.readouterr().out
    assert f"{ENABLE_VAR}={spelling!r}: the plugin is switched off" in flat(out)
    for unread in (DEPTH_VAR, PREFETCH_VOTES_VAR, "version guard", "ack_counts", "launch"):
        assert unread not in out, (unread, out)


def test_switched_on_an_invalid_setting_says_the_server_would_not_start(clean, capsys):
    """Control of the one above: the same invalid depth with the switch on."""
    clean.setenv(DEPTH_VAR, "99")
    assert main(["doctor", "--", *LIVE_LAUNCH]) == Exit.INVALID_SETTING
    out = capsys.readouterr().out
    assert f"{DEPTH_VAR}='99' is invalid: HiCache init would raise" in flat(out)
    assert "syncs: not judged" in out


def test_every_setting_is_a_row_with_its_value(clean):
    clean.setenv(DEPTH_VAR, "2")
    clean.setenv(READ_ONCE_VAR, "1")
    text = flat("\n".join(diagnose().lines))
    for var in (ENABLE_VAR, ALLOW_UNTESTED_VAR, PREFETCH_VOTES_VAR, OFFLOAD_SYNC_VAR):
        assert f"{var} unset -> " in text and "(default)" in text, var
    assert f"{DEPTH_VAR} '2' -> 2: acks popped 2 steps late" in text
    assert f"{READ_ONCE_VAR} '1' -> on: " in text


def test_the_loader_causes_have_their_codes(clean):
    clean.setenv(PLUGINS_VAR, "other_plugin")
    rep = diagnose(LIVE_LAUNCH)
    assert rep.code == Exit.EXCLUDED and not rep.loads
    clean.setenv(PLUGINS_VAR, "other_plugin,hicache_async_ack")
    assert diagnose(LIVE_LAUNCH).code == Exit.LIVE  # control


# ------------------------------------------------ the launch
STANDS_DOWN = {  # extra launch arguments -> the ack sync's reason code
    "tp1": (["--tp", "1", "--enable-hierarchical-cache"], "world_size_1"),
    "pp": ([*LIVE_LAUNCH, "--pp-size", "2"], "pp"),
    "buffer_only": ([*LIVE_LAUNCH, "--hicache-host-memory-mode", "buffer_only"],
                    "host_memory_mode"),
    "linker": (["--tp", "4", "--enable-unified-cache-external-linker"], "linker"),
    "lmcache": (["--tp", "4", "--enable-lmcache"], "hooks_missing"),
    "cp_tp_no_span": ([*LIVE_LAUNCH, "--tp", "8", "--attn-dp-size", "2", "--attn-cp-size", "2"],
                      "no_span"),
    "no_hicache": (["--tp", "4"], "no_controller"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STANDS_DOWN))
def test_each_launch_cause_makes_the_ack_sync_stand_down(clean, case):
    launch, code = STANDS_DOWN[case]
    rep = diagnose(launch)
    ack = rep.syncs[ACK]
    assert (ack.live, ack.decision.code) == (False, code), ack
    assert rep.code == Exit.STANDS_DOWN
    assert f"ack_counts standing down ({code}): " in flat("\n".join(rep.lines))
    assert f"(exit {Exit.STANDS_DOWN.value}): the ack sync stands down" in flat(
        "\n".join(rep.verdict())
    )


def test_the_live_launch_pipelines(clean):
    """Control of the causes above: the launch they each change by one flag."""
    rep = diagnose(LIVE_LAUNCH)
    assert rep.code == Exit.LIVE and rep.syncs[ACK].live
    assert rep.syncs[ACK].line.startswith("HiCache ack sync: pipelined over the one attn TP group")
    verdict = "\n".join(rep.verdict())
    assert verdict.startswith("verdict: ACTIVE (exit 0): the ack sync would pipeline")
    assert "sglang:hicache_ack_sync_pipelined" in verdict
    assert "sglang:hicache_sync_path_info" in verdict.splitlines()[-1]
    assert too_wide("\n".join(rep.lines) + "\n" + verdict) == []


@pytest.mark.parametrize(
    "launch, votes",
    [
        (LIVE_LAUNCH, "no_storage"),
        ([*LIVE_LAUNCH, "--hicache-storage-backend", "file"], "pipelined"),
        ([*LIVE_LAUNCH, "--hicache-storage-backend", "file", "--pp-size", "2"], "pp"),
        ([*LIVE_LAUNCH, "--hicache-host-memory-mode", "buffer_only", "--hicache-storage-backend",
          "file", "--hicache-storage-prefetch-policy", "best_effort"], "policy_not_timeout"),
        ([*LIVE_LAUNCH, "--hicache-host-memory-mode", "buffer_only", "--hicache-storage-backend",
          "file"], "pipelined"),  # riding upstream's blocking reduce under timeout
    ],
)  # fmt: skip
def test_the_votes_are_judged_per_line(clean, launch, votes):
    rep = diagnose(launch)
    v = rep.syncs[VOTES]
    assert v.decision.code == votes and v.live == (votes == "pipelined"), v
    assert rep.code == (Exit.LIVE if rep.syncs[ACK].live else Exit.STANDS_DOWN)  # the ack's


def test_the_decode_offload_is_judged_on_a_pd_decode_launch(clean):
    decode = ["--tp", "4", "--disaggregation-mode", "decode",
              "--disaggregation-decode-enable-offload-kvcache"]  # fmt: skip
    rep = diagnose([*decode, "--enable-hierarchical-cache"])
    assert rep.syncs[OFFLOAD].live and rep.code == Exit.LIVE
    assert diagnose(LIVE_LAUNCH).syncs[OFFLOAD].decision is None  # no manager: idle
    clean.setenv(OFFLOAD_SYNC_VAR, "0")
    off = diagnose(decode)
    assert off.syncs[OFFLOAD].decision.code == "feature_disabled_by_env"
    assert off.code == Exit.STANDS_DOWN  # no HiCache: the ack sync has nothing to pipeline


def test_cp_x_tp_spanned_by_the_tp_group_pipelines_with_a_note(clean):
    rep = diagnose([*LIVE_LAUNCH, "--attn-cp-size", "2"])
    ack = rep.syncs[ACK]
    assert ack.live and "TP group must span attn CP x attn TP" in ack.note
    assert rep.code == Exit.LIVE


def test_deprecated_dp_attention_is_read_as_sglang_reads_it(clean):
    rep = diagnose([*LIVE_LAUNCH, "--dp-size", "2", "--enable-dp-attention"])
    assert rep.syncs[ACK].decision.world_size == 2  # one attention-DP rank's attn TP group
    assert diagnose(LIVE_LAUNCH).syncs[ACK].decision.world_size == 4  # control


@pytest.mark.parametrize(
    "bad", [["--tp", "four"], ["--no-such-flag"], ["--hicache-host-memory-mode", "x"]]
)
def test_launch_arguments_sglang_rejects(clean, bad):
    rep = diagnose([*LIVE_LAUNCH, *bad])
    assert rep.code == Exit.LAUNCH_REJECTED and rep.syncs == {}
    assert "SGLang's launch_server would refuse these arguments" in "\n".join(rep.verdict())


def test_a_config_file_is_merged_as_sglang_merges_it(clean, tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("tp-size: 4\nenable-hierarchical-cache: true\npp-size: 2\n")
    rep = diagnose(["--config", str(config)])
    assert rep.syncs[ACK].decision.code == "pp" and rep.code == Exit.STANDS_DOWN
    config.write_text("tp-size: 4\nenable-hierarchical-cache: true\n")  # control
    assert diagnose(["--config", str(config)]).code == Exit.LIVE


def test_without_a_launch_the_syncs_are_allowed(clean):
    rep = diagnose()
    assert rep.code == Exit.LIVE and rep.launch is None
    text = "\n".join(rep.lines)
    assert re.search(r"ack_counts +allowed \(on --tp 2 --enable-hierarchical-cache\)", text)
    assert " live: " not in text  # never "live" without a launch
    assert "is allowed on this node" in rep.verdict()[0]


def test_model_path_is_optional_and_accepted(clean):
    assert diagnose([*LIVE_LAUNCH, "--model-path", "/nowhere/model"]).code == Exit.LIVE


# ------------------------------------------------ the command's shape
def test_help_prints_every_exit_code(capsys):
    with pytest.raises(SystemExit) as done:
        main(["doctor", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert exit_table() in out and "-- <launch_server arguments>" in out
    assert list(Exit)  # the loop below is not over nothing
    for code in Exit:
        assert re.search(rf"^ +{code.value} +\S", out, re.M), code
    assert too_wide(out) == []


def test_the_default_run_measures_nothing_and_prints_the_versions(clean, capsys):
    assert main(["doctor"]) == Exit.LIVE
    out = capsys.readouterr().out
    assert f"plugin {__version__}, wire protocol {PROTOCOL_VERSION}" in out.splitlines()[0]
    assert "gloo" not in out and "measuring" not in out
    assert "same as" not in out  # the fingerprint table is --verbose's
    assert too_wide(out) == []


def test_verbose_shows_each_fingerprint(clean):
    text = "\n".join(diagnose(verbose=True).lines)
    assert re.search(r"^    check_hicache_events: same as .*0\.5\.23", text, re.M), text
    assert too_wide(text) == []


def test_measure_says_what_it_measures_before_it_measures():
    rc, out = doctor_subprocess(["--measure", "--rounds", "10", "--tp", "2"])
    assert rc == Exit.LIVE, out
    lines = out.splitlines()
    said = next(i for i, x in enumerate(lines) if x.startswith("measuring (informational): 10"))
    got = next(i for i, x in enumerate(lines) if "gloo all_reduce: median" in x)
    assert said < got, out
    assert "2 local processes on 127.0.0.1" in flat(out)


# ------------------------------------------------ docs/troubleshooting.md
def test_troubleshooting_names_every_exit_code_reason_and_error():
    import hicache_async_ack.errors as errors

    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = re.findall(r"^\| (\d+) \|", doc, re.M)
    assert rows == [str(code.value) for code in Exit]  # each once, in order
    source = (ROOT / "python" / "hicache_async_ack" / "names.py").read_text()
    tree = ast.parse(source)
    codes = next(
        [e.value for e in node.value.slice.elts]
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ReasonCode"
    )
    assert "no_span" in codes  # the parse found the list
    missing = [c for c in codes if c != "pipelined" and f"| `{c}` |" not in doc]
    missing += [name for name in errors.__all__ if name not in doc and name != "ErrorPair"]
    assert missing == []
