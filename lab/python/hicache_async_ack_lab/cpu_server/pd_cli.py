"""``hicache-async-ack-lab cpu-server --pd``: a PD pair (pd.py) from a shell.

The arguments cpu-server does not know go to both servers, except ``--tp`` (the
decode's; the prefill runs TP 1) and ``--port`` (the router's, in the namespace);
``--pd-prefill-arg`` / ``--pd-decode-arg`` add one argument to one server. The pair
stays up until interrupted (or until one of its processes exits), then stops as one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from hicache_async_ack_lab.cpu_server import bound

# Taken out of the shared arguments: they mean one process each in PD mode.
OWN = ("--tp", "--tp-size", "--tensor-parallel-size", "--port", "--host")


def add_arguments(p) -> None:
    g = p.add_argument_group("PD disaggregation (--pd)")
    g.add_argument("--pd", action="store_true",
                   help="run a prefill server (TP 1) and a decode server (TP --tp, default "
                   "2, KV offload to a file store) with SGLang's PD router, KV over "
                   "Mooncake TCP, all in a private network namespace with only lo; "
                   "--port is the router's")  # fmt: skip
    g.add_argument("--pd-prefill-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the prefill server only (repeat)")  # fmt: skip
    g.add_argument("--pd-decode-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the decode server only (repeat)")  # fmt: skip
    g.add_argument(
        "--pd-no-offload",
        action="store_true",
        help="decode without --disaggregation-decode-enable-offload-kvcache",
    )
    g.add_argument("--pd-workdir", metavar="DIR",
                   help="logs and the offload store (default: a temp dir)")  # fmt: skip
    g.add_argument("--pd-info", metavar="FILE.json",
                   help="write the router's URL, the servers' ports and logs and the "
                   "namespace path here once the pair serves")  # fmt: skip


def split_shared(rest: list[str]) -> tuple[list[str], dict[str, str]]:
    """The arguments both servers get, and the per-process ones taken out."""
    shared: list[str] = []
    own: dict[str, str] = {}
    i = 0
    while i < len(rest):
        a = rest[i]
        name = a.split("=", 1)[0]
        if name in OWN:
            value = a.split("=", 1)[1] if "=" in a else (rest[i + 1] if i + 1 < len(rest) else "")
            own[name] = value
            i += 1 if "=" in a else 2
            continue
        shared.append(a)
        i += 1
    return shared, own


def _decode_tp(own: dict[str, str]) -> int:
    raw = next((own[k] for k in OWN[:3] if k in own), "2")
    try:
        tp = int(raw)
    except ValueError:
        tp = 0
    if tp < 1:
        raise ValueError(f"--tp {raw!r}: expected the decode server's TP size, an integer >= 1")
    return tp


def run(args, say) -> int:
    from hicache_async_ack_lab.cpu_server.pd import PDPair

    shared, own = split_shared(list(args.rest))
    if own.get("--host", "127.0.0.1") not in ("127.0.0.1", "localhost"):
        say(f"--host {own['--host']}: a PD pair serves on 127.0.0.1 in its namespace only")
        return 2
    try:
        tp = _decode_tp(own)
        port: Optional[int] = int(own["--port"]) if "--port" in own else None
    except ValueError as exc:
        say(str(exc))
        return 2
    if args.cpu_model_dir:
        shared = ["--model-path", _model(args.cpu_model_dir), *shared]
    decode_env = {}
    if args.cpu_bound:
        decode_env[bound.CPU_BOUND_VAR] = "1"
    if args.cpu_local_reduce:
        decode_env[bound.CPU_LOCAL_REDUCE_VAR] = "1"
    try:
        bound.check({**os.environ, **decode_env})
        bound.check_local({**os.environ, **decode_env})
    except ValueError as exc:
        say(str(exc))
        return 2
    pair = PDPair(
        shared, args.pd_prefill_arg, args.pd_decode_arg, decode_tp=tp,
        offload=not args.pd_no_offload,
        workdir=Path(args.pd_workdir) if args.pd_workdir else None, decode_env=decode_env,
        skew=args.cpu_skew, latency_ms=args.cpu_reduce_latency_ms,
        break_copies=args.cpu_break_copies, weights=args.cpu_weights, router_port=port,
    )  # fmt: skip
    stop = {"signal": 0}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    say(f"starting a PD pair (prefill TP 1, decode TP {tp}); logs and store in {pair.workdir}")
    try:
        pair.start()
    except Exception as exc:  # noqa: BLE001 - the pair is down; say why, exit non-zero
        say(f"the PD pair did not start: {exc}")
        return 1
    try:
        assert pair.ns is not None and pair.prefill is not None
        pair.ns.enter()  # this process's main thread: /proc/PID/ns/net names the namespace
        netns = f"/proc/{os.getpid()}/ns/net"
        say(f"router {pair.url} (prefill {pair.prefill.url}, bootstrap port "
            f"{pair.bootstrap_port}; decode {pair.decode.url}) up in {pair.startup_s:.0f} s "
            "in a private network namespace (only lo)")  # fmt: skip
        say(f"offload store {pair.store}")
        say(f"clients: nsenter --net={netns} curl -s {pair.url}/generate "
            "-H 'Content-Type: application/json' -d '{\"text\": \"alpha beta gamma\", "
            "\"sampling_params\": {\"max_new_tokens\": 8}}'")  # fmt: skip
        if args.pd_info:
            info = {"pid": os.getpid(), "netns": netns, "router": pair.url,
                    "prefill": pair.prefill.url, "bootstrap_port": pair.bootstrap_port,
                    "decode": pair.decode.url, "store": str(pair.store),
                    "logs": [str(s.log_path) for s in pair.servers()]
                    + [str(pair.router_log_path)]}  # fmt: skip
            Path(args.pd_info).write_text(json.dumps(info, indent=1) + "\n")
        while not stop["signal"]:
            gone = pair.exited()
            if gone:
                say(f"{', '.join(gone)} exited; stopping the pair (logs in {pair.workdir})")
                return 1
            time.sleep(0.5)
        return 0
    finally:
        pair.stop()


def _model(model_dir: str) -> str:
    from hicache_async_ack_lab.cpu_server.model import ensure_model

    return str(ensure_model(Path(model_dir)))


def main_say(msg: str) -> None:
    print(f"hicache-async-ack-lab cpu-server --pd: {msg}", file=sys.stderr, flush=True)
