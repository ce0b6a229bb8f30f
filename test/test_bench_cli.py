"""End-to-end tests of ``hicache-async-ack bench`` and ``doctor`` (subprocesses,
real gloo on loopback, SGLang's real loader). No timing assertions: this box's
numbers are whatever they are; only shape, exit codes and correctness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata

import pytest

from hicache_async_ack import __version__

PLUGIN_VARS = (
    "SGLANG_PLUGINS",
    "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC",
    "SGLANG_HICACHE_ASYNC_ACK_DEPTH",
)
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
    return subprocess.Popen(
        [sys.executable, "-m", "hicache_async_ack", *args],
        cwd=cwd,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"timed out\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def test_bench_end_to_end(tmp_path):
    """Three arms at TP=2, plus (concurrently, to share the import time) a
    pipelined-only run with storage, a dedicated reduce group, depth 2 and an
    injected latency."""
    out, png = tmp_path / "r.jsonl", tmp_path / "r.png"
    main = _start(
        [
            "bench",
            "--tp",
            "2",
            "--steps",
            "30",
            "--warmup",
            "5",
            "--step-ms",
            "2",
            "--out",
            str(out),
            "--png",
            str(png),
            "--quiet",
        ],
        tmp_path,
    )
    var_out = tmp_path / "v.jsonl"
    variant = _start(
        [
            "bench",
            "--tp",
            "2",
            "--steps",
            "20",
            "--warmup",
            "2",
            "--step-ms",
            "2",
            "--arms",
            "pipelined,blocking",
            "--storage",
            "--reduce-group",
            "dedicated",
            "--depth",
            "2",
            "--inject-latency-ms",
            "1",
            "--out",
            str(var_out),
            "--quiet",
        ],
        tmp_path,
    )
    rc, stdout, stderr = _finish(main)
    vrc, vstdout, vstderr = _finish(variant)
    assert rc == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert vrc == 0, f"stdout:\n{vstdout}\nstderr:\n{vstderr}"

    lines = out.read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["config"]["tp"] == 2 and rec["config"]["steps"] == 30
    assert rec["versions"]["plugin"] == __version__
    assert rec["versions"]["sglang"] and rec["versions"]["torch"]
    assert rec["cpu_count"] >= 1
    assert set(rec["arms"]) == {"l1", "blocking", "pipelined"}
    for arm, figures in rec["arms"].items():
        for field in ARM_FIELDS:
            assert field in figures, (arm, field)
        assert figures["violations"] == [], (arm, figures["violations"])
        assert figures["steps_per_s"] > 0
        assert figures["throughput_vs_l1"] > 0
    assert rec["arms"]["l1"]["check_ms"] is None
    assert rec["arms"]["l1"]["acks_popped"] == 0
    for arm in ("blocking", "pipelined"):
        assert set(rec["arms"][arm]["check_ms"]) >= {"median", "p90", "p99"}
    pipe = rec["arms"]["pipelined"]
    assert pipe["acks_popped"] > 0
    assert pipe["path"].startswith("pipelined over the one TP group")
    assert rec["arms"]["blocking"]["path"].startswith("stock SGLang")
    # the same workload is popped (give or take what is still queued at the end)
    assert abs(pipe["acks_popped"] - rec["arms"]["blocking"]["acks_popped"]) <= 20
    # acks are popped later on the pipelined path (about one step at depth 1)
    assert pipe["mean_lag_steps"] > 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    for arm in ("l1", "blocking", "pipelined"):
        assert arm in stdout

    vrec = json.loads(var_out.read_text().splitlines()[0])
    assert list(vrec["arms"]) == ["pipelined", "blocking"]
    vp = vrec["arms"]["pipelined"]
    assert vp["violations"] == [] and vp["acks_popped"] > 0 and vp["storage_popped"] > 0
    assert "depth 2" in vp["path"]
    assert vp["mean_lag_steps"] > 1
    assert vrec["arms"]["blocking"]["throughput_vs_l1"] is None  # no L1 arm
    assert (tmp_path / "v.png").read_bytes()[:8] == PNG_MAGIC  # default: next to --out


@pytest.mark.parametrize(
    "args, accepted",
    [
        (["--tp", "0"], "accepted values: an integer from 1 to 64"),
        (["--steps", "3"], "accepted values: an integer >= 20"),
        (["--arms", "bogus"], "accepted values: l1, blocking, pipelined"),
        (["--arms", "l1,bogus"], "accepted values: l1, blocking, pipelined"),
        (["--depth", "9"], "accepted values: an integer from 1 to 8"),
        (["--inject-latency-ms", "-1"], "accepted values: a number >= 0"),
        (["--reduce-group", "other"], "'shared', 'dedicated'"),
    ],
)
def test_bench_refuses_bad_options(tmp_path, args, accepted):
    rc, out, err = _finish(_start(["bench", *args], tmp_path), timeout=60)
    assert rc != 0
    assert accepted in err, err
    assert args[0] in err


def test_bench_fails_clearly_when_a_rank_dies(tmp_path):
    rc, out, err = _finish(
        _start(
            [
                "bench",
                "--arms",
                "l1",
                "--tp",
                "2",
                "--steps",
                "20",
                "--step-ms",
                "1",
                "--crash-rank-at",
                "1:5",
                "--quiet",
            ],
            tmp_path,
        ),
        timeout=90,
    )
    assert rc == 1, err
    assert "rank 1 exited with code 3" in err
    assert not (tmp_path / "bench.png").exists()


def test_doctor(tmp_path):
    """Default env: active (exit 0). Disabled by env, or excluded by
    SGLANG_PLUGINS: inactive (non-zero). Run concurrently (each imports SGLang)."""
    args = ["doctor", "--tp", "2", "--rounds", "20"]
    procs = {
        "default": _start(args, tmp_path),
        "disabled": _start(args, tmp_path, SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC="0"),
        "excluded": _start(args, tmp_path, SGLANG_PLUGINS="other"),
        "bad depth": _start(
            ["doctor", "--rounds", "0"], tmp_path, SGLANG_HICACHE_ASYNC_ACK_DEPTH="99"
        ),
    }
    res = {name: _finish(p) for name, p in procs.items()}
    rc, out, err = res["default"]
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert __version__ in out
    assert metadata.version("sglang") in out
    assert "supported" in out and "yes" in out
    assert "gloo all_reduce" in out and "median" in out
    assert "blocking penalty" in out
    assert "ACTIVE" in out
    for name, needle in (
        ("disabled", "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC"),
        ("excluded", "SGLANG_PLUGINS"),
        ("bad depth", "SGLANG_HICACHE_ASYNC_ACK_DEPTH"),
    ):
        rc, out, err = res[name]
        assert rc != 0, (name, out, err)
        assert "INACTIVE" in out and needle in out.split("verdict")[1], (name, out)
        assert __version__ in out
