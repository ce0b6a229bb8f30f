"""End-to-end tests of ``hicache-async-ack-lab bench`` and ``doctor`` (subprocesses,
real gloo on loopback, SGLang's real loader), and ``bench-server --workload
shared-prompt``'s options and refusals (parsed in process, nothing started). No timing
assertions: this box's numbers are whatever they are; only shape, exit codes and
correctness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from hicache_async_ack import __version__
from hicache_async_ack.env import DEPTH_VAR, ENABLE_VAR, PLUGINS_VAR, READ_ONCE_VAR

PLUGIN_VARS = (PLUGINS_VAR, ENABLE_VAR, DEPTH_VAR)
ARM_FIELDS = (
    "path",
    "check_ms",
    "bcast_ms",
    "step_ms_median",
    "steps_per_s",
    "throughput_vs_l1",
    "acks_popped",
    "storage_popped",
    "mean_lag_steps",
    "violations",
)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARS}
    env.update(extra)
    return env


def _start(args, cwd, **env):
    # doctor is the runtime wheel's command; bench the lab's
    module = "hicache_async_ack" if args[0] == "doctor" else "hicache_async_ack_lab"
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=900):  # a hang guard on a busy box, not a speed check
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"timed out\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three arms at TP=2, plus (concurrently, to share the import time) a
    pipelined-only run with storage, a dedicated reduce group, depth 2 and an
    injected latency."""
    tmp = tmp_path_factory.mktemp("bench")
    short = ["--tp", "2", "--step-ms", "2", "--quiet"]
    main = _start(
        ["bench", *short, "--steps", "30", "--warmup", "5"]
        + ["--out", str(tmp / "r.jsonl"), "--png", str(tmp / "r.png")],
        tmp,
    )
    variant = _start(
        ["bench", *short, "--steps", "20", "--warmup", "2", "--arms", "pipelined,blocking"]
        + ["--storage", "--reduce-group", "dedicated", "--depth", "2"]
        + ["--inject-latency-ms", "1", "--out", str(tmp / "v.jsonl")],
        tmp,
    )
    phases = _start(
        ["bench", *short, "--steps", "40", "--warmup", "2", "--arms", "bound,pipelined"]
        + ["--depth", "1,auto", "--inject-latency-ms", "0:15,9:15,0"]
        + ["--out", str(tmp / "p.jsonl")],
        tmp,
    )
    out = {"main": _finish(main), "variant": _finish(variant), "phases": _finish(phases)}
    out["dir"] = tmp
    for name in ("main", "variant", "phases"):
        rc, stdout, stderr = out[name]
        assert rc == 0, f"{name}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    return out


def _record(runs, name):
    lines = (runs["dir"] / f"{name}.jsonl").read_text().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_bench_record_names_config_and_versions(runs):
    rec = _record(runs, "r")
    assert rec["config"]["tp"] == 2 and rec["config"]["steps"] == 30
    assert rec["versions"]["plugin"] == __version__
    assert rec["versions"]["sglang"] and rec["versions"]["torch"]
    assert rec["cpu_count"] >= 1


def test_bench_every_arm_has_its_figures_and_no_violation(runs):
    rec = _record(runs, "r")
    assert list(rec["arms"]) == ["l1", "blocking", "bound", "floor", "pipelined"]
    for arm, figures in rec["arms"].items():
        for field in ARM_FIELDS:
            assert field in figures, (arm, field)
        assert figures["violations"] == [], (arm, figures["violations"])
        assert figures["steps_per_s"] > 0
        assert figures["throughput_vs_l1"] > 0 and figures["throughput_vs_bound"] > 0
    assert rec["arms"]["l1"]["check_ms"] is None
    assert rec["arms"]["l1"]["acks_popped"] == 0
    for arm in ("blocking", "bound", "floor", "pipelined"):
        assert set(rec["arms"][arm]["check_ms"]) >= {"median", "p90", "p99"}
    stdout = runs["main"][1]
    for arm in ("l1", "blocking", "bound", "floor", "pipelined"):
        assert arm in stdout


