"""doctor's view of a launch: the ``launch_server`` arguments read by SGLang's own parser
(``ServerArgs``), small read-only stand-ins for what SGLang builds from them (the
UnifiedRadixCache, PD decode's offload manager), and the plugin's own decision code run
on those stand-ins: the syncs' states, built in an :class:`Environment` whose group
sizes come from the launch and whose collectives never run. No sync's rule is restated
here; what is SGLang's (which objects a launch builds, their groups) is read from its
arguments, as SGLang documents them."""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator, NoReturn, Optional, Sequence, cast

from ..features.ack_counts import AckCountsState
from ..features.decode_offload import OffloadSyncState
from ..features.prefetch_votes import PrefetchVoteState
from ..guard import Judged
from ..kit.collectives import Collectives
from ..kit.decision import Decision, blocking
from ..kit.environment import Environment, use_environment
from ..kit.feature import FeatureState
from ..kit.views import Cache
from ..names import (
    ACK,
    ACK_QUEUES,
    BEST_EFFORT,
    BY_NAME,
    OFFLOAD,
    OFFLOAD_QUEUES,
    TIMEOUT,
    VOTES,
    SyncName,
)


class LaunchRejected(ValueError):
    """SGLang's own parser (or ServerArgs) refuses the launch arguments."""


class LaunchParser(argparse.ArgumentParser):
    """SGLang's launch parser, but ``--model-path`` optional (doctor loads no model) and
    its errors raised instead of exiting."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        if "--model-path" in args:
            kwargs.pop("required", None)
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise LaunchRejected(message)

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        raise LaunchRejected(message or f"the parser exited ({status})")


@dataclass(frozen=True)
class Launch:
    """What the plugin's decisions depend on in a launch, as SGLang reads it."""

    tp_size: int = 1
    pp_size: int = 1
    attn_cp_size: int = 1
    attn_tp_size: int = 1
    attn_dp: bool = False  # attention DP: the cache's group is one DP rank's attn TP group
    hierarchical: bool = False  # --enable-hierarchical-cache
    host_memory_mode: str = "cache"
    storage_backend: Optional[str] = None
    prefetch_policy: str = TIMEOUT
    linker: Optional[str] = None  # --enable-unified-cache-external-linker: its backend
    other_cache: Optional[str] = None  # a flag that makes SGLang build another cache class
    radix_backend: Optional[str] = None  # --radix-cache-backend (a registered factory)
    decode_offload: bool = False  # PD decode with --disaggregation-decode-enable-offload-kvcache
    argv: tuple[str, ...] = field(default=(), compare=False)

    @property
    def cache_world_size(self) -> int:
        """The cache's TP group (SGLang's DP-TP group): one attention-DP rank's attn TP
        group under attention DP, else the whole TP group."""
        return self.attn_tp_size if self.attn_dp else self.tp_size

    def describe(self) -> str:
        parts = [f"TP {self.tp_size}"]
        if self.attn_dp or self.attn_cp_size > 1:
            dp = "attention DP, " if self.attn_dp else ""
            parts.append(f"{dp}attn CP {self.attn_cp_size} x attn TP {self.attn_tp_size}")
        parts.append(f"PP {self.pp_size}")
        if self.hierarchical:
            storage = self.storage_backend or "none"
            parts.append(f"HiCache (host memory {self.host_memory_mode}, storage {storage}, "
                         f"prefetch policy {self.prefetch_policy})")  # fmt: skip
        else:
            parts.append("no HiCache")
        if self.linker:
            parts.append(f"external linker {self.linker}")
        if self.other_cache:
            parts.append(self.other_cache)
        if self.decode_offload:
            parts.append("PD decode KV offload")
        return ", ".join(parts)


# Without launch arguments each sync is judged on a launch it serves ("allowed").
REFERENCE: dict[SyncName, Launch] = {
    ACK: Launch(tp_size=2, attn_tp_size=2, hierarchical=True),
    VOTES: Launch(tp_size=2, attn_tp_size=2, hierarchical=True, storage_backend="file"),
    OFFLOAD: Launch(tp_size=2, attn_tp_size=2, decode_offload=True),
}
REFERENCE_TEXT = {
    ACK: "--tp 2 --enable-hierarchical-cache",
    VOTES: "--tp 2 --enable-hierarchical-cache --hicache-storage-backend file",
    OFFLOAD: "--tp 2 --disaggregation-mode decode --disaggregation-decode-enable-offload-kvcache",
}


