"""``bench-server --workload pd`` without a server: the round's prefill warm-up and the
decode's wait figure, on a stand-in pair (the real pair runs in test_e2e_pd.py and
the bench itself)."""

from __future__ import annotations

import pytest

from hicache_async_ack_lab.bench import pd
from hicache_async_ack_lab.bench.arms import config_of
from hicache_async_ack_lab.cli import build_parser
from hicache_async_ack_lab.cpu_server import pd as cpu_pd

TP = 2


def metrics_text(waits_s: list[float], steps: list[int], pipelined: bool) -> str:
    name = pd.WAIT
    lines = [f"# TYPE {name} histogram"]
    for rank, (w, n) in enumerate(zip(waits_s, steps)):
        lines += [f'{name}_bucket{{tp_rank="{rank}",le="+Inf"}} {n}',
                  f'{name}_count{{tp_rank="{rank}"}} {n}',
                  f'{name}_sum{{tp_rank="{rank}"}} {w}']  # fmt: skip
    lines.append(f"# TYPE {pd.GAUGE} gauge")
    lines += [f'{pd.GAUGE}{{tp_rank="{r}"}} {int(pipelined)}' for r in range(len(steps))]
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

    def __init__(self, args, workdir, decode_tp, start_timeout_s):
        self.workdir, self.router_port, self.startup_s = workdir, 1, 1.0
        self.decode_env, self.latency_ms = None, 0.0
        self.decode = FakeDecode(metrics_text([0.003, 0.003], [10, 10], True))

    def start(self):
        self.events.append("start")

    def restart_decode(self, env, latency_ms, name):
        self.events.append(f"restart {name}")

    def stop(self):
        self.events.append("stop")


@pytest.fixture
def cfg():
    args = build_parser().parse_args(
        ["bench-server", "--workload", "pd", "--tp", str(TP), "--arms", "plugin",
         "--latency-ms", "0,3.2", "--rounds", "1", "--runs", "2"]
    )  # fmt: skip
    return config_of(args)


def test_the_round_warms_its_prefill_once_before_the_first_measured_visit(
    cfg, monkeypatch, tmp_path
):
    FakePair.events = []
    monkeypatch.setattr(cpu_pd, "PDPair", FakePair)
    monkeypatch.setattr(pd, "arm_of", lambda arm: {})
    monkeypatch.setattr(pd, "client_argvs", lambda cfg, pair, workdir, name: [[name]] * 2)
    want = cfg["num_groups"] * cfg["prompts_per_group"] * cfg["output_len"]

    def run_client(pair, argvs, workdir, name):
        FakePair.events.append(f"client {name}")
        return [{"total_output_tokens": want, "output_throughput": 100.0,
                 "median_itl_ms": 30.0}] * len(argvs)  # fmt: skip

    monkeypatch.setattr(pd, "run_client", run_client)
    order = [("plugin", 0.0, None), ("plugin", 3.2, None)]
    visits = pd.run_round(cfg, order, 0, tmp_path, quiet=True)
    assert FakePair.events == [
        "start", "client pd-warmup-r0", "client pd-plugin-0ms-r0",
        "restart pd-plugin-3.2ms-r0", "client pd-plugin-3.2ms-r0", "stop",
    ]  # fmt: skip
    assert [v["arm"] for v in visits] == ["plugin", "plugin"]
    # One record per measured visit; the warm-up leaves none.
    assert [v["latency_ms"] for v in visits] == [0.0, 3.2]


def test_the_wait_per_step_is_the_ranks_sum_over_their_steps():
    pair = FakePair(None, None, TP, 0)
    pair.decode = FakeDecode(metrics_text([0.010, 0.030], [10, 30], True))
    ranks, wait_ms, steps = pd.decode_metrics(pair)
    assert (ranks, steps) == (TP, 40)
    assert wait_ms == pytest.approx(1.0)  # 40 ms over 40 steps


def test_stock_has_no_wait_figure_and_the_table_says_so():
    pair = FakePair(None, None, TP, 0)
    pair.decode = FakeDecode("")
    assert pd.decode_metrics(pair) == (0, 0.0, 0)
    base = {"round": 0, "startup_s": 1.0, "output_throughput": 1.0, "median_itl_ms": 1.0}
    table = pd.arm_table([base | {"arm": "stock", "latency_ms": 0.0, "offload_steps": 0},
                          base | {"arm": "plugin", "latency_ms": 0.0, "offload_steps": 5,
                                  "offload_wait_ms": 0.25}])  # fmt: skip
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert set(rows) == {"stock", "plugin"}
    assert "0.250" in rows["plugin"] and "0.250" not in rows["stock"]
    assert rows["stock"].split()[-2] == "-"  # the wait column, before start-up
