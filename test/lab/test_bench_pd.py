"""``bench-server --workload pd`` without a server: a round's visits (the prefill
warm-up, one decode server per arm serving every latency, the latency switched
between runs), its figures and checks, on a stand-in pair (the real pair runs in
test_pd.py and the bench itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.bench import pd, pd_report
from hicache_async_ack_lab.bench.arms import config_of
from hicache_async_ack_lab.cli import build_parser
from hicache_async_ack_lab.cli_support import ToolError
from hicache_async_ack_lab.cpu_server import pd as cpu_pd
from hicache_async_ack_lab.cpu_server.pd_standins import PASS_TIMES_DIR_VAR, write_rank_file
from hicache_async_ack_lab.cpu_server.settings import CPU_REDUCE_LATENCY_FILE_VAR

TP = 2


def metrics_text(pipelined: bool) -> str:
    lines = [f"# TYPE {pd.GAUGE} gauge"]
    lines += [f'{pd.GAUGE}{{tp_rank="{r}"}} {int(pipelined)}' for r in range(TP)]
    return "\n".join(lines) + "\n"


class FakeDecode:
    def __init__(self, text: str):
        self.text = text

    def get(self, path: str) -> bytes:
        assert path == "/metrics"
        return self.text.encode()

    def log(self) -> str:
        return ""


class FakePair:
    """What run_round and measure use of cpu_server.pd.PDPair; every call recorded."""

    events: list[str] = []
    ranks: "Ranks"

    def __init__(self, args, workdir, decode_tp, start_timeout_s):
        self.workdir, self.router_port, self.startup_s = workdir, 1, 1.0
        self.decode_env: dict = {}
        self.decode = FakeDecode(metrics_text(True))

    def start(self):
        self.decode = FakeDecode(metrics_text(self.decode_env.get(ENABLE_VAR) == "1"))
        self.ranks.write(self.decode_env, measured=False)
        self.events.append("start")

    def restart_decode(self, env, latency_ms, name):
        self.decode_env = env
        self.decode = FakeDecode(metrics_text(env.get(ENABLE_VAR) == "1"))
        self.ranks.write(self.decode_env, measured=False)
        self.events.append(f"restart {name}")

    def stop(self):
        self.events.append("stop")


@pytest.fixture
def cfg():
    args = build_parser().parse_args(
        ["bench-server", "--workload", "pd", "--tp", str(TP), "--arms", "stock,plugin",
         "--latency-ms", "0,3.2", "--rounds", "2", "--runs", "2"]
    )  # fmt: skip
    return config_of(args)


def test_each_arm_gets_one_decode_server_per_round_serving_every_latency(cfg):
    order = pd.visit_order(cfg)
    assert order == [[("stock", (0.0, 3.2)), ("plugin", (0.0, 3.2))],
                     [("plugin", (0.0, 3.2)), ("stock", (0.0, 3.2))]]  # fmt: skip
    cfg["arms"] = ["bound", "plugin"]
    assert pd.visit_order(cfg)[0] == [("plugin", (0.0, 3.2)), ("bound", (0.0,))]


def test_runs_alternate_the_latencies_in_mirrored_blocks_each_block_one_seed():
    assert pd.run_sequence((0.0, 3.2), 2) == [(0.0, 0), (3.2, 0), (3.2, 1), (0.0, 1)]
    seq = pd.run_sequence((0.0, 3.2), 4)
    for lat in (0.0, 3.2):  # every latency: the same blocks, the same mean position
        assert [b for x, b in seq if x == lat] == [0, 1, 2, 3]
    positions = {lat: sum(i for i, (x, _) in enumerate(seq) if x == lat) for lat in (0.0, 3.2)}
    assert positions[0.0] == positions[3.2]
    assert pd.run_sequence((0.0,), 3) == [(0.0, 0), (0.0, 1), (0.0, 2)]


class Ranks:
    """The decode ranks' pass-times files, as the device writes them: a start-up's and a
    warm-up's passes (at 0 ms, 4 ms each) before the measured runs, then theirs."""

    def __init__(self, running_by_latency: dict[str, int]):
        self.running = running_by_latency

    def write(self, env: dict, measured: bool) -> None:
        root = Path(env[PASS_TIMES_DIR_VAR])
        for rank in range(TP):
            values = {"0": {"running": [100, 0.4, 0.01, 0.1], "idle": [10, 0.001, 0.0001, 0]}}
            for lat, n in self.running.items() if measured else ():
                cells = values.setdefault(lat, {"running": [0, 0.0, 0.0, 0.0],
                                                "idle": [0, 0.0, 0.0, 0.0]})  # fmt: skip
                cells["running"] = [cells["running"][0] + n, cells["running"][1] + n * 0.002,
                                    0.01, cells["running"][3] + n * 0.0005]  # fmt: skip
            write_rank_file(root, "passes", rank, values)


