"""The seed-shaped workload: N concurrent lanes x M turns, replayed by SGLang's own client.

The seed measured 128 lanes x 16 turns of a chat: every turn's prompt is the whole
history plus a new question, so prefixes grow, spill from the device pool to the
host pool, and come back when the lane's next turn arrives. Here the driver is
SGLang's ``bench_serving`` with its ``agentic-trace`` dataset, which replays each
conversation round by round over the chat API, feeding the server's real replies
back into the history. The trace is ours, generated (``make_trace``: one
conversation per lane, a system prompt, then one user question per turn); the
server gets ChatML (``--chat-template chatml``) since the bundled tokenizer has no
template of its own. ``--cache-report`` gives the host hits per run.

``python -m hicache_async_ack_lab.bench.multiturn ARGV.json`` runs bench_serving
once per argv list in the file, in one interpreter: its import alone takes
20-30 s on 2 busy cores, which would otherwise be paid before every run.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from hicache_async_ack_lab.cli_support import ToolError

CHAT_TEMPLATE = "chatml"  # SGLang's built-in; the bundled tokenizer carries none


def _words() -> list[str]:
    # Words the bundled tokenizer was trained on (model.py's corpus): few tokens each.
    import inspect
    import textwrap

    return sorted(set(re.findall(r"[a-z]{3,}", inspect.getsource(textwrap))))


def make_trace(lanes: int, turns: int, system_words: int, question_words: int, seed: int) -> dict:
    """One conversation per lane in bench_serving's agentic-trace shape."""
    if lanes < 1 or turns < 1:
        raise ValueError("a trace needs at least one lane and one turn")
    words = _words()
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    conversations = []
    for _ in range(lanes):
        conv = []
        for t in range(turns):
            first = [{"role": "system", "content": text(system_words)}] if t == 0 else []
            conv.append({"messages": [*first, {"role": "user", "content": text(question_words)}]})
        conversations.append(conv)
    meta = {
        "generator": "hicache-async-ack-lab bench-server",
        "lanes": lanes,
        "turns": turns,
        "system_words": system_words,
        "question_words": question_words,
        "seed": seed,
    }
    return {"metadata": meta, "conversations": conversations}


def write_trace(path: Path, cfg: dict, lanes: int, seed: int) -> Path:
    trace = make_trace(lanes, cfg["turns"], cfg["system_words"], cfg["question_words"], seed)
    path.write_text(json.dumps(trace))
    return path


def serving_args(backend: str, port: int, model: Path) -> list[str]:
    """The start of every bench_serving argv: backend, the loopback server, the model."""
    return ["--backend", backend, "--host", "127.0.0.1", "--port", str(port),
            "--model", str(model), "--tokenizer", str(model)]  # fmt: skip


def bench_args(cfg: dict, port: int, model: Path, trace: Path, lanes: int, out: Path) -> list[str]:
    """bench_serving's argv (without the interpreter) for one multi-turn run."""
    return [
        *serving_args("sglang-oai-chat", port, model),
        "--dataset-name",
        "agentic-trace",
        "--dataset-path",
        str(trace),
        "--num-prompts",
        str(lanes),
        "--max-concurrency",
        str(lanes),
        "--sharegpt-output-len",
        str(cfg["output_len"]),
        "--request-rate",
        "inf",
        "--cache-report",
        "--flush-cache",
        "--disable-tqdm",
        "--output-file",
        str(out),
    ]


def host_share(result: dict) -> float | None:
    """Host hits as a share of all prompt tokens (bench_serving's --cache-report)."""
    rep = result.get("cache_report") or {}
    total, host = rep.get("total_prompt_tokens"), rep.get("host_cached_tokens")
    return host / total if total and host is not None else None


def run_client(
    argvs: list[list[str]], workdir: Path, name: str, timeout_s: float
) -> tuple[list[dict], list[dict]]:
    """bench_serving once per argv, in one interpreter; its results and load averages."""
    spec, loads = workdir / f"client-{name}.json", workdir / f"load-{name}.json"
    spec.write_text(json.dumps(argvs))
    module = ["hicache_async_ack_lab.bench.multiturn", str(spec), str(loads)]
    return run_bench_client(module, argvs, workdir, name, timeout_s), json.loads(loads.read_text())


def run_bench_client(
    module: list[str],
    argvs: list[list[str]],
    workdir: Path,
    name: str,
    timeout_s: float,
    spawn: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> list[dict]:
    """THE client runner: ``python -m module...`` (it runs bench_serving once per
    argv) in a session of its own, through ``spawn`` (a PD pair's namespace);
    killed with its group on a timeout, Ctrl-C or SIGTERM; the runs' results."""
    log = workdir / f"bench-{name}.log"
    cmd = [sys.executable, "-m", *module]
    with open(log, "ab") as f:
        proc = spawn(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout_s * len(argvs))
        except BaseException:  # a timeout, Ctrl-C or SIGTERM: the client goes too
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = -9
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
    outs = [Path(a[a.index("--output-file") + 1]) for a in argvs]
    if rc != 0 or not all(o.exists() for o in outs):
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise ToolError(f"bench_serving failed (exit {rc}); its log {log}:\n" + "\n".join(tail))
    return [json.loads(o.read_text().strip().splitlines()[-1]) for o in outs]


def main(argv: list[str]) -> int:
    """Run bench_serving once per argv list in ``argv[0]`` (a JSON file); the load
    average before and after each run goes to ``argv[1]``."""
    runs = json.loads(Path(argv[0]).read_text())
    from sglang.benchmark.serving import cli_main

    loads = []
    for i, run_argv in enumerate(runs):
        sys.argv = ["bench_serving", *run_argv]
        print(f"=== hicache-async-ack: bench_serving run {i + 1}/{len(runs)}", flush=True)
        port = int(run_argv[run_argv.index("--port") + 1])
        start, before, t0 = os.getloadavg(), ack_wait(port), time.monotonic()
        cli_main()
        after, wall = ack_wait(port), time.monotonic() - t0
        loads.append(
            {
                "loadavg_start": start,
                "loadavg_end": os.getloadavg(),
                "client_wall_s": wall,
                # over this run (flush, warm-up and replay), summed over ranks
                "ack_wait_s": after[0] - before[0],
                "ack_waits": after[1] - before[1],
            }
        )
        Path(argv[1]).write_text(json.dumps(loads))
    return 0


def ack_wait(port: int) -> tuple[float, float]:
    """The plugin's wait on due reduces so far (seconds, steps), summed over ranks;
    zeros where the server has no such metric (stock, l1, the bound)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    total, count = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sglang:hicache_ack_sync_wait_seconds_sum":
                total += s.value
            elif s.name == "sglang:hicache_ack_sync_wait_seconds_count":
                count += s.value
    return total, count


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
