"""Every environment variable the plugin reads, in one place, typed.

Parsed on each call (no import-time caching) so tests and operators can flip them
between server launches; the adapter reads them once per cache at HiCache init.

One rule for every value, SGLang's own (``sglang.srt.environ``): a boolean is
accepted as EnvBool accepts it (``value.lower()`` is one of the spellings below, as
set: no stripping, so ``""`` or ``" 0"`` is not a boolean), an integer as EnvInt
(``int(value)``); unset means the default. Where SGLang warns and falls back to the
default, the plugin refuses to start (HiCache init raises, naming the variable and
what it accepts): a node that silently ran another setting than its peers would
stop the group later, less clearly. With the plugin off (ENABLE_VAR false) no other
variable is read, so nothing else can stop the server.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

# The spellings SGLang's own EnvBool (sglang.srt.environ) accepts, case-insensitive.
TRUE_SPELLINGS = ("true", "1", "yes", "y")
FALSE_SPELLINGS = ("false", "0", "no", "n")

# SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC: pipeline the per-step ack-count all_reduce.
# Default on; "0" (or any false spelling) keeps SGLang's blocking path everywhere.
ENABLE_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_ACK_SYNC"
ENABLE_DEFAULT = True

# SGLANG_HICACHE_ASYNC_ACK_DEPTH: how many reduces may be in flight (lag depth k).
# Each step waits on the one issued k steps ago; acks are popped k steps late.
# "auto" starts at 1 and lets the ranks move it together, from 1 to DEPTH_MAX, to the
# smallest depth that hides the reduce's latency (docs/design.md, "Auto depth").
DEPTH_VAR = "SGLANG_HICACHE_ASYNC_ACK_DEPTH"
DEPTH_DEFAULT = 1
DEPTH_MAX = 8  # beyond this the added lag outweighs any latency a host could hide
DEPTH_AUTO = "auto"

# SGLANG_HICACHE_ASYNC_ACK_ALLOW_UNTESTED: run on an SGLang whose hooked methods differ
# from every tested release (the plugin otherwise stays inert there and says which
# method changed). For operators who read that warning and accept the risk. Default off.
ALLOW_UNTESTED_VAR = "SGLANG_HICACHE_ASYNC_ACK_ALLOW_UNTESTED"
ALLOW_UNTESTED_DEFAULT = False

# SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES: with a storage backend, decide the
# deadlines the waiting-queue walk reaches with a section riding the pass's one reduce
# instead of one blocking MAX all_reduce per waiting request, and make every prefetch
# decision of the pass where that section is read back (stock's outcome, depth + 1
# passes late). Default on; a false spelling keeps SGLang's per-request reduce.
# Only read while the plugin is on (ENABLE_VAR); set it identically on every node.
PREFETCH_VOTES_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_PREFETCH_VOTES"
PREFETCH_VOTES_DEFAULT = True

# SGLANG_ENABLE_HICACHE_ASYNC_DECODE_OFFLOAD_SYNC: with PD decode KV offload
# (--disaggregation-decode-enable-offload-kvcache), pipeline the per-step MIN
# all_reduce of DecodeKVCacheOffloadManager.check_offload_progress (offloads and
# backups popped one step late). Default on; a false spelling keeps SGLang's
# blocking reduce. Only read while the plugin is on; set it identically everywhere.
OFFLOAD_SYNC_VAR = "SGLANG_ENABLE_HICACHE_ASYNC_DECODE_OFFLOAD_SYNC"
OFFLOAD_SYNC_DEFAULT = True

# SGLANG_PLUGINS: SGLang's own comma-separated whitelist of general plugins. Read
# here only to report (doctor) whether our entry point would be skipped.
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


def read_settings(environ: Optional[Environ] = None) -> Settings:
    """Read and validate the plugin's settings; raises ValueError on bad input.
    With the plugin off the depth is not read (the one rule above)."""
    env = os.environ if environ is None else environ
    if not parse_bool(ENABLE_VAR, env.get(ENABLE_VAR), ENABLE_DEFAULT):
        return Settings(enabled=False, depth=DEPTH_DEFAULT)
    depth = parse_depth(DEPTH_VAR, env.get(DEPTH_VAR), DEPTH_DEFAULT)
    return Settings(
        enabled=True,
        depth=1 if depth == DEPTH_AUTO else int(depth),
        auto=depth == DEPTH_AUTO,
    )


def allow_untested(environ: Optional[Environ] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(ALLOW_UNTESTED_VAR, env.get(ALLOW_UNTESTED_VAR), ALLOW_UNTESTED_DEFAULT)


def prefetch_votes_enabled(environ: Optional[Environ] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(PREFETCH_VOTES_VAR, env.get(PREFETCH_VOTES_VAR), PREFETCH_VOTES_DEFAULT)


def offload_sync_enabled(environ: Optional[Environ] = None) -> bool:
    env = os.environ if environ is None else environ
    return parse_bool(OFFLOAD_SYNC_VAR, env.get(OFFLOAD_SYNC_VAR), OFFLOAD_SYNC_DEFAULT)


def plugin_whitelisted(environ: Optional[Environ] = None) -> bool:
    """Whether SGLANG_PLUGINS (if set) lets SGLang's loader pick our entry point."""
    env = os.environ if environ is None else environ
    raw = env.get(PLUGINS_VAR, "")
    allowed = {x.strip() for x in raw.split(",") if x.strip()}
    return not allowed or ENTRY_POINT_NAME in allowed