def test_bench_measures_against_the_bound_and_the_floor(runs):
    rec = _record(runs, "r")
    assert rec["arms"]["bound"]["throughput_vs_bound"] == 1.0
    assert rec["arms"]["bound"]["path"].startswith("stock check, collective replaced")
    assert rec["arms"]["floor"]["path"].startswith("the bound + one async MIN all_reduce per step")
    lim = rec["limits"]["pipelined"]
    # the split adds up: what is left = the collective's share + the plugin's own
    assert lim["sync_cost_left"] == pytest.approx(lim["collective_share"] + lim["plugin_share"])
    med = {a: rec["arms"][a]["check_ms"]["median"] for a in ("blocking", "bound", "pipelined")}
    span = med["blocking"] - med["bound"]
    assert lim["sync_cost_left"] == pytest.approx((med["pipelined"] - med["bound"]) / span)
    assert "against the limit" in runs["main"][1] and "sync cost left" in runs["main"][1]


def test_bench_pipelined_arm_really_pipelines_the_same_workload(runs):
    rec = _record(runs, "r")
    pipe, blocking = rec["arms"]["pipelined"], rec["arms"]["blocking"]
    assert pipe["acks_popped"] > 0
    assert pipe["path"].startswith("pipelined over the one TP group")
    assert blocking["path"].startswith("stock SGLang")
    # the same workload is popped (give or take what is still queued at the end)
    assert abs(pipe["acks_popped"] - blocking["acks_popped"]) <= 20
    # acks are popped later on the pipelined path (about one step at depth 1)
    assert pipe["mean_lag_steps"] > 0


def test_bench_latency_phases_and_one_arm_per_depth(runs):
    rec = _record(runs, "p")
    assert list(rec["arms"]) == ["bound", "pipelined@1", "pipelined@auto"]
    assert rec["config"]["latency_phases"] == [[0.0, 15], [9.0, 15], [0.0, 10]]
    for arm, figures in rec["arms"].items():
        assert [p["steps"] for p in figures["phases"]] == [15, 15, 10], arm
        assert figures["violations"] == [], arm
    assert "auto" in rec["arms"]["pipelined@auto"]["path"]
    fixed = rec["arms"]["pipelined@1"]["phases"]
    assert {p["mean_depth"] for p in fixed} == {1.0}
    assert "per phase" in runs["phases"][1]


def test_bench_writes_the_png(runs):
    assert (runs["dir"] / "r.png").read_bytes()[:8] == PNG_MAGIC
    assert (runs["dir"] / "v.png").read_bytes()[:8] == PNG_MAGIC  # default: next to --out


def test_bench_variant_storage_dedicated_depth2_latency(runs):
    vrec = _record(runs, "v")
    assert list(vrec["arms"]) == ["pipelined", "blocking"]
    vp = vrec["arms"]["pipelined"]
    assert vp["violations"] == [] and vp["acks_popped"] > 0 and vp["storage_popped"] > 0
    assert "depth 2" in vp["path"]
    assert vp["mean_lag_steps"] > 1
    assert vrec["arms"]["blocking"]["throughput_vs_l1"] is None  # no L1 arm


@pytest.mark.parametrize(
    "args, accepted",
    [
        (["--tp", "0"], "accepted values: an integer from 1 to 64"),
        (["--steps", "3"], "accepted values: an integer >= 20"),
        (["--arms", "bogus"], "l1, blocking, bound, floor, pipelined"),
        (["--arms", "l1,bogus"], "l1, blocking, bound, floor, pipelined"),
        (["--arms", "l1,l1"], "without repeats"),
        (["--depth", "9"], "accepted values: integers from 1 to 8 or 'auto'"),
        (["--depth", "1,sometimes"], "accepted values: integers from 1 to 8 or 'auto'"),
        (["--inject-latency-ms", "-1"], "accepted values: a number >= 0 (milliseconds)"),
        (["--inject-latency-ms", "2,25:10"], "each phase but the last with its measured step"),
        (["--inject-latency-ms", "2:x,3"], "accepted values: a number >= 0"),
        (["--timeout", "-1"], "accepted values: a number >= 0 (seconds)"),
        (["--reduce-group", "other"], "'shared', 'dedicated'"),
    ],
)
def test_bench_refuses_bad_options(tmp_path, args, accepted):
    rc, out, err = _finish(_start(["bench", *args], tmp_path), timeout=300)
    assert rc != 0
    assert accepted in err, err
    assert args[0] in err