def fake_round(cfg, monkeypatch, ranks: Ranks):
    FakePair.events = []
    FakePair.ranks = ranks
    monkeypatch.setattr(cpu_pd, "PDPair", FakePair)
    monkeypatch.setattr(pd, "PASS_TIMES_SETTLE_S", 0.0)
    want = cfg["num_groups"] * cfg["prompts_per_group"] * cfg["output_len"]
    calls: list[dict] = []

    def run_client(pair, argvs, workdir, name, latencies=None, latency_file=None):
        seeds = [a[a.index("--seed") + 1] for a in argvs]
        calls.append({"name": name, "latencies": latencies, "file": latency_file,
                      "seeds": seeds, "env": dict(pair.decode_env)})  # fmt: skip
        FakePair.events.append(f"client {name}")
        if latencies is not None:
            ranks.write(pair.decode_env, measured=True)
        # ITL: 30 ms, plus the latency, plus a drift of 1 ms per run
        return [{"total_output_tokens": want, "output_throughput": 100.0,
                 "median_itl_ms": 30.0 + (lat or 0.0) + i}
                for i, lat in enumerate(latencies or [0.0] * len(argvs))]  # fmt: skip

    monkeypatch.setattr(pd, "run_client", run_client)
    return calls


def test_a_round_warms_the_prefill_then_measures_each_arm_at_every_latency(
    cfg, monkeypatch, tmp_path
):
    calls = fake_round(cfg, monkeypatch, Ranks({"0": 40, "3.2": 38}))
    visits = pd.run_round(cfg, pd.visit_order(cfg)[0], 0, tmp_path, quiet=True)
    assert FakePair.events == [
        "start", "client pd-warmup-r0", "client pd-stock-r0",
        "restart pd-plugin-r0", "client pd-plugin-r0", "stop",
    ]  # fmt: skip
    warm, stock, plugin = calls
    s0, s1 = str(cfg["seed"]), str(cfg["seed"] + 1)
    assert warm["latencies"] is None and warm["seeds"] == [s0, s1]  # every measured prompt
    for visit in (stock, plugin):
        assert visit["latencies"] == [0.0, 3.2, 3.2, 0.0]
        assert visit["env"][CPU_REDUCE_LATENCY_FILE_VAR] == str(visit["file"])
        assert visit["seeds"] == [s0, s0, s1, s1]  # each latency: the same prompts
    assert [(v["arm"], v["latency_ms"]) for v in visits] == [
        ("stock", 0.0), ("stock", 3.2), ("plugin", 0.0), ("plugin", 3.2)]  # fmt: skip
    assert {v["visit"] for v in visits} == {"pd-stock-r0", "pd-plugin-r0"}
    for v in visits:
        assert len(v["runs"]) == cfg["runs"]
        # only the measured runs' passes: 2 ms each, 0.5 of it popping (the start-up's
        # and warm-up's 4 ms passes before them left out)
        assert v["passes_running"] == TP * (40 if v["latency_ms"] == 0 else 38)
        assert v["check_ms_running"] == pytest.approx(2.0)
        assert v["sync_ms_running"] == pytest.approx(1.5)
        assert v["pops_ms_running"] == pytest.approx(0.5)
    itl = {(v["arm"], v["latency_ms"]): v["median_itl_ms"] for v in visits}
    # each latency's runs averaged; the mirrored blocks cancel the drift
    assert itl[("plugin", 0.0)] == pytest.approx((30.0 + 33.0) / 2)
    assert itl[("plugin", 3.2)] - itl[("plugin", 0.0)] == pytest.approx(3.2)
    saved = [json.loads(x) for x in (tmp_path / "visits.jsonl").read_text().splitlines()]
    assert [(v["arm"], v["latency_ms"]) for v in saved] == [(v["arm"], v["latency_ms"])
                                                           for v in visits]  # fmt: skip


def test_a_latency_whose_runs_found_no_running_pass_at_it_is_refused(cfg, monkeypatch, tmp_path):
    fake_round(cfg, monkeypatch, Ranks({"0": 40}))  # the file never reached the ranks
    with pytest.raises(ToolError, match="no decode pass with a running batch at 3.2 ms"):
        pd.run_round(cfg, pd.visit_order(cfg)[0], 0, tmp_path, quiet=True)
    assert FakePair.events[-1] == "stop"


def test_the_bound_gets_no_latency_file(cfg, monkeypatch, tmp_path):
    calls = fake_round(cfg, monkeypatch, Ranks({"0": 40}))
    monkeypatch.setattr(pd, "check_arm", lambda *a: None)
    visits = pd.run_round(cfg, [("bound", (0.0,))], 0, tmp_path, quiet=True)
    assert CPU_REDUCE_LATENCY_FILE_VAR not in calls[-1]["env"] and calls[-1]["file"] is None
    assert [(v["arm"], v["latency_ms"]) for v in visits] == [("bound", 0.0)]


