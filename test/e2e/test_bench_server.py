"""``hicache-async-ack-lab bench-server``: its rounds, statistics, refusals and records (fast),
and short real runs against SGLang's real server (e2e)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.bench import multiturn, server_report, stats
from hicache_async_ack_lab.cli import build_parser
from hicache_async_ack_lab.cpu_server import bound
from hicache_async_ack_lab.cpu_server.settings import CPU_REDUCE_LATENCY_VAR, CPU_SKEW_VAR

# --- rounds ------------------------------------------------------------------------


def test_rounds_reverse_so_every_config_has_the_same_mean_position():
    confs = ["l1", "bound", "stock", "plugin"]
    order = stats.round_order(confs, 4)
    assert order[0] == confs and order[1] == confs[::-1] and order[2] == confs
    positions = {c: [rnd.index(c) for rnd in order] for c in confs}
    means = {c: sum(p) / len(p) for c, p in positions.items()}
    assert len(set(means.values())) == 1, means


def test_a_linear_drift_cancels_in_the_paired_ratio():
    # Every visit is 1% slower than the one before; the arms are equal underneath.
    confs = ["stock", "plugin"]
    t = 0
    figures: dict[str, list[float]] = {c: [] for c in confs}
    for rnd in stats.round_order(confs, 4):
        for c in rnd:
            figures[c].append(100.0 * 0.99**t)
            t += 1
    iv = stats.paired_ratio(figures["plugin"], figures["stock"])
    assert iv.low is not None and iv.high is not None
    assert iv.low <= 1.0 <= iv.high
    assert iv.ratio == pytest.approx(1.0, abs=1e-12)
    # Negative control: the same drift without the reversal favours the arm that goes first.
    t = 0
    fixed: dict[str, list[float]] = {c: [] for c in confs}
    for _ in range(4):
        for c in confs:
            fixed[c].append(100.0 * 0.99**t)
            t += 1
    assert stats.paired_ratio(fixed["plugin"], fixed["stock"]).ratio == pytest.approx(0.99)


def test_one_rounds_servers_l1_and_bound_once_stock_and_plugin_per_latency():
    cfg = {"arms": ["l1", "stock", "plugin", "bound"], "latencies_ms": [0.0, 3.2], "lanes": [8]}
    assert server_report.configs(cfg) == [
        ("l1", 0.0, 8), ("bound", 0.0, 8),
        ("stock", 0.0, 8), ("plugin", 0.0, 8),
        ("stock", 3.2, 8), ("plugin", 3.2, 8),
    ]  # fmt: skip


# --- intervals and verdicts -----------------------------------------------------------


def test_paired_ratio_is_a_t_interval_on_the_log_ratios():
    num, den = [110.0, 120.0, 100.0], [100.0, 100.0, 100.0]
    logs = [math.log(1.1), math.log(1.2), 0.0]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    half = 4.303 * sd / math.sqrt(3)  # t(0.975, df=2)
    iv = stats.paired_ratio(num, den)
    assert iv.n == 3
    assert iv.ratio == pytest.approx(math.exp(mean))
    assert iv.low == pytest.approx(math.exp(mean - half))
    assert iv.high == pytest.approx(math.exp(mean + half))


def test_one_round_gives_no_interval_and_no_verdict():
    iv = stats.paired_ratio([105.0], [100.0])
    assert iv.low is None and iv.high is None
    assert stats.verdict(iv, stats.Claim(0.98)) == stats.INCONCLUSIVE
    assert "no interval" in iv.fmt()


@pytest.mark.parametrize(
    "low, high, claim, expected",
    [
        (0.985, 1.01, stats.Claim(0.98), stats.HOLDS),
        (0.95, 0.97, stats.Claim(0.98), stats.FAILS),
        (0.90, 1.05, stats.Claim(0.98), stats.INCONCLUSIVE),
        (0.60, 0.70, stats.Claim(1.0, "<"), stats.HOLDS),
        (1.01, 1.10, stats.Claim(1.0, "<"), stats.FAILS),
        (0.90, 1.10, stats.Claim(1.0, "<"), stats.INCONCLUSIVE),
    ],
)
def test_a_claim_holds_only_at_the_intervals_worse_end(low, high, claim, expected):
    assert stats.verdict(stats.Interval(1.0, low, high, 5), claim) == expected


def test_paired_ratio_refuses_unpaired_rounds():
    with pytest.raises(ValueError, match="differ in number"):
        stats.paired_ratio([1.0, 2.0], [1.0])


def _visits(figures: dict[tuple[str, float], list[float]], lanes=8) -> list[dict]:
    return [
        {"arm": arm, "latency_ms": lat, "lanes": lanes, "round": r, "output_throughput": x}
        for (arm, lat), xs in figures.items()
        for r, x in enumerate(xs)
    ]


CFG = {"arms": ["l1", "stock", "plugin", "bound"], "latencies_ms": [0.0, 3.2], "lanes": [8]}


def test_steady_rounds_give_verdicts_a_loaded_box_gives_inconclusive():
    steady = {
        ("l1", 0.0): [100.0, 101.0, 99.0, 100.0, 100.5],
        ("bound", 0.0): [99.0, 100.0, 98.5, 99.0, 99.5],
        ("stock", 0.0): [96.0, 97.0, 95.0, 96.0, 96.5],
        ("plugin", 0.0): [98.5, 99.5, 98.0, 98.5, 99.0],
        ("stock", 3.2): [62.0, 63.0, 61.5, 62.0, 62.5],
        ("plugin", 3.2): [98.0, 99.0, 97.5, 98.0, 98.5],
    }
    rows = {(r["ratio"], r["latency_ms"]): r for r in server_report.ratios(CFG, _visits(steady))}
    assert rows, "no ratio computed"
    assert rows[("plugin / stock", 3.2)]["verdict"] == stats.HOLDS
    assert rows[("plugin / bound", 3.2)]["verdict"] == stats.HOLDS
    assert rows[("stock / own 0 ms", 3.2)]["verdict"] == stats.HOLDS
    assert rows[("stock / L1", 3.2)]["verdict"] == stats.HOLDS
    assert rows[("plugin / stock", 3.2)]["value"] == pytest.approx(98.2 / 62.2, rel=0.01)

    # The same means, but each visit +-25% at random-looking offsets (other work).
    jitter = [1.25, 0.8, 1.1, 0.75, 1.2]
    loaded = {k: [x * jitter[(i + j) % 5] for j, x in enumerate(xs)]
              for i, (k, xs) in enumerate(steady.items())}  # fmt: skip
    rows = {(r["ratio"], r["latency_ms"]): r for r in server_report.ratios(CFG, _visits(loaded))}
    assert rows[("plugin / bound", 3.2)]["verdict"] == stats.INCONCLUSIVE
    assert rows[("plugin / L1", 0.0)]["verdict"] == stats.INCONCLUSIVE


def test_ratios_pair_only_rounds_both_arms_ran():
    figures = {("stock", 3.2): [50.0, 60.0, 70.0], ("plugin", 3.2): [100.0, 120.0]}
    cfg = {"arms": ["stock", "plugin"], "latencies_ms": [3.2], "lanes": [None]}
    (row,) = server_report.ratios(cfg, _visits(figures, lanes=None))
    assert row["ratio"] == "plugin / stock" and row["rounds"] == [0, 1]
    assert row["per_round"] == pytest.approx([2.0, 2.0])


def test_the_report_names_inconclusive_claims_and_the_seed_form(capsys, tmp_path):
    visits = _visits({("l1", 0.0): [100.0, 90.0], ("stock", 3.2): [60.0, 70.0],
                      ("plugin", 3.2): [95.0, 80.0], ("bound", 0.0): [97.0, 85.0]})  # fmt: skip
    for v in visits:
        run = {"host_share": 0.4, "ack_waits": 100, "ack_wait_s": 1.0, "client_wall_s": 20.0}
        v |= {"runs": [run], "loadavg_start": (5.0, 0, 0),
              "loadavg_end": (6.0, 0, 0), "startup_s": 30.0}  # fmt: skip
    cfg = CFG | {"latencies_ms": [3.2], "workload": "multiturn", "turns": 5, "system_words": 60,
                 "question_words": 15, "output_len": 16, "tp": 2, "max_total_tokens": 512,
                 "rounds": 2, "runs": 1}  # fmt: skip
    rows = server_report.ratios(cfg, visits)
    server_report.print_report(cfg, visits, rows, (5.0, 0, 0), (6.0, 0, 0), 600.0, tmp_path)
    out = capsys.readouterr().out
    assert "inconclusive" in out
    assert "vs L1 (the seed's form" in out
    assert "40%" in out  # host hits
    assert "2.5%" in out  # the plugin's wait: 1 s of 20 s x 2 ranks
    png = tmp_path / "x.png"
    server_report.draw_png(png, cfg, visits, rows)
    assert png.stat().st_size > 0


# --- options ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, accepted",
    [
        (["--arms", "plugin,gpu"], "l1, stock, plugin, bound"),
        (["--latency-ms", "-1"], "numbers >= 0"),
        (["--lanes", "0"], "integers >= 1"),
        (["--tp", "0"], "an integer from 1 to 8"),
        (["--workload", "sharegpt"], "gsp"),
        (["--storage-prefetch-timeout-s", "soon"], "a number >= 0 (seconds)"),
    ],
)
def test_bad_options_name_the_accepted_values(argv, accepted, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench-server", *argv])
    assert accepted in capsys.readouterr().err


def test_the_defaults_are_the_quick_run():
    args = build_parser().parse_args(["bench-server"])
    assert args.workload == "gsp" and args.arms == ("stock", "plugin")
    assert args.latency_ms == (0.0, 3.2) and args.rounds == 3


# --- the bound's stand-in -----------------------------------------------------------


BOUND_ENV = {bound.CPU_BOUND_VAR: "1", ENABLE_VAR: "0"}


def test_the_bound_is_off_unless_asked_for():
    assert bound.check({}) is False
    assert bound.check({bound.CPU_BOUND_VAR: "0", CPU_SKEW_VAR: "0,3"}) is False
    assert bound.check(BOUND_ENV) is True


@pytest.mark.parametrize(
    "extra, named",
    [
        ({CPU_SKEW_VAR: "0,3"}, CPU_SKEW_VAR),
        ({CPU_REDUCE_LATENCY_VAR: "3.2"}, CPU_REDUCE_LATENCY_VAR),
        ({ENABLE_VAR: "1"}, ENABLE_VAR),
    ],
)
def test_the_bound_is_refused_where_its_answers_would_be_wrong(extra, named):
    with pytest.raises(ValueError, match=named):
        bound.check(BOUND_ENV | extra)


def _fake_cache_module():
    calls = []

    class UnifiedRadixCache:
        def _all_reduce_attn_groups(self, tensor, op):
            calls.append("attn")
            tensor[0] = -1

        def _all_reduce(self, data, tp_reduce_op):
            calls.append("all")
            data[0] = -1

    return types.SimpleNamespace(UnifiedRadixCache=UnifiedRadixCache), calls


def test_the_bound_answers_every_collective_with_the_ranks_own_value(monkeypatch):
    module, calls = _fake_cache_module()
    for k, v in BOUND_ENV.items():
        monkeypatch.setenv(k, v)
    patches: dict = {}
    bound.register(patches, {})
    patches["sglang.srt.mem_cache.unified_radix_cache"](module)
    cache, data = module.UnifiedRadixCache(), [7]
    cache._all_reduce(data, None)
    cache._all_reduce_attn_groups(data, None)
    assert data == [7] and calls == []
    assert module.UnifiedRadixCache._all_reduce.__wrapped__.__name__ == "_all_reduce"


def test_without_the_variable_the_collectives_are_untouched(monkeypatch):
    # Negative control: the same registration, the variable unset.
    module, calls = _fake_cache_module()
    monkeypatch.delenv(bound.CPU_BOUND_VAR, raising=False)
    earlier = []
    patches = {"sglang.srt.mem_cache.unified_radix_cache": lambda m: earlier.append(m)}
    bound.register(patches, {})
    patches["sglang.srt.mem_cache.unified_radix_cache"](module)
    data = [7]
    module.UnifiedRadixCache()._all_reduce(data, None)
    assert data == [-1] and calls == ["all"]
    assert earlier == [module]  # the stand-ins' own patch still runs first


def test_cpu_server_refuses_the_bound_with_the_plugin_on_and_accepts_it_off():
    import os

    base = [sys.executable, "-m", "hicache_async_ack_lab", "cpu-server", "--tp", "2",
            "--cpu-bound", "--cpu-print-command"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != ENABLE_VAR}
    on = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert on.returncode == 2 and f"{ENABLE_VAR}=0" in on.stderr
    off = subprocess.run(base, capture_output=True, text=True, timeout=120,
                         env=env | {ENABLE_VAR: "0"})  # fmt: skip
    assert off.returncode == 0, off.stderr
    assert f"{bound.CPU_BOUND_VAR}=1" in off.stderr  # what the server would be given


# --- the local plugin reduce's stand-in ------------------------------------------------

LOCAL_ENV = {bound.CPU_LOCAL_REDUCE_VAR: "1", ENABLE_VAR: "1"}


@pytest.mark.parametrize(
    "extra, named",
    [
        ({CPU_SKEW_VAR: "0,3"}, CPU_SKEW_VAR),
        ({CPU_REDUCE_LATENCY_VAR: "3.2"}, CPU_REDUCE_LATENCY_VAR),
        ({ENABLE_VAR: "0"}, ENABLE_VAR),
    ],
)
def test_the_local_reduce_is_refused_where_its_answers_would_be_wrong(extra, named):
    assert bound.check_local({}) is False
    assert bound.check_local(LOCAL_ENV) is True
    with pytest.raises(ValueError, match=named):
        bound.check_local(LOCAL_ENV | extra)
    with pytest.raises(ValueError, match="choose one"):  # never both devices at once
        bound.check(BOUND_ENV | {bound.CPU_LOCAL_REDUCE_VAR: "1"})


def _installed_by_the_patch(monkeypatch, env):
    """The plugin's async MIN after the cpu-server's patch ran, as it runs when
    the plugin's module loads (on a default environment, put back after)."""
    from hicache_async_ack.sglang_plugin import Environment, environment, use_environment

    for k in (bound.CPU_LOCAL_REDUCE_VAR, bound.CPU_BOUND_VAR):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = use_environment(Environment())
    try:
        patches: dict = {}
        bound.register(patches, {})
        patches["hicache_async_ack.sglang_plugin"](None)
        return environment().collectives.async_min
    finally:
        use_environment(before)


