"""cpu-server's pieces without starting a server: the stand-ins' arithmetic, skew,
the command line and environment it builds, and the bundled tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hicache_async_ack.tools import cpu_server
from hicache_async_ack.tools.cpu_server import model, standins
from hicache_async_ack.tools.cpu_server.settings import (
    CPU_REDUCE_LATENCY_VAR,
    CPU_SKEW_VAR,
    parse_cpu_reduce_latency_ms,
    parse_cpu_skew,
)


def test_assign_req_to_token_pool_fills_each_request_span_in_order():
    req_to_token = torch.zeros((4, 8), dtype=torch.int32)
    out_cache_loc = torch.tensor([10, 11, 12, 20, 21], dtype=torch.int64)
    standins.assign_req_to_token_pool(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 5]), torch.tensor([4, 7]),
        out_cache_loc, 8,
    )  # fmt: skip
    assert req_to_token[2, 1:4].tolist() == [10, 11, 12]
    assert req_to_token[0, 5:7].tolist() == [20, 21]
    assert int(req_to_token.count_nonzero()) == 5  # nothing else written


def test_transfer_kv_direct_copies_the_indexed_rows_of_every_layer():
    src = [torch.arange(20.0).reshape(10, 2) + 100 * i for i in range(2)]
    dst = [torch.zeros(6, 2) for _ in range(2)]
    standins.transfer_kv_direct(src, dst, torch.tensor([7, 3]), torch.tensor([0, 5]), 1)
    for i in range(2):
        assert dst[i][0].tolist() == src[i][7].tolist()
        assert dst[i][5].tolist() == src[i][3].tolist()
        assert dst[i][1:5].count_nonzero() == 0


class _Event:
    def __init__(self):
        self.synced = False

    def query(self):
        return True

    def synchronize(self):
        self.synced = True


def test_skewed_event_reports_done_after_its_polls_and_on_a_blocking_wait():
    ev = standins.SkewedEvent(_Event(), 2)
    assert [ev.query(), ev.query(), ev.query()] == [False, False, True]
    blocked = standins.SkewedEvent(_Event(), 5)
    blocked.synchronize()
    assert blocked.query() and blocked.synced


@pytest.mark.parametrize("raw, polls", [("", ()), (None, ()), ("0,3", (0, 3)), ("4", (4,))])
def test_skew_parses(raw, polls):
    assert parse_cpu_skew(raw) == polls


@pytest.mark.parametrize("raw", ["x", "1,-2", "1,,2"])
def test_bad_skew_names_the_accepted_form(raw):
    with pytest.raises(ValueError, match="comma-separated non-negative poll counts"):
        parse_cpu_skew(raw)


@pytest.mark.parametrize("raw", ["-1", "inf", "fast"])
def test_bad_latency_names_the_accepted_form(raw):
    with pytest.raises(ValueError, match="milliseconds >= 0"):
        parse_cpu_reduce_latency_ms(raw)


@pytest.mark.parametrize(
    "args, ranks",
    [
        (["--tp", "2"], 2),
        (["--tp", "2", "--tp", "4"], 4),  # the last value wins, as in argparse
        (["--tp-size=4", "--pp-size", "2"], 8),
        (["--tp", "2", "--nnodes", "2", "--node-rank", "1"], 1),
        ([], 1),
    ],
)
def test_one_omp_binding_per_local_rank(args, ranks):
    assert cpu_server.local_ranks(args) == ranks
    env = cpu_server.environment(args, base={})
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == ranks


def test_environment_puts_the_stand_ins_first_and_keeps_the_callers_path():
    env = cpu_server.environment(["--tp", "2"], base={"PYTHONPATH": "/x"}, skew="0,1",
                                 latency_ms=3.2)  # fmt: skip
    assert env["PYTHONPATH"].split(":") == [str(cpu_server.BOOT_DIR), "/x"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env[CPU_SKEW_VAR] == "0,1" and env[CPU_REDUCE_LATENCY_VAR] == "3.2"
    with pytest.raises(ValueError):
        cpu_server.environment([], base={}, skew="oops")


def test_callers_arguments_come_after_the_defaults(tmp_path):
    cmd = cpu_server.command(["--attention-backend", "triton", "--tp", "2"], model.default_dir())
    i = cmd.index("sglang.launch_server")
    rest = cmd[i + 1 :]
    # argparse keeps the last value: the caller's backend wins over the default.
    assert rest.index("torch_native") < rest.index("triton")


def test_cli_prints_the_command_and_lists_the_stand_ins():
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack", "cpu-server", "--tp", "2",
         "--cpu-skew", "0,3", "--cpu-print-command"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in standins.STANDINS:
        assert name in proc.stderr
    assert "sglang.launch_server" in proc.stderr and "--tp 2" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack", "cpu-server", "--cpu-skew", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "e.g. '0,3'" in bad.stderr


def test_other_commands_still_refuse_unknown_arguments():
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack", "doctor", "--no-such-flag"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "--no-such-flag" in proc.stderr


def test_tiny_model_has_a_real_tokenizer_that_round_trips(tmp_path):
    from transformers import AutoTokenizer

    path = model.ensure_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == model.VOCAB_SIZE and config["num_hidden_layers"] == 2
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == model.VOCAB_SIZE
    text = "def parse(args): return the value"
    ids = tok(text)["input_ids"]
    assert len(ids) < len(text)  # merges were learned
    assert tok.decode(ids) == text
    assert model.ensure_model(path) == path  # built once