def test_pass_figures_are_every_ranks_time_over_every_ranks_passes():
    times = {
        "0": {"3.2": {"running": [10, 0.010, 0.002, 0.004], "idle": [5, 0.016, 0.004, 0]}},
        "1": {"3.2": {"running": [30, 0.030, 0.002, 0.0], "idle": [3, 0.0, 0.0, 0.0]}},
    }
    got = pd.pass_figures(times, 3.2)
    assert got["passes_running"] == 40 and got["check_ms_running"] == pytest.approx(1.0)
    assert got["pops_ms_running"] == pytest.approx(0.1)
    assert got["sync_ms_running"] == pytest.approx(0.9)
    assert got["passes_idle"] == 8 and got["check_ms_idle"] == pytest.approx(2.0)
    empty = pd.pass_figures(times, 0.0)
    assert empty["passes_running"] == 0 and empty["sync_ms_running"] == 0.0


def test_pass_times_count_only_what_the_measured_runs_added():
    before = {"0": {"0": {"running": [50, 0.5, 0.02, 0.1], "idle": [900, 0.9, 0.01, 0.0]}}}
    after = {
        "0": {
            "0": {"running": [70, 0.6, 0.03, 0.15], "idle": [1000, 1.0, 0.01, 0.0]},
            "3.2": {"running": [20, 0.08, 0.005, 0.01], "idle": [5, 0.02, 0.004, 0]},
        }
    }
    got = pd.pass_times_since(before, after)
    assert got["0"]["0"]["running"] == pytest.approx([20, 0.1, 0.03, 0.05])
    assert got["0"]["0"]["idle"] == pytest.approx([100, 0.1, 0.01, 0.0])
    assert got["0"]["3.2"] == after["0"]["3.2"]  # nothing at 3.2 ms before


def test_the_table_shows_sync_times_and_a_dash_for_visits_without_them():
    base = {"round": 0, "startup_s": 1.0, "output_throughput": 1.0, "median_itl_ms": 1.0}
    table = pd_report.arm_table([base | {"arm": "stock", "latency_ms": 0.0},
                                 base | {"arm": "plugin", "latency_ms": 0.0,
                                         "passes_running": 5, "sync_ms_running": 0.25,
                                         "passes_idle": 2, "sync_ms_idle": 1.5,
                                         "pops_ms_running": 2.0}])  # fmt: skip
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert set(rows) == {"stock", "plugin"}
    assert rows["plugin"][-4:-1] == ["0.250", "1.500", "2.000"]
    assert rows["stock"][-4:-1] == ["-", "-", "-"]  # the check columns, before start-up


def test_the_plugin_arm_must_show_every_rank_pipelined(cfg):
    pair = FakePair(None, None, TP, 0)
    assert pd.pipelined_ranks(pair) == TP
    pair.decode = FakeDecode(metrics_text(False))
    assert pd.pipelined_ranks(pair) == 0
    with pytest.raises(ToolError, match="0 decode ranks pipelined, expected 2"):
        pd.check_arm(cfg, "plugin", 0, "", "pd-plugin-r0")


def test_what_a_latency_adds_to_the_sync_is_paired_by_round_within_each_arm(cfg):
    def visit(arm, lat, rnd, sync):
        return {"arm": arm, "latency_ms": lat, "round": rnd, "passes_running": 10,
                "sync_ms_running": sync}  # fmt: skip

    visits = [visit("stock", 0.0, 0, 2.0), visit("stock", 3.2, 0, 5.3),
              visit("stock", 0.0, 1, 1.0), visit("stock", 3.2, 1, 4.1),
              visit("plugin", 0.0, 0, 1.5), visit("plugin", 3.2, 0, 1.5),
              visit("plugin", 0.0, 1, 0.8), visit("plugin", 3.2, 1, 0.8)]  # fmt: skip
    rows = {r["arm"]: r for r in pd_report.sync_rows(cfg, visits)}
    assert rows["stock"]["added_ms"] == pytest.approx(3.2) and rows["stock"]["n"] == 2
    # differences 3.3 and 3.1: sd 0.1414, t(1) = 12.706, half-width 1.2706
    assert rows["stock"]["low"] == pytest.approx(1.929, abs=1e-3)
    assert rows["plugin"]["added_ms"] == pytest.approx(0.0)
    assert rows["plugin"]["low"] == pytest.approx(0.0) == rows["plugin"]["high"]
    text = pd_report.sync_table(list(rows.values()))
    assert "stock" in text and "3.200 [" in text