def test_the_local_reduce_answers_the_plugins_reduces_with_the_ranks_own_value(monkeypatch):
    from hicache_async_ack.sglang_plugin import Collectives

    issue = _installed_by_the_patch(monkeypatch, LOCAL_ENV)(object())  # no group needed
    handle = issue([3, 5, 9, -9])
    assert handle.is_completed() and handle.wait() == [3, 5, 9, -9]
    # Negative control: without the variable the plugin's real reduce stays installed.
    assert _installed_by_the_patch(monkeypatch, {}) is Collectives().async_min


def test_cpu_server_refuses_the_local_reduce_with_the_plugin_off():
    import os

    base = [sys.executable, "-m", "hicache_async_ack_lab", "cpu-server", "--tp", "2",
            "--cpu-local-reduce", "--cpu-print-command"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != ENABLE_VAR}
    off = subprocess.run(base, capture_output=True, text=True, timeout=120,
                         env=env | {ENABLE_VAR: "0"})  # fmt: skip
    assert off.returncode == 2 and ENABLE_VAR in off.stderr
    on = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert on.returncode == 0, on.stderr
    assert f"{bound.CPU_LOCAL_REDUCE_VAR}=1" in on.stderr


def test_the_dedicated_group_is_off_unless_asked_for_and_never_beside_another_device():
    assert bound.check_dedicated({}) is False
    assert bound.check_dedicated({bound.CPU_DEDICATED_GROUP_VAR: "1"}) is True
    for other in (bound.CPU_LOCAL_REDUCE_VAR, bound.CPU_BOUND_VAR):
        with pytest.raises(ValueError, match=bound.CPU_DEDICATED_GROUP_VAR):
            bound.check_dedicated({bound.CPU_DEDICATED_GROUP_VAR: "1", other: "1"})