def parse_launch(argv: Sequence[str]) -> Launch:
    """``argv`` read as ``launch_server`` reads it (its parser, ``--config`` merged, then
    ``ServerArgs.from_cli_args``). Resolution (``resolve_once``) is not run: it needs the
    model (its config, maybe a download) and the GPU platform, and a combination only it
    refuses is not caught here."""
    from sglang.srt.server_args import ServerArgs

    parser = LaunchParser(prog="launch_server", add_help=False)
    ServerArgs.add_cli_args(parser)
    args = list(argv)
    try:
        if "--config" in args:
            from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

            args = ConfigArgumentMerger(parser).merge_config_with_args(args)
        server_args = ServerArgs.from_cli_args(parser.parse_args(args))
    except LaunchRejected:
        raise
    except Exception as exc:  # noqa: BLE001 (a config file, a type ServerArgs refuses)
        raise LaunchRejected(f"{type(exc).__name__}: {exc}") from exc
    cfg, attn_tp, attn_dp = parallel_layout(server_args)

    def read(name: str, default: Any = None) -> Any:
        return getattr(cfg, name, default)

    hierarchical = bool(read("enable_hierarchical_cache", False))
    other = None
    if read("radix_cache_backend") is None and not read("disable_radix_cache", False):
        if read("enable_lmcache", False):
            other = "--enable-lmcache (LMCacheUnifiedRadixCache)"
        elif read("enable_flexkv", False) and not read("enable_unified_cache_external_linker"):
            other = "--enable-flexkv (FlexKV's radix cache)"
    linker = read("enable_unified_cache_external_linker", False)
    return Launch(
        tp_size=int(read("tp_size", 1)),
        pp_size=int(read("pp_size", 1)),
        attn_cp_size=int(read("attn_cp_size", 1)),
        attn_tp_size=attn_tp,
        attn_dp=attn_dp,
        hierarchical=hierarchical,
        host_memory_mode=str(read("hicache_host_memory_mode", "cache")),
        storage_backend=read("hicache_storage_backend") if hierarchical else None,
        prefetch_policy=str(read("hicache_storage_prefetch_policy", TIMEOUT)),
        linker=str(read("unified_cache_external_linker_backend") or "default") if linker else None,
        other_cache=other,
        radix_backend=read("radix_cache_backend"),
        decode_offload=read("disaggregation_mode") == "decode"
        and bool(read("disaggregation_decode_enable_offload_kvcache", False)),
        argv=tuple(argv),
    )


def parallel_layout(server_args: Any) -> tuple[Any, int, bool]:
    """(the record as resolution would read it, attn TP size, attention DP on), from
    SGLang's own derivations: its handler for the deprecated ``--dp-size N
    --enable-dp-attention``, ``attn_tp_size_of``, ``attn_dp_enabled_of``."""
    try:
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.arg_groups.parallel_hook import handle_deprecated_dp_attention
        from sglang.srt.runtime_context import attn_dp_enabled_of, attn_tp_size_of
    except ImportError:  # an SGLang before its arg groups: the widths as its flags define them
        cfg = server_args
        attn_dp = bool(getattr(cfg, "enable_dp_attention", False)) and cfg.dp_size > 1
        cp = int(getattr(cfg, "attn_cp_size", 1))
        return cfg, cfg.tp_size // (cfg.dp_size if attn_dp else 1) // cp, attn_dp
    handle_deprecated_dp_attention(server_args)
    cfg = resolving_view(server_args)
    return cfg, int(attn_tp_size_of(cfg)), bool(attn_dp_enabled_of(cfg))


# ------------------------------------------------------------ the stand-ins
@dataclass(frozen=True)
class Group:
    """A process group as a launch defines it: its name and world size."""

    name: str
    size: int


def group_size(group: Any) -> int:
    return group.size if isinstance(group, Group) else 1


def no_collective(*args: Any) -> NoReturn:
    raise AssertionError("doctor runs no collective")


# Only the group sizes are real: a decision is a query, never a collective.
COLLECTIVES = Collectives(
    async_min=lambda group: no_collective,
    blocking_min=lambda cache: no_collective,
    int32_min=no_collective,
    world_size=group_size,
    rank=lambda group: 0,
    span=no_collective,
)


@dataclass(frozen=True)
class CacheView:
    """A UnifiedRadixCache after ``init_hicache`` as the launch builds it (read only)."""

    cache_controller: Any
    linker: Any
    host_memory_mode: str
    pp_size: int
    tp_group: Group
    tp_world_size: int
    attn_cp_group: Group
    attn_tp_group: Group
    enable_storage: bool
    prefetch_stop_policy: str
    tree_core: Any = None
    pp_rank: int = 0
    ongoing_prefetch: dict = field(default_factory=dict)

    def _prefetch_deadline_expired(self, operation: Any) -> bool:
        raise AssertionError("doctor runs no walk")  # present, as on SGLang's cache


def controller() -> SimpleNamespace:
    return SimpleNamespace(**{q: [] for q in (*ACK_QUEUES, *OFFLOAD_QUEUES)})


def cache_view(launch: Launch) -> CacheView:
    # without --enable-hierarchical-cache init_hicache never runs: no controller, upstream's
    # default policy; with a linker the linker's wrapper is attached instead
    return CacheView(
        cache_controller=controller() if launch.hierarchical else None,
        linker=SimpleNamespace(backend=launch.linker) if launch.linker else None,
        host_memory_mode=launch.host_memory_mode if launch.hierarchical else "cache",
        pp_size=launch.pp_size,
        tp_group=Group("TP", launch.cache_world_size),
        tp_world_size=launch.cache_world_size,
        attn_cp_group=Group("attn CP", launch.attn_cp_size),
        attn_tp_group=Group("attn TP", launch.attn_tp_size),
        enable_storage=launch.hierarchical and launch.storage_backend is not None,
        prefetch_stop_policy=launch.prefetch_policy if launch.hierarchical else BEST_EFFORT,
        tree_core=SimpleNamespace(write_back_duplicate_reclaim_digest=0),
    )


