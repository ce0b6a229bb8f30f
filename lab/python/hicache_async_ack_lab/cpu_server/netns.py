"""A private network namespace with only ``lo``, for the processes that must not listen
on the host's interfaces (Mooncake's transfer engine binds every interface whatever it
is told). The same system calls as ``unshare -n`` / ``nsenter --net``, each on a
short-lived thread, so the calling process itself stays in the host's namespace."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH22x"  # struct ifreq: name, flags, the rest of the union

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)} (a private network namespace needs root)")


def _bring_up_loopback() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
        flags = struct.unpack(_IFREQ, got)[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def interfaces() -> list[str]:
    """Network interfaces of the calling thread's namespace."""
    lines = Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


def only_loopback() -> bool:
    return interfaces() == ["lo"]


class NetNamespace:
    """A new network namespace with only ``lo`` (up), held by a descriptor."""

    def __init__(self) -> None:
        self._fd: Optional[int] = None
        self._fd = _on_thread(self._create)

    @staticmethod
    def _create() -> int:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        _bring_up_loopback()
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("the network namespace is closed")
        return self._fd

    @property
    def path(self) -> str:
        """For ``nsenter --net=PATH`` while this process lives."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def enter(self) -> None:
        """Move the calling thread into the namespace (for good)."""
        _check(_libc.setns(self.fd, CLONE_NEWNET), "setns(CLONE_NEWNET)")

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a thread inside the namespace."""

        def inside() -> T:
            self.enter()
            return fn(*args, **kwargs)

        return _on_thread(inside)

    def close(self) -> None:
        # The namespace goes when the last process in it exits too.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _on_thread(fn: Callable[[], T]) -> T:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=run, name="hicache-netns", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
