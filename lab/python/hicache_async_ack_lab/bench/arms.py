"""The arms of ``bench-server`` and the run configuration, shared by its two modes
(``server.py``: the seed's arms; ``storage.py``: requests waiting on L3 prefetches):
what each arm's server is started with, what its /metrics must say it ran, and the
rounds' order."""

from __future__ import annotations

from hicache_async_ack.env import ENABLE_VAR
from hicache_async_ack_lab.bench import multiturn
from hicache_async_ack_lab.bench.server_report import configs
from hicache_async_ack_lab.cli_support import ToolError

ARMS = ("l1", "stock", "plugin", "bound", "local", "dedicated")
# local: the plugin with its reduces answered locally; dedicated: on a group of their own
PIPELINED_ARMS = ("plugin", "local", "dedicated")
DEFAULT_ARMS = ("stock", "plugin")
WORKLOADS = ("gsp", "multiturn", "pd")  # pd: a PD pair's decode offload (pd.py)
# multiturn's device pool: the longest history (system prompt, 6 questions, 5 replies:
# ~950 tokens with the bundled tokenizer) must fit one request's context, while 8
# lanes' histories (~7,500 tokens) still spill to host
MULTITURN_POOL = 2048


def arm_env(arm: str) -> dict[str, str]:
    from hicache_async_ack_lab.cpu_server.bound import (
        CPU_BOUND_VAR,
        CPU_DEDICATED_GROUP_VAR,
        CPU_LOCAL_REDUCE_VAR,
    )

    if arm == "plugin":
        return {ENABLE_VAR: "1"}
    if arm == "local":
        return {ENABLE_VAR: "1", CPU_LOCAL_REDUCE_VAR: "1"}
    if arm == "dedicated":
        return {ENABLE_VAR: "1", CPU_DEDICATED_GROUP_VAR: "1"}
    if arm == "bound":
        return {ENABLE_VAR: "0", CPU_BOUND_VAR: "1"}
    return {ENABLE_VAR: "0"}


def server_args(cfg: dict, arm: str) -> list[str]:
    args = [
        "--tp",
        str(cfg["tp"]),
        "--enable-metrics",
        "--max-total-tokens",
        str(cfg["max_total_tokens"]),
    ]
    if arm != "l1":
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(cfg["hicache_ratio"])]
    if cfg["workload"] == "multiturn":
        args += ["--chat-template", multiturn.CHAT_TEMPLATE]
    return [*args, *cfg["server_args"]]


def plugin_state(server) -> dict:
    """What the server's own /metrics says about the ack sync, summed over ranks."""
    from prometheus_client.parser import text_string_to_metric_families

    state = {"pipelined_ranks": 0.0, "popped_entries": 0.0, "wait_s": 0.0, "waits": 0.0}
    names = {
        "sglang:hicache_ack_sync_pipelined": "pipelined_ranks",
        "sglang:hicache_ack_sync_popped_entries_total": "popped_entries",
        "sglang:hicache_ack_sync_wait_seconds_sum": "wait_s",
        "sglang:hicache_ack_sync_wait_seconds_count": "waits",
    }
    for family in text_string_to_metric_families(server.get("/metrics").decode()):
        for s in family.samples:
            if s.name in names:
                state[names[s.name]] += s.value
    state["pipelined_ranks"] = int(state["pipelined_ranks"])
    return state


def check_arm(cfg: dict, arm: str, state: dict, server, name: str) -> None:
    """A run is reported under its arm only if the server really ran that arm."""
    expected = cfg["tp"] if arm in PIPELINED_ARMS else 0
    if state["pipelined_ranks"] != expected:
        raise ToolError(
            f"{name}: {state['pipelined_ranks']} ranks pipelined, expected "
            f"{expected}; see {server.log_path}"
        )
    from hicache_async_ack_lab.cpu_server.bound import MARKS

    log = server.log()
    for device, mark in MARKS.items():
        marks = log.count(mark)
        if (arm == device) != (marks > 0):
            raise ToolError(
                f"{name}: the {device} arm's device {'missing' if arm == device else 'on'}"
                f" ({marks} start-up marks of {mark!r}); see {server.log_path}"
            )


def rounds_of(cfg: dict) -> list[list[tuple]]:
    from hicache_async_ack_lab.bench.stats import round_order

    return round_order(configs(cfg), cfg["rounds"])


def config_of(args) -> dict:
    cfg = {
        k: getattr(args, k)
        for k in (
            "tp",
            "rounds",
            "runs",
            "workload",
            "num_groups",
            "prompts_per_group",
            "system_prompt_len",
            "question_len",
            "output_len",
            "request_rate",
            "max_concurrency",
            "turns",
            "system_words",
            "question_words",
            "max_total_tokens",
            "hicache_ratio",
            "seed",
            "start_timeout_s",
        )
    } | {
        "arms": list(args.arms),
        "latencies_ms": list(args.latency_ms),
        "lanes": list(args.lanes) if args.workload == "multiturn" else [None],
        "server_args": list(args.server_arg),
    }
    multiturn_run = args.workload == "multiturn" and not getattr(args, "storage", None)
    if cfg["max_total_tokens"] is None:
        cfg["max_total_tokens"] = MULTITURN_POOL if multiturn_run else 512
    if cfg["hicache_ratio"] is None:
        cfg["hicache_ratio"] = 16.0 if args.workload == "multiturn" else 4.0
    return cfg


def load_visits(spec: str) -> list[dict]:
    """``--from-visits A.jsonl[,B.jsonl...]``: earlier runs' visits, pooled. Each later
    file's rounds are numbered after the earlier ones', so rounds stay pairs within a
    run and are never paired across runs."""
    import json
    from pathlib import Path

    visits: list[dict] = []
    for path in [x for x in spec.split(",") if x]:
        if not Path(path).is_file():
            raise ToolError(f"--from-visits: {path} is not a file (a workdir's visits.jsonl)")
        offset = 1 + max((v["round"] for v in visits), default=-1)
        lines = Path(path).read_text().splitlines()
        visits += [v | {"round": v["round"] + offset} for v in map(json.loads, filter(None, lines))]
    return visits