def manager_view(launch: Launch) -> SimpleNamespace:
    """PD decode's DecodeKVCacheOffloadManager: its controller and the DP-TP group."""
    size = launch.cache_world_size
    return SimpleNamespace(cache_controller=controller(), tp_group=Group("TP", size),
                           tp_world_size=size)  # fmt: skip


# ------------------------------------------------------------ the decisions
@dataclass(frozen=True)
class SyncVerdict:
    """One sync on one launch: its decision (None: the launch builds nothing it runs
    on), whether it would pipeline, the log line it would print, launch notes."""

    sync: SyncName
    decision: Optional[Decision]
    live: bool
    line: str = ""
    note: str = ""


def judge(launch: Launch, judged: Judged) -> dict[SyncName, SyncVerdict]:
    """Every sync's decision on ``launch``: register()'s verdict first (a sync the guard
    keeps off is never built), then the sync's own state on the stand-ins."""
    env = Environment(collectives=COLLECTIVES, judged=judged, metrics=lambda *a: None)
    with installed(env):
        view = cast(Cache, cache_view(launch))
        ack = AckCountsState(view, None, env)
        votes = PrefetchVoteState(view, None, env)
        ack.add_rider(votes)  # as Feature.build joins a rider to its carrier
        manager = manager_view(launch)
        offload = OffloadSyncState(manager, None, env)
        # the votes once the group agreed on their carrier (the first passes)
        votes_path = votes.launch_decision(view, ack.pipelines(view))
        out = {
            ACK: verdict(ACK, ack, ack.decide(view), launch, judged),
            VOTES: verdict(VOTES, votes, votes_path, launch, judged),
            OFFLOAD: verdict(OFFLOAD, offload, offload.decide(manager), launch, judged),
        }
    if not launch.decode_offload:
        out[OFFLOAD] = SyncVerdict(OFFLOAD, None, False, note="this launch runs no PD decode KV "
                                   "offload (a decode node with --disaggregation-decode-"
                                   "enable-offload-kvcache)")  # fmt: skip
    return out


def verdict(sync: SyncName, state: FeatureState, decision: Decision, launch: Launch,
            judged: Judged) -> SyncVerdict:  # fmt: skip
    off = guard_decision(sync, judged)
    if off is not None:  # register() registers no hook: nothing logged, path info "off"
        return SyncVerdict(sync, off, False)
    if sync != OFFLOAD and launch.other_cache:
        why = (f"{launch.other_cache}: SGLang builds a cache whose own check_hicache_events "
               "the plugin does not hook")  # fmt: skip
        return SyncVerdict(sync, blocking(why, "hooks_missing"), False)
    notes = []
    if decision.span is not None:
        notes.append("the TP group must span attn CP x attn TP: checked over the group at "
                     "the first step (under DP attention it does not)")  # fmt: skip
    if sync != OFFLOAD and not launch.hierarchical and not launch.linker:
        notes.append("without --enable-hierarchical-cache SGLang never calls "
                     "check_hicache_events: no ack-count reduce to pipeline")  # fmt: skip
    if sync != OFFLOAD and launch.radix_backend:
        notes.append(f"--radix-cache-backend {launch.radix_backend}: judged as a "
                     "UnifiedRadixCache; a cache that overrides check_hicache_events runs "
                     "none of this")  # fmt: skip
    line = state.path_line(decision)
    return SyncVerdict(sync, decision, decision.pipelined, line, "; ".join(notes))


def guard_decision(sync: SyncName, judged: Judged) -> Optional[Decision]:
    """Why register() hooks nothing of ``sync`` (its reason code as the path info series
    shows it), or None where it does."""
    code = judged.stand_down(sync)
    if code is None:
        return None
    if judged.verdict is None:
        return blocking("the version guard could not judge this SGLang", "untested_release")
    summary = judged.verdict.feature(sync).summary(judged.verdict)
    return blocking(summary, "not_in_release" if code == "not_in_release" else "untested_release")


@contextmanager
def installed(env: Environment) -> Iterator[None]:
    """``env`` in force (feature_release reads its verdict), the previous one after."""
    old = use_environment(env)
    try:
        yield
    finally:
        use_environment(old)


def judge_reference(judged: Judged) -> dict[SyncName, SyncVerdict]:
    """Without launch arguments: each sync on a launch it serves (REFERENCE)."""
    return {sync: judge(REFERENCE[sync], judged)[sync] for sync in BY_NAME}


__all__ = ["REFERENCE", "REFERENCE_TEXT", "Launch", "LaunchRejected", "SyncVerdict",
    "guard_decision", "judge", "judge_reference", "parse_launch"]  # fmt: skip
