"""The adapter kit every sync (feature) is built on.

What the three features share, so each states only what is its own: the path
decision and its bounded reason code, the groups upstream reduces over, queue
views, the collectives (one :class:`Collectives`, passed to each state when it
is built; tests and the bench install theirs with :func:`use_collectives`), the
first exchange in upstream's own shape and groups, the one path announcement,
hook marking and a common state base. Speaks SGLang's vocabulary; torch is
imported only inside the functions that need it.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Optional

from . import path_info
from .stamp import DEPTH_LIMIT

logger = logging.getLogger("sglang.srt.mem_cache.hicache_async_ack")

# The sync names (the `sync` label of the path info series, the log lines' subject).
SYNCS = ("ack_counts", "prefetch_votes", "decode_offload")
SYNC_TITLES = {
    "ack_counts": "HiCache ack sync",
    "prefetch_votes": "HiCache prefetch votes",
    "decode_offload": "HiCache decode offload sync",
}

# Every reason code a decision can carry: bounded and stable (a label value), snake_case.
REASON_CODES = (
    "pipelined",
    "disabled_by_env",  # SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC=0
    "feature_disabled_by_env",  # the feature's own setting is off
    "excluded_by_sglang_plugins",  # SGLANG_PLUGINS leaves the plugin out (doctor)
    "untested_release",  # the guard matched no tested release for this feature
    "in_tree",  # this SGLang carries the in-tree form
    "missing_attrs",  # this SGLang's objects lack what the feature reads
    "hooks_missing",  # a hooked method is not our hook (subclass override)
    "world_size_1",
    "no_span",  # attention CP x TP with no existing group spanning both
    "attn_cp_tp",  # the feature does not pipeline attention CP x TP
    "no_controller",
    "linker",  # an external cache linker is attached
    "host_memory_mode",
    "pp",
    "no_storage",
    "policy_not_timeout",
    "agreeing",  # the group has not yet agreed on the setting
    "draining",  # inside drain_before_retraction
)


@dataclass(frozen=True)
class Decision:
    """A path decision: pipelined or not, why (for operators) and ``code`` (one
    of :data:`REASON_CODES`, for machines)."""

    pipelined: bool
    reason: str
    code: str = "pipelined"
    group: Any = None
    world_size: int = 1
    # attention CP x TP: the (CP, attn TP) groups whose union the first step
    # checks against ``group`` (spanning_group), after the first exchange
    span: Optional[tuple[Any, Any]] = None

    def __post_init__(self):
        assert self.code in REASON_CODES, self.code


def blocking(reason: str, code: str) -> Decision:
    return Decision(False, reason, code)


# ------------------------------------------------------------------ groups
def world_size(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group=group)


def collective_groups(cache) -> list[tuple[str, Any, int]]:
    """The groups upstream's _all_reduce_attn_groups reduces over, in order."""
    groups = [
        (label, g, world_size(g))
        for label, g in (("attn CP", cache.attn_cp_group), ("attn TP", cache.attn_tp_group))
        if g is not None and world_size(g) > 1
    ]
    if not groups and cache.tp_world_size > 1:
        groups = [("TP", cache.tp_group, cache.tp_world_size)]
    return groups


def no_span_reason(names: str) -> str:
    return (
        f"{names}: two collectives per step and no existing group spans exactly "
        "their ranks (DP attention?)"
    )


def missing_attrs(obj, names) -> Optional[Decision]:
    missing = [a for a in names if not hasattr(obj, a)]
    if missing:
        return blocking(f"this SGLang's cache lacks {', '.join(missing)}", "missing_attrs")
    return None


def group_decision(cache) -> Decision:
    """The groups one reduce can stand for, for the cache's lifetime: one group
    of world size > 1, or attention CP x TP through the TP group (its span is
    checked at the first step, after the first exchange)."""
    groups = collective_groups(cache)
    if not groups:
        return blocking(
            "world size 1: upstream runs no collective, nothing to hide", "world_size_1"
        )
    if len(groups) > 1:
        names = " x ".join(f"{label}({ws})" for label, _, ws in groups)
        (_, cp, cp_ws), (_, attn_tp, attn_tp_ws) = groups
        if cache.tp_group is None or cp_ws * attn_tp_ws != cache.tp_world_size:
            return blocking(no_span_reason(names), "no_span")
        # Whether the union of the two is exactly the TP group needs every
        # member's groups: gathered at the first step, after the first exchange
        # (a gather here would hang a rank without the plugin, which runs none).
        return Decision(
            True,
            f"TP group, equal to {names}",
            group=cache.tp_group,
            world_size=cache.tp_world_size,
            span=(cp, attn_tp),
        )
    label, group, ws = groups[0]
    return Decision(True, f"one {label} group", group=group, world_size=ws)


