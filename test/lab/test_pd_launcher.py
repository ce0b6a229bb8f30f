"""cpu-server's PD mode without starting a server: what each role is started with,
the stand-ins' pieces, bad input named (the end-to-end runs: test_pd*.py)."""

from __future__ import annotations

import argparse

import pytest

from hicache_async_ack_lab.cpu_server import PD_DEFAULTS, command, environment, pd_role
from hicache_async_ack_lab.cpu_server import cli as cpu_cli
from hicache_async_ack_lab.cpu_server.pd import OFFLOAD_ARGS, PDPair
from hicache_async_ack_lab.cpu_server.pd_cli import split_shared
from hicache_async_ack_lab.cpu_server.pd_standins import (
    STANDINS,
    DoneEvent,
    _Forward,
    read_offload_counts,
)
from hicache_async_ack_lab.cpu_server.settings import parse_cpu_break_copies
from hicache_async_ack_lab.cpu_server.standins import STANDINS as ALL_STANDINS


def test_a_pd_role_gets_mooncake_tcp_and_bounded_pools_before_the_callers_args():
    cmd = command(["--disaggregation-mode", "decode", "--max-total-tokens", "512"])
    i = cmd.index("--disaggregation-transfer-backend")
    assert cmd[i + 1] == "mooncake_tcp"
    # the caller's value comes later, so argparse keeps it
    assert cmd.index("--max-total-tokens") < len(cmd) - 2 and cmd[-1] == "512"
    assert pd_role(["--disaggregation-mode=prefill"]) == "prefill"
    assert pd_role(["--disaggregation-mode", "null"]) is None
    plain = command(["--tp", "2"])
    assert not set(PD_DEFAULTS[::2]) & set(plain)


def test_a_pd_role_gets_the_tcp_transport_on_loopback_unless_the_caller_set_it():
    env = environment(["--disaggregation-mode", "prefill"], base={})
    assert env["MOONCAKE_PROTOCOL"] == "tcp" and env["SGLANG_HOST_IP"] == "127.0.0.1"
    mine = environment(["--disaggregation-mode", "decode"], base={"MOONCAKE_PROTOCOL": "x"})
    assert mine["MOONCAKE_PROTOCOL"] == "x"
    assert "MOONCAKE_PROTOCOL" not in environment(["--tp", "2"], base={})


def test_the_shared_arguments_lose_what_is_one_process_each():
    shared, own = split_shared(["--tp", "4", "--enable-metrics", "--port=30000", "--host",
                                "127.0.0.1", "--max-total-tokens", "1024"])  # fmt: skip
    assert shared == ["--enable-metrics", "--max-total-tokens", "1024"]
    assert own == {"--tp": "4", "--port": "30000", "--host": "127.0.0.1"}


def test_the_decode_gets_the_offload_path_and_the_prefill_tp_1(tmp_path):
    pd = PDPair(["--enable-metrics"], ["--chunked-prefill-size", "256"], ["--x"],
                workdir=tmp_path)  # fmt: skip
    pd.ns = _FakeNs()  # type: ignore[assignment]
    pd.bootstrap_port = 4242
    prefill = pd._prefill()
    assert prefill.args[:1] == ["--enable-metrics"]
    assert "prefill" in prefill.args and prefill.args[prefill.args.index("--tp") + 1] == "1"
    assert "4242" in prefill.args and "--chunked-prefill-size" in prefill.args
    (decode,) = pd._decode_nodes()
    assert decode.args[decode.args.index("--tp") + 1] == "2"
    assert all(a in decode.args for a in OFFLOAD_ARGS) and "--x" in decode.args
    assert decode.env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == str(tmp_path / "store")
    two = PDPair(workdir=tmp_path, decode_nodes=[{}, {"A": "1"}])
    two.ns = _FakeNs()  # type: ignore[assignment]
    nodes = two._decode_nodes()
    assert [n.args[n.args.index("--node-rank") + 1] for n in nodes] == ["0", "1"]
    assert nodes[1].env["A"] == "1" and "A" not in nodes[0].env


class _FakeNs:
    def call(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


@pytest.mark.parametrize(
    "kw, word",
    [({"decode_tp": 0}, "decode_tp 0"), ({"decode_nodes": [{}, {}, {}]}, "3 node(s)")],
)
def test_bad_pd_shapes_are_named(kw, word):
    with pytest.raises(ValueError, match="expected") as exc:
        PDPair(**kw)
    assert word in str(exc.value)


def test_the_cli_refuses_a_host_other_than_loopback_and_a_bad_tp(capsys):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cpu_cli.add_parser(sub)
    for rest, word in ((["--host", "0.0.0.0"], "127.0.0.1"), (["--tp", "x"], "integer >= 1")):
        args, _ = parser.parse_known_args(["cpu-server", "--pd"])
        args.rest = rest
        said: list[str] = []
        assert _run(args, said) == 2
        assert word in said[-1], said


def _run(args, said: list[str]) -> int:
    from hicache_async_ack_lab.cpu_server import pd_cli

    return pd_cli.run(args, said.append)


def test_the_stand_ins_say_what_they_replace():
    assert set(STANDINS) <= set(ALL_STANDINS)
    ev = DoneEvent()
    ev.record(object())
    ev.synchronize()
    assert ev.query() is True
    fake = _Forward(argparse, cuda=_Forward(argparse, Event=DoneEvent))
    assert fake.cuda.Event is DoneEvent and fake.ArgumentParser is argparse.ArgumentParser


def test_the_transfer_break_mode_is_accepted_and_bad_ones_named(tmp_path):
    assert parse_cpu_break_copies("transfer") == "transfer"
    with pytest.raises(ValueError, match="noop, swap, transfer"):
        parse_cpu_break_copies("sideways")
    (tmp_path / "offload.0.json").write_text('{"offload": 3, "backup": 2}')
    assert read_offload_counts(tmp_path) == {"0": {"offload": 3, "backup": 2}}