def test_the_dedicated_arm_runs_per_latency_and_is_compared_with_the_plugin():
    cfg = {"arms": ["bound", "plugin", "dedicated"], "latencies_ms": [0.0, 3.2], "lanes": [8]}
    assert server_report.configs(cfg) == [
        ("bound", 0.0, 8), ("plugin", 0.0, 8), ("dedicated", 0.0, 8),
        ("plugin", 3.2, 8), ("dedicated", 3.2, 8),
    ]  # fmt: skip
    visits = [
        {"arm": a, "latency_ms": lat, "lanes": 8, "round": r, "output_throughput": 100.0}
        for r in range(2)
        for a, lat, _ in server_report.configs(cfg)
    ]
    names = {(x["ratio"], x["latency_ms"]) for x in server_report.ratios(cfg, visits)}
    assert {("dedicated / plugin", 3.2), ("dedicated / bound", 0.0)} <= names


def test_the_local_arm_splits_plugin_over_bound_in_two():
    cfg = {"arms": ["bound", "local", "plugin"], "latencies_ms": [3.2], "lanes": [8]}
    assert server_report.configs(cfg) == [
        ("bound", 0.0, 8), ("local", 0.0, 8), ("plugin", 3.2, 8),
    ]  # fmt: skip
    visits = [
        {"arm": a, "latency_ms": lat, "lanes": 8, "round": r, "output_throughput": tput}
        for r in range(3)
        for a, lat, tput in (("bound", 0.0, 100.0), ("local", 0.0, 95.0), ("plugin", 3.2, 90.0))
    ]
    by = {r["ratio"]: r["value"] for r in server_report.ratios(cfg, visits)}
    assert by["local / bound"] == pytest.approx(0.95)
    assert by["plugin / local"] == pytest.approx(90 / 95)
    assert by["plugin / bound"] == pytest.approx(by["local / bound"] * by["plugin / local"])