def spanning_group(cache, cp_group, attn_tp_group):
    """The existing group over which one MIN equals upstream's MIN over the CP
    group followed by the MIN over the attn TP group, or None.

    After the two reduces rank r holds the MIN over the union of CP(t) for t in
    TP(r). One reduce over group G gives the same iff that union is G for every
    r in G. The candidate is the cache's TP group (it contains both); the check
    needs every member's CP and TP ranks, so it gathers them over that group
    once, in the first pipelined step right after the first exchange (which ran
    on the CP and attn TP groups, as upstream's reduce does, and showed that
    every rank it reached pipelines with the same settings); every member
    reaches the same verdict from the same data. No group is created."""
    import torch.distributed as dist

    tp = cache.tp_group
    if tp is None or cache.tp_world_size <= 1:
        return None
    mine = (
        dist.get_rank(),
        sorted(dist.get_process_group_ranks(cp_group)),
        sorted(dist.get_process_group_ranks(attn_tp_group)),
    )
    gathered: list = [None] * cache.tp_world_size
    dist.all_gather_object(gathered, mine, group=tp)
    members = set(dist.get_process_group_ranks(tp))
    cp_of = {rank: set(cp) for rank, cp, _ in gathered}
    for _, _, tp_ranks in gathered:
        if not set(tp_ranks) <= cp_of.keys():
            return None
        if set().union(*(cp_of[t] for t in tp_ranks)) != members:
            return None
    return tp


# ------------------------------------------------------------------- queue views
def queue_by_name(cc, name: Hashable):
    """A controller queue by name; ``("extra", pool)`` is an extra host pool's."""
    if isinstance(name, tuple):  # ("extra", pool_name)
        return getattr(cc, "extra_host_mem_release_queues", {}).get(name[1])
    return getattr(cc, str(name), None)


def queue_head(q, n: int) -> list:
    """The first ``n`` entries of a list or a ``queue.Queue`` (under its mutex)."""
    if q is None:
        return []
    if isinstance(q, list):
        return q[:n]
    with q.mutex:  # queue.Queue filled by storage threads
        return list(itertools.islice(q.queue, n))


def head_reader(owner) -> Callable[[Hashable, int], list]:
    """``head(name, n)``: the first n entries of a queue of ``owner``'s
    controller (whichever controller it holds when called)."""

    def head(name: Hashable, n: int) -> list:
        cc = owner.cache_controller
        return [] if cc is None else queue_head(queue_by_name(cc, name), n)

    return head


# ------------------------------------------------------------------ collectives
class TorchHandle:
    __slots__ = ("work", "tensor")

    def __init__(self, work, tensor):
        self.work = work
        self.tensor = tensor

    def wait(self) -> list[int]:
        self.work.wait()
        return self.tensor.tolist()

    def is_completed(self) -> bool:
        return self.work.is_completed()


def torch_min_all_reduce(group) -> Callable[[list[int]], Any]:
    """An async MIN all_reduce over ``group``, through the public
    ``torch.distributed.all_reduce(..., async_op=True)`` as upstream's blocking
    one goes: whatever wraps or patches it (tracing, fault injection, tests)
    sees our collective too (calling the ProcessGroup directly saves ~0.04 ms a
    step, docs/bench.md: not worth a collective tracing cannot see). Tensors
    are preallocated and reused round-robin, DEPTH_LIMIT + 1 per layout, so one
    is never refilled while a reduce on it can be in flight."""
    import torch
    import torch.distributed as dist

    op = dist.ReduceOp.MIN
    rings: dict[int, Any] = {}  # layout length -> cycle of (tensor, numpy view)

    def issue(values: list[int]) -> TorchHandle:
        ring = rings.get(len(values))
        if ring is None:
            tensors = [torch.zeros(len(values), dtype=torch.int64) for _ in range(DEPTH_LIMIT + 1)]
            ring = rings[len(values)] = itertools.cycle([(t, t.numpy()) for t in tensors])
        tensor, view = next(ring)
        view[:] = values
        return TorchHandle(dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor)

    return issue


