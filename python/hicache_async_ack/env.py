"""Every environment variable the plugin reads, in one place, typed, parsed on each call.

Values follow SGLang's own rule (``sglang.srt.environ``): booleans as EnvBool
(``value.lower()`` one of the spellings, no stripping), integers as EnvInt; unset is the
default. Where SGLang warns and falls back, the plugin refuses to start (HiCache init
raises, naming the variable): a node silently running other settings would stop the
group later. With the plugin off no other variable is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

# The spellings SGLang's EnvBool accepts, case-insensitive.
TRUE_SPELLINGS = ("true", "1", "yes", "y")
FALSE_SPELLINGS = ("false", "0", "no", "n")

# Pipeline the per-step ack-count all_reduce; false keeps SGLang's blocking path everywhere.
ENABLE_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC"
ENABLE_DEFAULT = True

# Reduces in flight (lag depth k: acks popped k steps late); "auto": the ranks move it
# together from 1 to DEPTH_MAX, to the smallest that hides the latency (docs/design.md).
DEPTH_VAR = "SGLANG_HICACHE_ASYNC_ACK_DEPTH"
DEPTH_DEFAULT = 1
DEPTH_MAX = 8  # beyond this the added lag outweighs any latency a host could hide
DEPTH_AUTO = "auto"

# Run where the hooked methods differ from every tested release (else inert, saying which).
ALLOW_UNTESTED_VAR = "SGLANG_HICACHE_ASYNC_ACK_ALLOW_UNTESTED"
ALLOW_UNTESTED_DEFAULT = False

# With storage, decide prefetch deadlines with a section riding the pass's one reduce
# instead of one blocking MAX per waiting request. Set identically on every node.
PREFETCH_VOTES_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES"
PREFETCH_VOTES_DEFAULT = True

# With the votes on, a request whose L3 remainder a prefetch in flight at its anchor covers
# waits for that read to land, then matches the host and reads only the rest. Off by
# default: it changes what is read (never more than stock), not only when.
READ_ONCE_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_READ_ONCE"
READ_ONCE_DEFAULT = False

# With PD decode KV offload, pipeline check_offload_progress's per-step MIN all_reduce.
OFFLOAD_SYNC_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_DECODE_OFFLOAD_SYNC"
OFFLOAD_SYNC_DEFAULT = True

# SGLang's plugin whitelist: read only for doctor's report.
PLUGINS_VAR = "SGLANG_PLUGINS"
ENTRY_POINT_NAME = "hicache_async_ack"

Environ = Mapping[str, str]


@dataclass(frozen=True)
class Settings:
    enabled: bool
    depth: int  # the fixed lag depth, or where auto starts
    auto: bool = False  # the ranks move the depth together (SGLANG_..._DEPTH=auto)


def parse_bool(name: str, raw: Optional[str], default: bool) -> bool:
    """As SGLang's EnvBool: unset is the default; set, ``raw.lower()`` must be a spelling."""
    if raw is None:
        return default
    value = raw.lower()
    if value in TRUE_SPELLINGS:
        return True
    if value in FALSE_SPELLINGS:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; accepted values (case-insensitive): "
        f"{', '.join(TRUE_SPELLINGS)} to enable, {', '.join(FALSE_SPELLINGS)} to disable"
    )


def parse_depth(name: str, raw: Optional[str], default: int) -> Union[int, str]:
    """An integer lag depth as SGLang's EnvInt reads one (``int(raw)``), or "auto"."""
    if raw is None:
        return default
    if raw.lower() == DEPTH_AUTO:
        return DEPTH_AUTO
    try:
        depth = int(raw)
    except ValueError:
        depth = 0
    if not 1 <= depth <= DEPTH_MAX:
        raise ValueError(
            f"{name}={raw!r} is not a valid lag depth; accepted values: an integer "
            f"from 1 to {DEPTH_MAX} (1 = pop acks one step late, the default), or "
            f"{DEPTH_AUTO!r} (the ranks pick the smallest depth that hides the latency)"
        )
    return depth


@dataclass(frozen=True)
class Switch:
    """A boolean setting: its variable, its default and what each value means (doctor's
    row; a sync's row names the one that turns it off)."""

    var: str
    default: bool
    on: str
    off: str

    def read(self, environ: Optional[Environ] = None) -> bool:
        return _flag(self.var, self.default, environ)