# --- the seed-shaped trace ----------------------------------------------------------


def test_the_trace_is_one_conversation_per_lane_with_the_system_prompt_first():
    trace = multiturn.make_trace(lanes=3, turns=4, system_words=10, question_words=5, seed=1)
    assert trace == multiturn.make_trace(3, 4, 10, 5, seed=1)
    assert trace != multiturn.make_trace(3, 4, 10, 5, seed=2)
    convs = trace["conversations"]
    assert len(convs) == 3 and all(len(c) == 4 for c in convs)
    assert [m["role"] for m in convs[0][0]["messages"]] == ["system", "user"]
    assert [m["role"] for m in convs[0][1]["messages"]] == ["user"]
    assert len(convs[0][0]["messages"][0]["content"].split()) == 10


def test_sglangs_loader_replays_each_lane_turn_by_turn(tmp_path):
    from sglang.benchmark.datasets.agentic_trace import AgenticTraceDataset

    path = tmp_path / "trace.json"
    path.write_text(json.dumps(multiturn.make_trace(3, 4, 10, 5, seed=1)))
    rows = AgenticTraceDataset(str(path), 3, 16, 0, None).load(tokenizer=None)
    assert len(rows) == 3
    assert all(len(r.prompt) == 4 and r.output_len == 16 for r in rows)


