"""Engine-agnostic (no SGLang/torch): the stamp every reduce carries in ``[x, -x]``.

MIN over ``[x, -x]`` gives the group's min and max of x, which packs, most significant
first, protocol, depth mode, depth, digest and a per-rank observation: the agreed fields
differ between min and max exactly when some rank differs. Who sent x (shared with the
in-tree form): stock's bare digest < 2**42 (STOCK_LIMIT); the in-tree module's
``depth << 42 | digest`` < 2**58 (IN_TREE_LIMIT); this plugin's stamps >= 2**58.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

# The wire protocol: bump it whenever what a reduce means changes (its top place in the
# stamp never moves). 2: fused layout (flags, riders); 3: reaches in walk order (votes
# 11); 4: walk digest and overflow exchanges (votes 12, 812 values); 5: held prefetch
# starts and the read-once flag (votes 14), storage pipelined only under the votes.
PROTOCOL_VERSION = 5

OBS_BITS = 12  # the per-rank observation (auto depth's wait signal)
DIGEST_BITS = 42  # upstream's reclaim digest is masked to 42 bits
DEPTH_BITS = 4
AUTO_BITS = 1
PROTOCOL_BITS = 4
assert PROTOCOL_BITS + AUTO_BITS + DEPTH_BITS + DIGEST_BITS + OBS_BITS == 63  # x, -x: int64
OBS_MAX = (1 << OBS_BITS) - 1
DEPTH_LIMIT = (1 << DEPTH_BITS) - 1
STOCK_LIMIT = 1 << DIGEST_BITS  # upstream's own [digest, -digest] stays below this
IN_TREE_LIMIT = 1 << 58  # the in-tree module's depth << 42 | digest stays below this
# The layout flags ([f, -f] after the stamp), by bit: sections and shared settings.
STORAGE_FLAG, VOTES_FLAG, VOTES_SETTING_FLAG, READ_ONCE_FLAG = 0, 1, 2, 3
# The decode offload agreement's code in upstream's int32[2]: above any queue size.
OFFLOAD_CODE = 1 << 30


class Handle(Protocol):
    def wait(self) -> Sequence[int]:
        """Block until the MIN-reduce is complete; return the reduced values."""

    def is_completed(self) -> bool:
        """Whether wait() would return at once."""


# values -> Handle. Must be issued by every rank in the same order.
Collective = Callable[[list[int]], Handle]


@dataclass(frozen=True)
class Stamp:
    """What rides in the ``[x, -x]`` slot of every reduce."""

    protocol: int
    auto: bool
    depth: int
    digest: int
    obs: int = 0

    # the fields every rank must share, most significant first
    AGREED = ("protocol", "auto", "depth", "digest")

    def pack(self) -> int:
        return pack_stamp(self.protocol, self.auto, self.depth, self.digest, self.obs)

    @classmethod
    def unpack(cls, x: int) -> Stamp:
        obs, x = x & OBS_MAX, x >> OBS_BITS
        digest, x = x & (STOCK_LIMIT - 1), x >> DIGEST_BITS
        depth, x = x & DEPTH_LIMIT, x >> DEPTH_BITS
        auto, x = bool(x & 1), x >> AUTO_BITS
        return cls(protocol=x, auto=auto, depth=depth, digest=digest, obs=obs)


def fold_digest(digest: int) -> int:
    """``digest`` in 42 bits: a wider one has its high bits XOR-folded into the low 42
    (a divergence there still shows); negatives read as two's complement (int64)."""
    d = int(digest)
    if d < 0:
        d &= (1 << max(64, d.bit_length() + 1)) - 1
    while d >= STOCK_LIMIT:
        d = (d & (STOCK_LIMIT - 1)) ^ (d >> DIGEST_BITS)
    return d


def pack_stamp(protocol: int, auto: bool, depth: int, digest: int, obs: int) -> int:
    """A :class:`Stamp` as the int that rides in the reduce (the digest folded)."""
    x = (protocol << AUTO_BITS) | int(auto)
    x = (x << DEPTH_BITS) | depth
    x = (x << DIGEST_BITS) | fold_digest(digest)
    return (x << OBS_BITS) | min(max(obs, 0), OBS_MAX)


def stamps_differ(x: int, lo_x: int, hi_x: int) -> bool:
    """Whether the group's min or max differs from ``x`` above the observation."""
    agreed = x >> OBS_BITS
    return lo_x >> OBS_BITS != agreed or hi_x >> OBS_BITS != agreed


def describe_mismatch(mine: Stamp, lo: Stamp, hi: Stamp, hints: Mapping[str, str]) -> str:
    """Why the stamps differ, for the operator: the most significant field that
    differs between min and max, this rank's value, and what to set. ``hints["protocol
    N"]``, where given, says what a peer stamping protocol N means (another exchange of
    this plugin's, not another release)."""
    if lo.protocol == 0:
        raw = lo.pack()  # what the peer sent (unpack and pack are exact below 2**63)
        if raw >= STOCK_LIMIT:  # [2**42, 2**58): the in-tree module's depth << 42 | digest
            return (
                "a peer runs SGLang's in-tree ack sync (a patched tree) while this "
                f"node runs the hicache-async-ack plugin (the peer sent {raw:#x}: depth "
                f"{raw >> DIGEST_BITS}, digest {raw & (STOCK_LIMIT - 1)}). Run one form on "
                "every node of the TP group: the plugin, or the patched tree without it."
            )
        return (
            "this node pipelines, a peer does not: a peer rank ran SGLang's blocking ack "
            f"sync on this reduce (it sent a bare digest, {raw}, not a stamp): "
            f"{hints.get('stock', 'it does not pipeline')}"
        )
    for name in Stamp.AGREED:
        a, b, me = getattr(lo, name), getattr(hi, name), getattr(mine, name)
        peer = a if a != me else b
        if name == "protocol" and a != b and f"protocol {peer}" in hints:
            return f"{hints[f'protocol {peer}']} (a peer stamped protocol {peer}, this rank {me})"
        if a != b:
            what = {
                "protocol": "the pipelined ack-sync protocol version",
                "auto": "the lag depth mode (1 = auto)",
                "depth": "the lag depth",
                "digest": "the write_back duplicate-reclaim digest (ranks diverged)",
            }[name]
            return (
                f"{what} differs across the group: this rank {int(me)}, group min "
                f"{int(a)}, max {int(b)}. {hints.get(name, '')}".rstrip()
            )
    return f"the stamps differ (group min {lo}, max {hi}, this rank {mine})"
