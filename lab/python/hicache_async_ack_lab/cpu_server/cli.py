"""``hicache-async-ack-lab cpu-server``: SGLang's real launch_server on a CPU-only host.

Every argument it does not know goes to ``python -m sglang.launch_server``,
after its CPU defaults, so yours win. For tests, demos and the bench, never
production: the CPU stand-ins it loads replace GPU kernels with plain copies.
"""

from __future__ import annotations

import argparse
import os
import sys

from hicache_async_ack_lab.cpu_server import (
    WEIGHTS,
    bound,
    command,
    describe_standins,
    environment,
    pd_cli,
)
from hicache_async_ack_lab.cpu_server.model import default_dir
from hicache_async_ack_lab.cpu_server.settings import (
    BREAK_MODES,
    CPU_BREAK_COPIES_VAR,
    parse_cpu_break_copies,
    parse_cpu_reduce_latency_ms,
    parse_cpu_skew,
)

SUMMARY = "run SGLang's real launch_server on this CPU-only host (tests, demos, bench)"
DESCRIPTION = (
    "Start `python -m sglang.launch_server` with a bundled tiny model (2-layer Llama, "
    "real BPE tokenizer, seeded weights) and CPU stand-ins for the GPU-only pieces on the "
    "HiCache path. Every argument not listed here is passed to launch_server after the "
    "CPU defaults (so it wins). Example: hicache-async-ack-lab cpu-server --tp 2 "
    "--enable-hierarchical-cache --host 127.0.0.1 --port 30000"
)


def _skew(raw: str) -> str:
    try:
        parse_cpu_skew(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return raw


def _latency(raw: str) -> float:
    try:
        return parse_cpu_reduce_latency_ms(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _break(raw: str) -> str:
    try:
        return parse_cpu_break_copies(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("cpu-server", help=SUMMARY, description=DESCRIPTION, allow_abbrev=False)
    p.add_argument(
        "--cpu-skew",
        metavar="POLLS",
        type=_skew,
        help="make acks finish at different times on different ranks: comma-separated "
        "polls per rank before a finish event reports done, e.g. 0,3",
    )
    p.add_argument(
        "--cpu-reduce-latency-ms",
        metavar="MS",
        type=_latency,
        default=0.0,
        help="model a host with slow gloo: HiCache's blocking all_reduce sleeps MS first, "
        "the plugin's async reduces complete MS after issue (the seed's host: 3.2)",
    )
    p.add_argument(
        "--cpu-weights",
        choices=tuple(WEIGHTS),
        default="seeded",
        help="seeded (default): the model's seeded weights (model.safetensors), replies "
        "that depend on the whole prompt and so on the KV a cache restores; dummy: "
        "SGLang's --load-format dummy, every logit ~0 (replies ignore the cache)",
    )
    p.add_argument(
        "--cpu-bound",
        action="store_true",
        help="measurement device: every HiCache collective answers with the rank's own "
        "value (the zero-sync bound; needs the plugin off, refused with skew or latency)",
    )
    p.add_argument(
        "--cpu-local-reduce",
        action="store_true",
        help="measurement device: the plugin pipelines as usual but its async reduces "
        "answer with the rank's own value (the step-late pop without the collective; "
        "needs the plugin on, refused with skew or latency)",
    )
    # Hidden: the negative control of the e2e correctness checks, never a user's mode.
    p.add_argument(
        "--cpu-break-copies", metavar="|".join(BREAK_MODES), type=_break, help=argparse.SUPPRESS
    )
    p.add_argument(
        "--cpu-model-dir",
        metavar="DIR",
        help=f"where the tiny model is built once (default {default_dir()})",
    )
    p.add_argument(
        "--cpu-print-command",
        action="store_true",
        help="print the command and environment instead of starting the server",
    )
    pd_cli.add_arguments(p)
    p.set_defaults(func=run, passthrough=True)
    return p


def run(args) -> int:
    from pathlib import Path

    if args.pd:
        print("hicache-async-ack-lab cpu-server --pd: CPU stand-ins (test support, never "
              "production):\n" + describe_standins(), file=sys.stderr)  # fmt: skip
        return pd_cli.run(args, pd_cli.main_say)
    rest = list(args.rest)
    model_dir = Path(args.cpu_model_dir) if args.cpu_model_dir else None
    cmd = command(rest, model_dir, weights=args.cpu_weights)
    env = environment(
        cmd,
        skew=args.cpu_skew,
        latency_ms=args.cpu_reduce_latency_ms,
        break_copies=args.cpu_break_copies,
    )
    if args.cpu_bound:
        env[bound.CPU_BOUND_VAR] = "1"
    if args.cpu_local_reduce:
        env[bound.CPU_LOCAL_REDUCE_VAR] = "1"
    try:
        bound.check(env)
        bound.check_local(env)
    except ValueError as exc:
        print(f"hicache-async-ack-lab cpu-server: {exc}", file=sys.stderr)
        return 2
    shown = {k: env[k] for k in sorted(set(env) - set(os.environ) | {"PYTHONPATH"}) if k in env}
    print("hicache-async-ack-lab cpu-server: CPU stand-ins (test support, never production):",
          file=sys.stderr)  # fmt: skip
    print(describe_standins(), file=sys.stderr)
    print(f"  - weights: {args.cpu_weights}", file=sys.stderr)
    if env.get(CPU_BREAK_COPIES_VAR):
        mode = env[CPU_BREAK_COPIES_VAR]
        print(f"  - KV copies BROKEN ON PURPOSE: {mode} (negative control: replies from "
              "host or storage are wrong)", file=sys.stderr)  # fmt: skip
    if args.cpu_skew:
        print(f"  - skew: acks report done after {args.cpu_skew} polls per rank", file=sys.stderr)
    if args.cpu_reduce_latency_ms:
        print(f"  - injected latency: {args.cpu_reduce_latency_ms:g} ms per HiCache all_reduce",
              file=sys.stderr)  # fmt: skip
    print("hicache-async-ack-lab cpu-server: " + " ".join(f"{k}={v}" for k, v in shown.items()),
          file=sys.stderr)  # fmt: skip
    print("hicache-async-ack-lab cpu-server: $ " + " ".join(cmd), file=sys.stderr, flush=True)
    if args.cpu_print_command:
        return 0
    os.execve(cmd[0], cmd, env)  # the server takes this process over (signals, exit code)