def test_host_share_reads_the_cache_report():
    rep = {"cache_report": {"total_prompt_tokens": 1000, "host_cached_tokens": 420}}
    assert multiturn.host_share(rep) == pytest.approx(0.42)
    assert multiturn.host_share({}) is None


# --- real runs (e2e) ----------------------------------------------------------------


def _bench(tmp_path, *argv: str) -> tuple[dict, str]:
    out = tmp_path / "server.jsonl"
    cmd = [sys.executable, "-m", "hicache_async_ack_lab", "bench-server", *argv,
           "--out", str(out), "--png", str(tmp_path / "server.png"),
           "--workdir", str(tmp_path / "work"), "--quiet"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "server.png").stat().st_size > 0
    return json.loads(out.read_text().splitlines()[-1]), proc.stdout


# soak: five arms, five server starts; the shared-prompt run is CI's smoke of the bench
@pytest.mark.soak
@pytest.mark.e2e
def test_the_seeds_arms_on_the_real_server_multiturn(tmp_path):
    record, stdout = _bench(
        tmp_path, "--workload", "multiturn", "--arms", "l1,stock,plugin,bound,local",
        # 4 histories of up to ~500 tokens cannot all stay in a 1024-token device pool,
        # so some come back from host whatever the timing, while the longest still fits
        # one request's context (every turn served: the bench refuses a run otherwise)
        "--latency-ms", "3.2", "--rounds", "1", "--lanes", "4", "--turns", "3",
        "--max-total-tokens", "1024",
    )  # fmt: skip
    by_arm = {v["arm"]: v for v in record["visits"]}
    assert sorted(by_arm) == ["bound", "l1", "local", "plugin", "stock"]
    for arm in ("plugin", "local"):  # read from the server's /metrics
        assert by_arm[arm]["pipelined_ranks"] == 2
        assert by_arm[arm]["popped_entries"] > 0
    assert by_arm["stock"]["pipelined_ranks"] == by_arm["bound"]["pipelined_ranks"] == 0
    for v in record["visits"]:
        (run,) = v["runs"]
        assert run["completed"] == 4 * 3  # every turn of every lane
        assert run["total_output_tokens"] == 4 * 3 * 16  # and every one served
        assert len(run["loadavg_start"]) == len(run["loadavg_end"]) == 3
        assert v["output_throughput"] > 0
    assert by_arm["plugin"]["runs"][0]["host_share"] > 0  # histories came back from host
    assert by_arm["plugin"]["runs"][0]["ack_waits"] > 0  # its wait, read over the run
    assert by_arm["stock"]["runs"][0]["ack_waits"] == 0
    assert by_arm["l1"]["runs"][0]["host_share"] in (0, None)
    assert "vs L1 (the seed's form" in stdout
    assert "inconclusive" in stdout  # one round: no interval, no claim