def test_bench_fails_clearly_when_a_rank_dies(tmp_path):
    args = ["bench", "--arms", "l1", "--tp", "2", "--steps", "20", "--step-ms", "1"]
    rc, out, err = _finish(
        _start([*args, "--crash-rank-at", "1:5", "--quiet"], tmp_path), timeout=300
    )
    assert rc == 1, err
    assert "rank 1 exited with code 3" in err
    assert not (tmp_path / "bench.png").exists()


DOCTOR_CASES = {
    "default": (["--tp", "2", "--rounds", "20"], {}),
    "disabled": (["--tp", "2", "--rounds", "20"], {ENABLE_VAR: "0"}),
    "excluded": (["--tp", "2", "--rounds", "20"], {PLUGINS_VAR: "other"}),
    "bad depth": (["--rounds", "0"], {DEPTH_VAR: "99"}),
}


@pytest.fixture(scope="module")
def doctor_runs(tmp_path_factory):
    """Every case at once (each imports SGLang)."""
    tmp = tmp_path_factory.mktemp("doctor")
    procs = {
        name: _start(["doctor", *args], tmp, **env) for name, (args, env) in DOCTOR_CASES.items()
    }
    return {name: _finish(p) for name, p in procs.items()}


def test_doctor_active_by_default(doctor_runs):
    rc, out, err = doctor_runs["default"]
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert __version__ in out
    assert metadata.version("sglang") in out
    assert "supported" in out and "yes" in out
    assert "gloo all_reduce" in out and "median" in out
    assert "blocking penalty" in out
    assert "ACTIVE" in out


@pytest.mark.parametrize(
    "name, needle",
    [("disabled", ENABLE_VAR), ("excluded", PLUGINS_VAR), ("bad depth", DEPTH_VAR)],
)
def test_doctor_inactive_names_the_reason(doctor_runs, name, needle):
    rc, out, err = doctor_runs[name]
    assert rc != 0, (name, out, err)
    assert "INACTIVE" in out and needle in out.split("verdict")[1], (name, out)
    assert __version__ in out


# --- bench-server --storage mooncake --workload shared-prompt: options and refusals ---

SHARED = ["bench-server", "--storage", "mooncake", "--workload", "shared-prompt"]


def _bench_server_args(*argv: str):
    from hicache_async_ack_lab.cli import build_parser

    return build_parser().parse_args([*SHARED, *argv])


@pytest.mark.parametrize(
    "argv, accepted",
    [
        (["--arrivals", "trickle"], "a comma-separated list of poisson, dense, burst"),
        (["--arrivals", "dense,later"], "a comma-separated list of poisson, dense, burst"),
        (["--arrivals", ","], "empty --arrivals"),
        (["--shared-requests", "0"], "an integer from 1 to 256"),
        (["--shared-prompt-tokens", "8"], "an integer from 16 to 3800"),
        (["--shared-question-words", "x"], "an integer from 1 to 200"),
        (["--poisson-gap-ms", "-1"], "a number >= 0 (milliseconds)"),
        (["--dense-gap-ms", "soon"], "a number >= 0 (milliseconds)"),
        (["--arms", "stock,read-twice"], "stock, plugin, bound, local, dedicated, read-once"),
        (["--workload", "shared"], "shared-prompt"),
    ],
)
def test_shared_prompt_bad_options_name_the_accepted_values(argv, accepted, capsys):
    with pytest.raises(SystemExit):
        _bench_server_args(*argv)
    err = capsys.readouterr().err
    assert accepted in err, err
    assert argv[0] in err


