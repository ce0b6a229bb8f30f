"""What cpu-server's stand-in modules share: their post-import patches chained per
module, an SGLang method made to run a hook first, and the per-rank JSON files
their measurement devices write.

Imported with the stand-ins at interpreter start of every server process, so the
standard library only at import time: torch and the network check on first use.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, MutableMapping, Optional

# Runs on a module right after it executes (standins._PatchingFinder).
Patch = Callable[[Any], None]
Hook = Callable[..., None]


def chain(first: Optional[Patch], then: Patch) -> Patch:
    """``first``, then ``then``: several stand-ins patch one module."""
    if first is None:
        return then

    def both(module: Any) -> None:
        first(module)
        then(module)

    return both


def add_patches(patches: MutableMapping[str, Patch], own: Iterable[tuple[str, Patch]]) -> None:
    """Add ``own`` to cpu-server's post-import patches, each after those already there
    for its module (a module may come twice: both run, in order)."""
    for name, patch in own:
        patches[name] = chain(patches.get(name), patch)


def run_first(cls: type, name: str, hook: Hook) -> None:
    """``cls.name`` calls ``hook`` with its own arguments, then itself.

    wraps(): the plugin's version guard fingerprints SGLang's methods unwrapped, and
    a stand-in must not change what it sees."""
    real = getattr(cls, name)

    @functools.wraps(real)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook(self, *args, **kwargs)
        return real(self, *args, **kwargs)

    setattr(cls, name, hooked)


def replace(cls: type, name: str, fn: Callable[..., Any]) -> None:
    """``cls.name`` is ``fn``, wrapped as the method it replaces (for the plugin's guard)."""
    setattr(cls, name, functools.wraps(getattr(cls, name))(fn))


def sleep_first(latency: Callable[[], float]) -> Hook:
    """A hook that sleeps ``latency()`` seconds, read at every call (a latency file
    may change it while the server runs)."""

    def sleep(*args: Any, **kwargs: Any) -> None:
        seconds = latency()
        if seconds:
            time.sleep(seconds)

    return sleep


def require_loopback(where: str) -> Hook:
    """A hook that refuses outside a network namespace with only lo: Mooncake's
    transfer engine listens on every interface whatever it is told."""

    def check(*args: Any, **kwargs: Any) -> None:
        from hicache_async_ack_lab.cpu_server.netns import only_loopback

        if not only_loopback():
            raise RuntimeError(
                "cpu-server: Mooncake's transfer engine listens on every interface; run " + where
            )

    return check


# --- the measurement devices' files ---------------------------------------------------


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def write_rank_file(root: Path, stem: str, rank: int, values: dict) -> None:
    """``<stem>.<rank>.json``, replaced at once: a reader never sees half of it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{stem}.{rank}.json.{os.getpid()}"
    tmp.write_text(json.dumps(values))
    tmp.replace(root / f"{stem}.{rank}.json")


def read_rank_files(root: Path, stem: str) -> dict[str, dict]:
    """``{rank: values}`` from the ``<stem>.<rank>.json`` files in ``root``."""
    return {
        path.name.split(".")[1]: json.loads(path.read_text())
        for path in sorted(Path(root).glob(f"{stem}.*.json"))
    }