# soak: two more server starts; the shared-prompt run below is CI's smoke of the bench
@pytest.mark.soak
@pytest.mark.e2e
def test_the_quick_default_workload_on_the_real_server(tmp_path):
    record, stdout = _bench(
        tmp_path, "--latency-ms", "3.2", "--rounds", "1", "--num-groups", "2",
        "--prompts-per-group", "4", "--system-prompt-len", "64", "--question-len", "16",
        "--output-len", "4",
    )  # fmt: skip
    by_arm = {v["arm"]: v for v in record["visits"]}
    assert sorted(by_arm) == ["plugin", "stock"]
    assert by_arm["plugin"]["pipelined_ranks"] == 2
    assert by_arm["stock"]["pipelined_ranks"] == 0
    for v in by_arm.values():
        assert v["runs"][0]["completed"] == 8
    assert any(r["ratio"] == "plugin / stock" for r in record["ratios"])


@pytest.mark.e2e
def test_the_shared_prompt_workload_on_the_real_server_with_mooncake(tmp_path):
    """One round of every arm (stock, plugin, read-once), few requests: the L3 work
    comes from mooncake_master's own counters and every request is served."""
    record, stdout = _bench(
        tmp_path, "--storage", "mooncake", "--workload", "shared-prompt", "--rounds", "1",
        "--arrivals", "dense,burst", "--shared-requests", "6", "--shared-prompt-tokens",
        "400", "--output-len", "4",
    )  # fmt: skip
    assert record["kind"] == "server-shared-prompt"
    by_arm = {v["arm"]: v for v in record["visits"]}
    assert sorted(by_arm) == ["plugin", "read-once", "stock"]
    assert by_arm["stock"]["pipelined_ranks"] == 0
    assert by_arm["plugin"]["pipelined_ranks"] == by_arm["read-once"]["pipelined_ranks"] == 2
    for v in by_arm.values():
        assert v["keys_stored"] > 0  # the warm-up wrote the prompt through to the store
        assert sorted(v["patterns"]) == ["burst", "dense"]
        for pattern in v["patterns"].values():
            (run,) = pattern["runs"]
            assert run["requests"] == 6 and run["output_throughput"] > 0
            # after the flush the prompt is only in the store: read from it, counted there
            assert run["l3_keys_read"] > 0 and run["l3_queries"] > 0, run
            assert run["l3_bytes_read"] > 0
    assert "keys read/req" in stdout and "read-once / stock" in stdout
    assert "goal at 0 ms" in stdout and "inconclusive" in stdout  # one round: no interval
    # a visit the flush race killed ran once more in its own folder (the first's logs stay)
    work = tmp_path / "work"
    if by_arm["stock"]["attempts"] == 2:
        work = work / "again-stock-r0"
    assert sorted(work.glob("l3-shared-stock-0ms-r0-burst-0-*.prom")), "snapshots not kept"