def torch_int32_min(group, values: list[int]) -> list[int]:
    """A blocking MIN all_reduce of an int32 tensor over one group: the decode
    offload sync's upstream layout and dtype."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


def upstream_count_slots(cache) -> int:
    """How many counts precede ``[digest, -digest]`` in upstream's ack-count
    reduce: the two ack queues, with storage the four control queues plus one
    per extra host pool (a first exchange must match its length)."""
    if not cache.enable_storage:
        return 2
    cc = cache.cache_controller
    return 6 + len(getattr(cc, "extra_host_mem_release_queues", None) or {})


def upstream_reduce(cache) -> Callable[[list[int]], list[int]]:
    """A blocking MIN-reduce through the cache's own ``_all_reduce``: upstream's
    shape on upstream's groups (attn CP then attn TP, as its ready-count sync)."""
    import torch

    def reduce(values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        cache._all_reduce(tensor, torch.distributed.ReduceOp.MIN)
        return [int(v) for v in tensor.tolist()]

    return reduce


@dataclass(frozen=True)
class Collectives:
    """The collectives the features run, handed to each state when it is built.

    ``async_min(group)``: values -> handle, an async MIN all_reduce (int64);
    ``blocking_min(cache)``: values -> reduced, upstream's own ``_all_reduce``
    on the cache (the first exchange); ``int32_min(group, values)``: a blocking
    int32 MIN (the decode offload agreement, in upstream's layout)."""

    async_min: Callable[[Any], Callable[[list[int]], Any]] = torch_min_all_reduce
    blocking_min: Callable[[Any], Callable[[list[int]], list[int]]] = upstream_reduce
    int32_min: Callable[[Any, list[int]], list[int]] = torch_int32_min


@dataclass
class Installed:
    current: Collectives = field(default_factory=Collectives)


INSTALLED = Installed()  # public: tests install theirs (monkeypatch) through it


def collectives() -> Collectives:
    """The collectives states built now are handed."""
    return INSTALLED.current


def use_collectives(new: Collectives) -> Collectives:
    """Install the collectives states built from now on are handed (tests, the
    bench, cpu-server's latency model); returns the previous ones."""
    old, INSTALLED.current = INSTALLED.current, new
    return old


def use_async_min(wrap: Callable[[Callable], Callable]) -> Collectives:
    """Install ``wrap(current async_min factory)`` as the async MIN factory
    (a latency model, another group); returns the previous collectives."""
    from dataclasses import replace

    current = collectives()
    return use_collectives(replace(current, async_min=wrap(current.async_min)))


# ------------------------------------------------------------------ hooks
HOOK_MARK = "_hicache_async_ack_hook"  # set on our hook functions, found via __wrapped__


def hook(fn):
    """Mark ``fn`` as one of our hooks (:func:`is_hooked` finds it)."""
    setattr(fn, HOOK_MARK, True)
    return fn


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def is_hooked(fn) -> bool:
    """Whether one of our hooks sits in ``fn``'s wrapper chain. HookRegistry's
    wrappers keep the hook in a closure cell and the original in __wrapped__."""
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if getattr(fn, HOOK_MARK, False) or any(
            getattr(_cell_value(c), HOOK_MARK, False) for c in cells
        ):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def unhooked(cls, names) -> Optional[str]:
    """Why ``cls`` does not run our hooks on ``names``, or None."""
    for name in names:
        fn = getattr(cls, name, None)
        if fn is None or not is_hooked(fn):
            return (
                f"{cls.__name__}.{name} is not our hook (overridden by a subclass, or "
                "the hook failed to apply)"
            )
    return None


@dataclass(frozen=True)
class Hook:
    """One hook: ``target`` (a class path), the method, the HookType name."""

    target: str
    method: str
    kind: str  # "BEFORE", "AFTER" or "AROUND"
    fn: Callable


@dataclass(frozen=True)
class Feature:
    """A sync: its name (one of :data:`SYNCS`), its hooks in the order they
    must be registered (HookRegistry wraps in registration order: the first
    registered on a method is the innermost) and why that order."""

    sync: str
    hooks: tuple[Hook, ...]
    order: str


# ------------------------------------------------------------------ state and path
def state_of(obj, attr: str):
    return obj.__dict__.get(attr)


def keep_state(obj, attr: str, state):
    obj.__dict__[attr] = state
    return state


class FeatureState:
    """What every feature keeps per object: its lifetime decision (``static``),
    a metrics sink (None costs nothing) and what it last announced."""

    feature = ""  # its sync name, one of SYNCS

    def __init__(self, static: Decision, coll: Optional[Collectives] = None):
        self.static = static
        self.collectives = collectives() if coll is None else coll
        self.metrics: Any = None
        self.announced: Optional[tuple] = None

    def path_metrics(self, decision: Decision) -> None:
        """Export a change of path (the feature's ``pipelined`` gauge)."""
        self.metrics.on_path(decision.pipelined)

    def path_line(self, decision: Decision) -> str:
        title = SYNC_TITLES[self.feature]
        if decision.pipelined:
            ws = decision.world_size
            return f"{title}: pipelined over the {decision.reason} (world size {ws})"
        return f"{title}: blocking (upstream path) because {decision.reason}"


def announce_path(state: FeatureState, decision: Decision, line: Optional[str] = None) -> None:
    """THE announcement of a sync's path, for all three: one line per rank, and
    one more on each change of path (decision and reason code), with the
    feature's ``pipelined`` metrics updated alike. Called every step: compares
    before it formats."""
    key = (decision.pipelined, decision.code, decision.reason)
    if key == state.announced:
        return
    state.announced = key
    if state.metrics is not None:
        state.path_metrics(decision)
        labels = getattr(state.metrics, "labels", None)
        if isinstance(labels, Mapping):  # the "why" series; never raises
            path = path_info.path_of(decision.pipelined)
            path_info.publish(state.feature, path, decision.code, labels)
    logger.info("%s", state.path_line(decision) if line is None else line)