def test_shared_prompt_options_parse_to_their_values():
    args = _bench_server_args("--arrivals", "Burst,dense,burst", "--shared-requests", "8",
                              "--poisson-gap-ms", "50")  # fmt: skip
    assert args.arrivals == ("burst", "dense")  # lower-cased, repeats dropped
    assert args.shared_requests == 8 and args.poisson_gap_ms == 50.0
    plain = _bench_server_args()
    assert plain.arrivals == ("poisson", "dense", "burst") and plain.shared_requests == 32
    assert plain.shared_prompt_tokens == 1200 and plain.dense_gap_ms == 15.0


def _dispatched(monkeypatch, *argv: str):
    """What bench-server hands the shared-prompt workload (nothing is started)."""
    from hicache_async_ack_lab.bench import server, shared_prompt

    seen = []
    monkeypatch.setattr(shared_prompt, "run", lambda args: seen.append(args) or 0)
    assert server.run(_bench_server_args(*argv)) == 0
    (args,) = seen
    return args


def test_shared_prompt_runs_its_three_arms_at_0_ms_unless_told(monkeypatch):
    args = _dispatched(monkeypatch)
    assert args.arms == ("stock", "plugin", "read-once") and args.latency_ms == (0.0,)
    # Negative control: the same values as the general defaults, typed, are kept.
    typed = _dispatched(monkeypatch, "--arms", "stock,plugin", "--latency-ms", "0,3.2")
    assert typed.arms == ("stock", "plugin") and typed.latency_ms == (0.0, 3.2)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--workload", "shared-prompt"], "add --storage mooncake"),
        (SHARED[1:] + ["--arms", "stock,bound"], "the arms stock, plugin, read-once; not bound"),
        (SHARED[1:] + ["--shared-prompt-tokens", "3000", "--max-total-tokens", "2048"],
         "does not fit the device pool (2048)"),
        (["--arms", "stock,read-once"], "read-once arm runs only with --workload shared-prompt"),
        (["--storage", "mooncake", "--arms", "read-once"], "--workload shared-prompt"),
    ],
)  # fmt: skip
def test_shared_prompt_refusals_name_the_reason(argv, named):
    from hicache_async_ack_lab.bench import server, shared_prompt
    from hicache_async_ack_lab.cli import build_parser
    from hicache_async_ack_lab.cli_support import ToolError

    args = build_parser().parse_args(["bench-server", *argv])
    with pytest.raises(ToolError) as err:
        if args.workload == shared_prompt.WORKLOAD:
            shared_prompt.config(args)
        else:
            server.run(args)
    assert named in str(err.value)


def test_shared_prompt_host_pool_takes_every_requests_read(capsys):
    from hicache_async_ack_lab.bench import shared_prompt

    cfg = shared_prompt.config(_bench_server_args())
    assert cfg["max_total_tokens"] == shared_prompt.POOL_TOKENS
    # SGLang's prefetch budget, half the host pool, holds 32 prompts' reads
    assert cfg["hicache_ratio"] * cfg["max_total_tokens"] / 2 >= 32 * 1200
    assert capsys.readouterr().err == ""
    small = shared_prompt.config(_bench_server_args("--hicache-ratio", "4"))
    assert small["hicache_ratio"] == 4.0
    assert "stock's extra reads may be declined" in capsys.readouterr().err


def test_shared_prompt_arms_set_the_plugin_and_read_once():
    from hicache_async_ack_lab.bench import shared_prompt

    assert {a: shared_prompt.arm_env(a) for a in shared_prompt.ARMS} == {
        "stock": {ENABLE_VAR: "0", READ_ONCE_VAR: "0"},
        "plugin": {ENABLE_VAR: "1", READ_ONCE_VAR: "0"},
        "read-once": {ENABLE_VAR: "1", READ_ONCE_VAR: "1"},
    }