def test_a_failed_server_start_is_retried_then_reported(monkeypatch):
    from hicache_async_ack_lab.bench import server as bench_server
    from hicache_async_ack_lab.cli_support import ToolError
    from hicache_async_ack_lab.cpu_server import ServerFailed

    monkeypatch.setattr(bench_server, "START_RETRY_S", 0.0)

    class Flaky:
        def __init__(self, failures):
            self.failures, self.starts = failures, 0

        def start(self):
            self.starts += 1
            if self.starts <= self.failures:
                raise ServerFailed("Not enough host memory available")

    ok = Flaky(2)
    assert bench_server.start(ok, "stock-0ms-r0", quiet=True) == 3
    with pytest.raises(ToolError, match="did not start 3 times"):
        bench_server.start(Flaky(3), "stock-0ms-r0", quiet=True)


def test_an_earlier_runs_visits_are_reported_without_running_anything(tmp_path, capsys):
    from hicache_async_ack_lab.bench import server as bench_server

    visits = _visits({("l1", 0.0): [60.0, 66.0], ("bound", 0.0): [80.0, 90.0],
                      ("stock", 3.2): [50.0, 52.0], ("plugin", 3.2): [75.0, 92.0]})  # fmt: skip
    for v in visits:
        v |= {"runs": [{"host_share": 0.38, "loadavg_start": [9.0, 0, 0],
                        "loadavg_end": [9.5, 0, 0]}],
              "loadavg_start": [9.0, 0, 0], "loadavg_end": [9.5, 0, 0], "startup_s": 40.0,
              "wall_s": 300.0, "pipelined_ranks": 2 if v["arm"] == "plugin" else 0}  # fmt: skip
    src = tmp_path / "visits.jsonl"
    src.write_text("".join(json.dumps(v) + "\n" for v in visits))
    out = tmp_path / "r.jsonl"
    args = build_parser().parse_args([
        "bench-server", "--workload", "multiturn", "--arms", "l1,stock,plugin,bound",
        "--latency-ms", "3.2", "--from-visits", str(src), "--out", str(out),
        "--png", str(tmp_path / "r.png"), "--workdir", str(tmp_path), "--quiet",
    ])  # fmt: skip
    assert bench_server.run(args) == 0
    text = capsys.readouterr().out
    assert "8 server runs in 40.0 min" in text and "2 rounds" in text
    record = json.loads(out.read_text())
    assert record["config"]["rounds"] == 2 and len(record["visits"]) == 8
    names = {r["ratio"] for r in record["ratios"]}
    assert {"plugin / stock", "plugin / bound", "plugin / L1", "bound / L1"} <= names
    assert record["ratios"] and all(r["n"] == 2 for r in record["ratios"]), record["ratios"]
    verdicts = {stats.HOLDS, stats.FAILS, stats.INCONCLUSIVE}
    assert all(r["verdict"] in verdicts for r in record["ratios"])


def test_earlier_runs_pool_their_rounds_without_pairing_across_runs(tmp_path):
    from hicache_async_ack_lab.bench.arms import load_visits
    from hicache_async_ack_lab.cli_support import ToolError

    files = []
    for run, rounds in (("a", 2), ("b", 3)):
        path = tmp_path / f"{run}.jsonl"
        path.write_text("".join(json.dumps({"arm": "plugin", "round": r, "run": run}) + "\n"
                                for r in range(rounds)))  # fmt: skip
        files.append(str(path))
    visits = load_visits(",".join(files))
    assert [(v["run"], v["round"]) for v in visits] == [
        ("a", 0), ("a", 1), ("b", 2), ("b", 3), ("b", 4),
    ]  # fmt: skip
    with pytest.raises(ToolError, match="missing.jsonl is not a file"):
        load_visits(str(tmp_path / "missing.jsonl"))