ENABLE = Switch(ENABLE_VAR, ENABLE_DEFAULT, "the ack sync may pipeline",
                "SGLang's path everywhere")  # fmt: skip
ALLOW_UNTESTED = Switch(
    ALLOW_UNTESTED_VAR, ALLOW_UNTESTED_DEFAULT,
    "a sync whose methods match no tested release runs anyway",
    "a sync whose methods match no tested release keeps SGLang's path",
)  # fmt: skip
PREFETCH_VOTES = Switch(
    PREFETCH_VOTES_VAR, PREFETCH_VOTES_DEFAULT,
    "with a storage backend, prefetch deadlines ride the ack-count reduce",
    "SGLang's storage path (a blocking reduce per waiting prefetch; the ack counts keep "
    "SGLang's path while a backend is attached)",
)  # fmt: skip
READ_ONCE = Switch(
    READ_ONCE_VAR, READ_ONCE_DEFAULT,
    "with the votes, a request waits for a prefetch in flight at its anchor and reads only "
    "the rest", "each request reads its whole L3 remainder, as stock",
)  # fmt: skip
OFFLOAD_SYNC = Switch(
    OFFLOAD_SYNC_VAR, OFFLOAD_SYNC_DEFAULT, "PD decode offload progress pipelined",
    "SGLang's blocking reduce",
)  # fmt: skip
SWITCHES = (ENABLE, ALLOW_UNTESTED, PREFETCH_VOTES, READ_ONCE, OFFLOAD_SYNC)


def read_settings(environ: Optional[Environ] = None) -> Settings:
    """The plugin's settings, validated (ValueError); off, the depth is not read."""
    env = os.environ if environ is None else environ
    if not parse_bool(ENABLE_VAR, env.get(ENABLE_VAR), ENABLE_DEFAULT):
        return Settings(enabled=False, depth=DEPTH_DEFAULT)
    depth = parse_depth(DEPTH_VAR, env.get(DEPTH_VAR), DEPTH_DEFAULT)
    return Settings(
        enabled=True,
        depth=1 if depth == DEPTH_AUTO else int(depth),
        auto=depth == DEPTH_AUTO,
    )


def _flag(var: str, default: bool, environ: Optional[Environ]) -> bool:
    return parse_bool(var, (os.environ if environ is None else environ).get(var), default)


def allow_untested(environ: Optional[Environ] = None) -> bool:
    return ALLOW_UNTESTED.read(environ)


def prefetch_votes_enabled(environ: Optional[Environ] = None) -> bool:
    return PREFETCH_VOTES.read(environ)


def read_once_enabled(environ: Optional[Environ] = None) -> bool:
    return READ_ONCE.read(environ)


def offload_sync_enabled(environ: Optional[Environ] = None) -> bool:
    return OFFLOAD_SYNC.read(environ)


def plugin_whitelisted(environ: Optional[Environ] = None) -> bool:
    """Whether SGLANG_PLUGINS (if set) lets SGLang's loader pick our entry point."""
    env = os.environ if environ is None else environ
    raw = env.get(PLUGINS_VAR, "")
    allowed = {x.strip() for x in raw.split(",") if x.strip()}
    return not allowed or ENTRY_POINT_NAME in allowed


__all__ = ["ALLOW_UNTESTED", "ALLOW_UNTESTED_DEFAULT", "ALLOW_UNTESTED_VAR", "DEPTH_AUTO",
    "DEPTH_DEFAULT", "DEPTH_MAX", "DEPTH_VAR", "ENABLE", "ENABLE_DEFAULT", "ENABLE_VAR",
    "ENTRY_POINT_NAME", "FALSE_SPELLINGS", "OFFLOAD_SYNC", "OFFLOAD_SYNC_DEFAULT",
    "OFFLOAD_SYNC_VAR", "PLUGINS_VAR", "PREFETCH_VOTES", "PREFETCH_VOTES_DEFAULT",
    "PREFETCH_VOTES_VAR", "READ_ONCE", "READ_ONCE_DEFAULT", "READ_ONCE_VAR", "SWITCHES",
    "Settings", "Switch", "TRUE_SPELLINGS", "allow_untested", "offload_sync_enabled",
    "parse_bool", "parse_depth", "plugin_whitelisted", "prefetch_votes_enabled",
    "read_once_enabled", "read_settings"]  # fmt: skip
