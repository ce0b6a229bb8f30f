"""cpu-server's pieces without starting a server: the stand-ins' arithmetic, skew,
the command line and environment it builds, and the bundled tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hicache_async_ack_lab import cpu_server
from hicache_async_ack_lab.cpu_server import model, standins
from hicache_async_ack_lab.cpu_server.settings import (
    BREAK_MODES,
    CPU_BREAK_COPIES_VAR,
    CPU_REDUCE_LATENCY_VAR,
    CPU_SKEW_VAR,
    parse_cpu_break_copies,
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


def test_broken_copies_are_wrong_in_the_way_they_say():
    # The negative control's stand-ins: noop writes nothing, swap writes the right rows
    # into the wrong buffers (K into V); the real one is right (above).
    src = [torch.arange(20.0).reshape(10, 2) + 100 * i for i in range(2)]
    idx_src, idx_dst = torch.tensor([7, 3]), torch.tensor([0, 5])
    dst = [torch.zeros(6, 2) for _ in range(2)]
    standins.transfer_kv_noop(src, dst, idx_src, idx_dst, 1)
    assert all(d.count_nonzero() == 0 for d in dst)
    standins.transfer_kv_swapped(src, dst, idx_src, idx_dst, 1)
    assert dst[1][0].tolist() == src[0][7].tolist() and dst[0][5].tolist() == src[1][3].tolist()
    # one per accepted value, but "transfer": it breaks the PD KV transfer instead
    # (cpu_server/pd_standins.py), and leaves these host copies right
    assert set(standins.TRANSFERS) == {"", *BREAK_MODES} - {"transfer"}
    assert "transfer" in BREAK_MODES


@pytest.mark.parametrize("raw, mode", [("", ""), (None, ""), ("noop", "noop"), ("swap", "swap")])
def test_break_copies_parses(raw, mode):
    assert parse_cpu_break_copies(raw) == mode


@pytest.mark.parametrize("raw", ["1", "NOOP", "none"])
def test_bad_break_copies_names_the_accepted_values(raw):
    with pytest.raises(ValueError, match="expected one of noop, swap, transfer"):
        parse_cpu_break_copies(raw)


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
    assert CPU_BREAK_COPIES_VAR not in env  # real copies unless asked
    assert cpu_server.environment([], base={}, break_copies="noop")[CPU_BREAK_COPIES_VAR] == "noop"
    with pytest.raises(ValueError):
        cpu_server.environment([], base={}, skew="oops")
    with pytest.raises(ValueError, match="noop, swap"):
        cpu_server.environment([], base={}, break_copies="broken")


def test_seeded_weights_by_default_and_dummy_on_request():
    def load_format(cmd):
        return cmd[cmd.index("--load-format") + 1]

    assert load_format(cpu_server.command([], model.default_dir())) == "safetensors"
    assert load_format(cpu_server.command([], model.default_dir(), weights="dummy")) == "dummy"
    with pytest.raises(ValueError, match="expected one of seeded, dummy"):
        cpu_server.command([], model.default_dir(), weights="random")


def test_callers_arguments_come_after_the_defaults(tmp_path):
    cmd = cpu_server.command(["--attention-backend", "triton", "--tp", "2"], model.default_dir())
    i = cmd.index("sglang.launch_server")
    rest = cmd[i + 1 :]
    # argparse keeps the last value: the caller's backend wins over the default.
    assert rest.index("torch_native") < rest.index("triton")


def test_cli_prints_the_command_and_lists_the_stand_ins():
    proc = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack_lab", "cpu-server", "--tp", "2",
         "--cpu-skew", "0,3", "--cpu-print-command"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for name in standins.STANDINS:
        assert name in proc.stderr
    assert "sglang.launch_server" in proc.stderr and "--tp 2" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack_lab", "cpu-server", "--cpu-skew", "x"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "e.g. '0,3'" in bad.stderr
    weights = subprocess.run(
        [sys.executable, "-m", "hicache_async_ack_lab", "cpu-server", "--cpu-weights", "random"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert weights.returncode == 2 and "'seeded', 'dummy'" in weights.stderr


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


def test_tiny_model_weights_are_seeded_and_load_as_a_llama(tmp_path):
    # The same tensors on every build; every name the architecture expects, no other
    # (transformers reports both); logits that depend on the whole prompt.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = model.ensure_model(tmp_path / "m")
    stored = load_file(str(path / model.WEIGHTS_FILE))
    again = model.weights()
    assert stored.keys() == again.keys() and len(stored) > 0
    assert all(torch.equal(stored[k], again[k]) for k in stored)
    assert abs(float(stored["model.embed_tokens.weight"].std()) - 1.0) < 0.05
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 64**-0.5) < 0.01
    llama, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    other = ids.clone()
    other[0, 0] = 11  # only the first token differs
    with torch.no_grad():
        a, b = (torch.log_softmax(llama(x).logits[0, -1], -1) for x in (ids, other))
    assert float((a - b).abs().max()) > 1e-3  # the last token alone does not decide
    assert float(a.max()) > -5.0  # not flat: dummy weights give -ln(512) = -6.24 everywhere


def test_a_directory_without_the_weights_is_refused_not_replaced(tmp_path):
    old = tmp_path / "m"
    old.mkdir()
    (old / "config.json").write_text("{}")  # what a v1 build left: no weights
    with pytest.raises(RuntimeError, match="no complete tiny model"):
        model.ensure_model(old)
    assert (old / "config.json").read_text() == "{}"


def test_a_port_taken_before_the_server_binds_it_is_replaced_not_waited_on(tmp_path, monkeypatch):
    # The first launch logs uvicorn's bind error and runs on without HTTP (as SGLang's
    # main process does); the second serves /health on whatever port start picked.
    launches: list[int] = []
    serve = (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )

    def launch(self):
        launches.append(self.port)
        if len(launches) == 1:
            self.log_path.write_text(f"ERROR: [Errno 98] {cpu_server.PORT_IN_USE_MARK} x\n")
            code = ["-c", "import time; time.sleep(120)"]
        else:
            self.log_path.write_text("")  # each launch starts its log afresh, as _launch does
            code = ["-c", serve, str(self.port)]
        self.proc = subprocess.Popen([sys.executable, *code], start_new_session=True)

    monkeypatch.setattr(cpu_server.Server, "_launch", launch)
    server = cpu_server.Server([], log_path=tmp_path / "s.log", start_timeout_s=60)
    try:
        server.start()
        assert len(launches) == 2 and launches[0] != launches[1] == server.port
        assert server.args[-1] == str(server.port) and server.get("/health") == b"ok"
    finally:
        server.stop()
    # Negative control: a server that never answers and names no port error is waited
    # on to its timeout and reported, not relaunched.
    launches.clear()
    monkeypatch.setattr(
        cpu_server.Server,
        "_launch",
        lambda self: setattr(self, "proc", subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)),
    )  # fmt: skip
    quiet = cpu_server.Server([], log_path=tmp_path / "q.log", start_timeout_s=3)
    with pytest.raises(cpu_server.ServerFailed, match="not ready in 3 s"):
        quiet.start()
    assert quiet.proc is not None and quiet.proc.poll() is not None  # stopped, also on failure
