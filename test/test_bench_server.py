"""``hicache-async-ack bench-server``: the arms' order and arithmetic (fast), and
one short real run of both arms against SGLang's real server (e2e)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache_async_ack.tools.bench import server as bench_server
from hicache_async_ack.tools.cli import build_parser


def test_arms_alternate_abba_across_latencies():
    assert bench_server.order(("stock", "plugin"), (0.0, 3.0, 6.0)) == [
        ("stock", 0.0), ("plugin", 0.0),
        ("plugin", 3.0), ("stock", 3.0),
        ("stock", 6.0), ("plugin", 6.0),
    ]  # fmt: skip


def test_relative_throughput_against_stock_and_own_no_latency():
    def res(arm, lat, tput):
        return {"arm": arm, "latency_ms": lat, "median": {"output_throughput": tput}}

    results = [res("stock", 0.0, 100.0), res("plugin", 0.0, 110.0),
               res("stock", 3.0, 80.0), res("plugin", 3.0, 107.8)]  # fmt: skip
    bench_server.relative(results)
    assert [r["vs_stock"] for r in results] == pytest.approx([1.0, 1.1, 1.0, 1.3475])
    assert [r["vs_own_no_latency"] for r in results] == pytest.approx([1.0, 1.0, 0.8, 0.98])


@pytest.mark.parametrize(
    "argv, accepted",
    [
        (["--arms", "plugin,gpu"], "stock, plugin"),
        (["--latency-ms", "-1"], "numbers >= 0"),
        (["--tp", "0"], "an integer from 1 to 8"),
    ],
)
def test_bad_options_name_the_accepted_values(argv, accepted, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench-server", *argv])
    assert accepted in capsys.readouterr().err


@pytest.mark.e2e
def test_one_short_run_of_both_arms_on_the_real_server(tmp_path):
    out = tmp_path / "server.jsonl"
    png = tmp_path / "server.png"
    cmd = [
        sys.executable, "-m", "hicache_async_ack", "bench-server",
        # Injected latency: the measurement device must leave the plugin live.
        "--runs", "1", "--latency-ms", "3", "--num-groups", "2",
        "--prompts-per-group", "4", "--system-prompt-len", "64", "--question-len", "16",
        "--output-len", "4", "--out", str(out), "--png", str(png),
        "--workdir", str(tmp_path / "work"), "--quiet",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("stock ") for line in lines), proc.stdout
    assert any(line.startswith("plugin ") for line in lines), proc.stdout
    record = json.loads(out.read_text().splitlines()[-1])
    by_arm = {r["arm"]: r for r in record["results"]}
    assert by_arm["plugin"]["pipelined_ranks"] == 2  # read from the server's /metrics
    assert by_arm["stock"]["pipelined_ranks"] == 0
    assert by_arm["plugin"]["popped_entries"] > 0
    for r in by_arm.values():
        assert r["runs"][0]["completed"] == 8
        assert r["median"]["output_throughput"] > 0
    assert png.stat().st_size > 0
