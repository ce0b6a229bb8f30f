"""The engine-agnostic core (protocol/): no SGLang import here."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from hicache_async_ack import protocol as core
from hicache_async_ack.protocol import (
    PROTOCOL_VERSION,
    PeerMismatch,
    PipelinedReduce,
    ProtocolError,
    Stamp,
    still_queued,
)
from hicache_async_ack_lab.sim.clock import ModelClock, modelled
from hicache_async_ack_lab.sim.collectives import MinHub

Sync = PipelinedReduce


class Ref:
    """An entry with identity (acks are compared with `is`, never ==)."""

    def __eq__(self, other):  # equal values must not fool the reconciliation
        return True

    __hash__ = object.__hash__


BLOCKED = """
import importlib, importlib.abc, pkgutil, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("sglang", "torch"):
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, Block())
{body}
"""


def _blocked(body: str) -> subprocess.CompletedProcess:
    code = BLOCKED.replace("{body}", body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_the_protocol_imports_with_sglang_and_torch_blocked():
    """The engine-agnostic core, every module of protocol/, with any import of
    SGLang or torch raising."""
    out = _blocked(
        "import hicache_async_ack.protocol as p\n"
        "mods = [m.name for m in pkgutil.iter_modules(p.__path__)]\n"
        "assert {'reduce', 'stamp', 'depth', 'votes', 'errors'} <= set(mods), mods\n"
        "for m in mods:\n"
        "    importlib.import_module('hicache_async_ack.protocol.' + m)\n"
        "print('imported', len(mods))"
    )
    assert out.returncode == 0 and "imported 5" in out.stdout, out.stdout + out.stderr


def sync_errors_named(source: str) -> set[str]:
    """The plugin's sync error classes (errors.py) a module's source names."""
    import ast

    from hicache_async_ack import errors

    sync_errors = set(errors.__all__) - {"ErrorPair"}
    tree = ast.parse(source)
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return named & sync_errors


def test_the_protocol_raises_its_own_errors_and_names_no_sync():
    """Issue 53: the protocol speaks its own errors; a sync's state titles them."""
    from pathlib import Path

    modules = sorted(Path(core.__file__).parent.glob("*.py"))
    assert len(modules) >= 6, modules
    for path in modules:
        assert sync_errors_named(path.read_text()) == set(), path
    # negative control: a module raising the ack sync's error is seen
    assert sync_errors_named(
        "from ..errors import HiCacheAckSyncError\nraise HiCacheAckSyncError('x')"
    ) == {"HiCacheAckSyncError"}


def test_a_protocol_error_carries_what_was_seen():
    sync = Sync(MinHub(peer=lambda values: [1, 123, -123]).collective())
    q = [Ref()]
    sync.issue({"w": q}, digest=9)
    with pytest.raises(PeerMismatch) as err:
        sync.consume_due(lambda name, n: q[:n])
    seen = err.value.seen
    assert {"stamp", "group_min", "group_max"} <= set(seen)
    assert seen["stamp"].digest == 9 and seen["group_min"].protocol == 0


def test_the_block_blocks():
    """Negative control: the same block makes importing torch fail."""
    out = _blocked("import torch")
    assert out.returncode != 0 and "torch is blocked" in out.stderr, out.stderr


def test_still_queued_counts_only_agreed_entries_at_the_head():
    a, b, c, d = Ref(), Ref(), Ref(), Ref()
    assert still_queued([a, b, c], [a, b, c, d]) == 3
    assert still_queued([a, b, c], [b, c, d]) == 2  # a popped by another path
    assert still_queued([a, b, c], [d]) == 0  # all gone (flush), d is newer
    assert still_queued([a, b, c], []) == 0  # reset
    assert still_queued([], [a]) == 0


def test_still_queued_rejects_a_reordered_queue():
    a, b, c = Ref(), Ref(), Ref()
    with pytest.raises(ProtocolError, match="FIFO"):
        still_queued([a, b, c], [a, c, b])


def test_consume_waits_only_when_depth_reached():
    hub = MinHub()
    sync = Sync(hub.collective(), depth=3)
    q = [Ref() for _ in range(5)]

    def head(name, n):
        return q[:n]

    for i in range(3):
        assert sync.consume_due(head) is None
        sync.issue({"w": q[: i + 1]}, digest=0)
    got = sync.consume_due(head)
    assert got.pops == {"w": 1} and got.issued_step == 1
    assert sync.pending == 2


def slot(digest=0, depth=1, protocol=PROTOCOL_VERSION, auto=False, obs=0):
    x = Stamp(protocol, auto, depth, digest, obs).pack()
    return [x, -x]


def test_pop_count_is_the_peer_min_still_queued():
    hub = MinHub()
    sync = Sync(hub.collective(), depth=1)
    q = [Ref() for _ in range(4)]
    sync.issue({"w": q[:4], "l": []}, digest=3)
    assert hub.issued == [[4, 0, *slot(digest=3)]]
    hub.peer = lambda values: [2, 0, *slot(digest=3)]
    del q[0]  # a write-back flush took the first one meanwhile
    got = sync.consume_due(lambda name, n: q[:n] if name == "w" else [])
    assert got.agreed == {"w": 2, "l": 0}
    assert got.pops == {"w": 1, "l": 0}


def test_digest_divergence_and_failure_are_sticky():
    hub = MinHub()
    sync = Sync(hub.collective())
    sync.issue({"w": []}, digest=5)
    hub.peer = lambda values: [0, *slot(digest=4)]
    with pytest.raises(PeerMismatch, match="ranks diverged"):
        sync.consume_due(lambda n, k: [])
    with pytest.raises(ProtocolError, match="will not retry"):
        sync.issue({"w": []}, digest=5)


def test_drain_reconciles_each_after_the_previous_pops():
    hub = MinHub()
    sync = Sync(hub.collective(), depth=2)
    q = [Ref() for _ in range(3)]
    sync.issue({"w": q[:2]}, 0)
    sync.issue({"w": q[:3]}, 0)  # overlaps the first: q[0], q[1] in both
    got = sync.drain(lambda name, n: q[:n])
    assert got.pops == {"w": 3} and got.reduces == 2  # each entry once
    assert sync.pending == 0


# ---------------------------------------------------------------- the stamp
@pytest.mark.parametrize(
    "stamp",
    [
        Stamp(1, False, 1, 0),
        Stamp(15, True, 8, (1 << 42) - 1, (1 << 12) - 1),
        Stamp(PROTOCOL_VERSION, True, 3, 123456789, 7),
    ],
)
def test_stamp_round_trips_and_fits_an_int64(stamp):
    x = stamp.pack()
    assert Stamp.unpack(x) == stamp
    assert core.STOCK_LIMIT <= x < 2**63 and -(2**63) <= -x


def test_stamp_orders_agreed_fields_above_the_observation():
    """MIN/MAX of packed stamps compare the agreed fields first, so ranks that
    agree differ only in the observation and its max rides along."""
    a = Stamp(1, False, 2, 5, obs=4095).pack()
    b = Stamp(1, False, 3, 5, obs=0).pack()
    assert a < b
    assert Stamp(2, False, 1, 0).pack() > Stamp(1, True, 15, 2**42 - 1, 4095).pack()


def test_any_stamp_is_above_any_stock_digest():
    """A stock rank sends [digest, -digest] with digest < 2**42: the MIN pairs
    its digest with our -x, so upstream's own digest check fails there."""
    assert Stamp(1, False, 1, 0).pack() > (1 << 42) - 1


def _mismatch(peer_slot, depth=1):
    hub = MinHub(peer=lambda values: [1, *peer_slot])
    hints = {"depth": "Set THE_DEPTH_VAR identically.", "stock": "STOCK HINT"}
    sync = Sync(hub.collective(), depth=depth, hints=hints)
    q = [Ref()]
    for _ in range(depth):
        sync.issue({"w": q}, digest=9)
    with pytest.raises(PeerMismatch) as err:
        sync.consume_due(lambda name, n: q[:n])
    assert sync.pending == 0 and sync.failed is err.value
    return str(err.value)


def test_a_stock_peer_is_named_with_the_digest_it_sent():
    msg = _mismatch([123456789, -123456789])
    assert "this node pipelines, a peer does not" in msg and "123456789" in msg
    assert "30140" not in msg  # not the digest shifted right by the observation bits


@pytest.mark.parametrize("depth", [1, 3])
def test_an_in_tree_peer_is_named_as_a_patched_tree(depth):
    """The in-tree module sends depth << 42 | digest, in [2**42, 2**58): the plugin
    names that mix instead of a depth or a bare digest (the stamp-range contract)."""
    x = depth << 42 | 9
    msg = _mismatch([x, -x])
    assert "a peer runs SGLang's in-tree ack sync (a patched tree)" in msg
    assert "differs" not in msg and "bare digest" not in msg


def test_other_depth_on_a_peer_names_the_values_and_the_variable():
    msg = _mismatch(slot(digest=9, depth=2), depth=1)
    assert "the lag depth differs across the group: this rank 1, group min 1, max 2" in msg
    assert "Set THE_DEPTH_VAR identically." in msg and "Nothing was popped" in msg


def test_other_protocol_on_a_peer_is_named_first():
    msg = _mismatch(slot(digest=3, depth=2, protocol=PROTOCOL_VERSION + 1))
    assert "protocol version differs" in msg
    assert f"this rank {PROTOCOL_VERSION}, group min {PROTOCOL_VERSION}" in msg


def test_auto_against_fixed_depth_is_a_mismatch():
    assert "depth mode (1 = auto) differs" in _mismatch(slot(digest=9, auto=True))


def test_stock_peer_is_named_with_the_hint():
    msg = _mismatch([9, -9])  # upstream's blocking path: [digest, -digest]
    assert "ran SGLang's blocking ack sync" in msg and "STOCK HINT" in msg


def test_observation_differences_are_not_a_mismatch():
    hub = MinHub(peer=lambda values: [1, *slot(digest=9, obs=77)])
    sync = Sync(hub.collective())
    q = [Ref()]
    sync.issue({"w": q}, digest=9)
    got = sync.consume_due(lambda name, n: q[:n])
    assert got.pops == {"w": 1} and got.obs_max == 77


def test_depth_must_be_positive():
    with pytest.raises(ValueError):
        Sync(MinHub().collective(), depth=0)


# ---------------------------------------------------------------- auto depth
def test_auto_depth_raises_after_consecutive_waits_and_ignores_stale_ones():
    rule = core.AutoDepth(raise_after=2, lower_after=3)
    waited = core.observation(0.001, next_pending=False, step_s=0.01)
    assert rule.update(waited, issued_step=1, now_step=1) == 1  # one wait: noise
    assert rule.update(waited, issued_step=2, now_step=2) == 2  # two in a row: raise
    # reduces issued up to 2 after the change carry what the old depth saw
    for issued in (3, 4):
        assert rule.update(waited, issued_step=issued, now_step=issued + 1) == 2
    assert rule.update(waited, issued_step=5, now_step=6) == 2
    assert rule.update(waited, issued_step=6, now_step=7) == 3
    assert list(rule.changes) == [(2, 1, 2), (7, 2, 3)]


def test_auto_depth_lowers_after_a_clean_streak_and_never_past_its_bounds():
    rule = core.AutoDepth(lo=1, hi=2, raise_after=1, lower_after=3, depth=2)
    clean, pending = core.observation(0.0, False, 0.01), core.observation(0.0, True, 0.01)
    step = 0
    for obs in (clean, clean, pending, clean, clean):
        step += 1
        assert rule.update(obs, step, step) == 2  # the streak restarted
    assert rule.update(clean, 6, 6) == 1
    waited = core.observation(0.005, False, 0.01)
    # a lower: only the reduce issued in the step of the change is stale
    assert rule.update(waited, 7, 8) == 1
    assert rule.update(waited, 8, 9) == 2
    # a raise by one: the reduce of that step and the one whose consume it skipped
    assert rule.update(waited, 10, 11) == 2 and rule.update(waited, 11, 12) == 2
    assert rule.update(waited, 12, 13) == 2  # hi bound
    assert list(rule.changes) == [(6, 2, 1), (9, 1, 2)]


def test_short_waits_are_noise_and_any_wait_outranks_next_pending():
    step = 0.01
    assert core.observation(core.WAIT_FLOOR_S / 2, False, step) == 0
    assert core.observation(0.0, True, step) == 1
    assert core.observation(core.WAIT_FLOOR_S, False, step) > core.observation(0.0, True, step)
    assert core.observation(100.0, True, step) == core.OBS_MAX  # saturates


def _run_auto(latency_ms, step_ms: float, steps: int = 240):
    """One rank, model time: each step a forward of ``step_ms``, then the
    consume and the issue; ``latency_ms(step)``: how late a reduce issued then
    completes. Returns the depth after each step and the waits (model ms)."""
    clock = ModelClock()
    lat = latency_ms if callable(latency_ms) else (lambda step: latency_ms)
    now = [0]  # the step a reduce is issued in
    collective = modelled(MinHub().collective(), lambda: lat(now[0]) / 1000.0, clock)
    sync = Sync(collective, auto=core.AutoDepth(), clock=clock)
    depths, waits = [], []
    for now[0] in range(steps):
        clock.advance(step_ms / 1000.0)
        got = sync.consume_due(lambda name, n: [])
        sync.issue({"w": []}, digest=0)
        depths.append(sync.depth)
        waits.append(round(got.waited_s * 1000, 6) if got else 0.0)
    return depths, waits


@pytest.mark.parametrize(
    "latency_ms, step_ms",
    [(35, 10), (25, 11), (14, 4), (21, 10), (15, 10), (30, 10), (50, 12), (8, 10), (10, 10)],
)
def test_auto_depth_settles_at_the_smallest_hiding_depth_without_overshoot(latency_ms, step_ms):
    """A reduce issued at the end of a step is consumed ``depth`` forwards
    later: the smallest depth that hides it is ceil(latency / step). The rule
    reaches it and never goes past it (one latency episode counted once)."""
    depths, waits = _run_auto(latency_ms, step_ms)
    hiding = math.ceil(latency_ms / step_ms)
    assert max(depths) == hiding, depths[:40]
    assert depths[-1] == hiding
    settled = depths.index(hiding)
    assert settled <= 12, depths[:40]  # within a few consumes
    assert depths[settled:] == [hiding] * (len(depths) - settled)  # and stays
    assert waits[settled + hiding + 1 :] and not any(waits[settled + hiding + 1 :])  # hidden


def test_auto_depth_follows_a_latency_that_comes_and_goes():
    depths, _ = _run_auto(lambda step: 35 if 20 <= step < 120 else 0, 10, steps=300)
    assert depths[:20] == [1] * 20
    assert max(depths) == 4 and depths[119] == 4
    assert depths[-1] == 1  # lowered one by one once it is fast again
    assert all(b - a in (0, -1) for a, b in zip(depths[120:], depths[121:]))


def test_one_long_reduce_is_an_outlier_not_a_latency():
    """One 200 ms reduce among 10 ms steps: the depth stays at most 2 and is back
    at 1 within 20 steps (it used to go to 8 and stay above 1 for 154 steps)."""
    spike_at = 50
    depths, waits = _run_auto(lambda step: 200 if step == spike_at else 0, 10, steps=300)
    assert max(waits) > 150  # the spike was seen: waited on, once
    assert max(depths) <= 2, depths[spike_at : spike_at + 30]
    assert depths[spike_at + 20 :] == [1] * (300 - spike_at - 20)


def test_rare_outliers_barely_move_the_depth():
    """1% of reduces at 60 ms (10 ms steps) over 3000 steps: at most 2 changes
    (it used to saw between 1 and 7: 94 changes)."""
    outlier = lambda step: 60 if step % 100 == 37 else 0  # noqa: E731
    depths, waits = _run_auto(outlier, 10, steps=3000)
    changes = sum(a != b for a, b in zip(depths, depths[1:]))
    assert changes <= 2, changes
    assert sum(w > 40 for w in waits) >= 29  # the outliers were there, and waited on


def test_a_sustained_wait_raises_by_its_smallest_recent_size():
    """Two consecutive consumes that waited 2 steps or more raise the depth by
    the smaller of the two waits (a sustained latency, hidden at once); a single
    one does not."""
    rule = core.AutoDepth(raise_after=2)
    obs = core.observation(0.013, next_pending=True, step_s=0.012)
    assert obs >> 1 == 2
    assert rule.update(obs, issued_step=1, now_step=1) == 1  # one: maybe an outlier
    assert rule.update(obs, issued_step=2, now_step=2) == 3  # two in a row: 1 + 2
    big = core.observation(0.2, next_pending=True, step_s=0.01)
    top = core.AutoDepth(depth=7)
    assert top.update(big, 1, 1) == 7 and top.update(obs, 2, 2) == 8  # never past hi


def test_a_sustained_wait_at_depth_k_shows_every_kth_consume_and_still_raises():
    """At depth 2 the reduce issued right after the one waited on is done by its
    consume, so a sustained latency waits on every other consume: two waits among
    the last depth + 1 consumes raise (consecutive only would never have)."""
    rule = core.AutoDepth(raise_after=2, depth=2)
    wait3 = core.observation(0.031, next_pending=True, step_s=0.01)
    clear = core.observation(0.0, next_pending=True, step_s=0.01)
    assert wait3 >> 1 == 4 and clear >> 1 == 0
    assert rule.update(wait3, 1, 1) == 2
    assert rule.update(clear, 2, 2) == 2
    assert rule.update(wait3, 3, 3) == 6  # 2 + 4
    spaced = core.AutoDepth(raise_after=2, depth=1)  # at depth 1: only in a row
    assert [spaced.update(o, i, i) for i, o in enumerate((wait3, clear, wait3), 1)] == [1] * 3


# ---------------------------------------------------------------- digest folding
def test_fold_digest_keeps_42_bit_digests_and_folds_the_rest():
    assert core.fold_digest(0) == 0
    assert core.fold_digest((1 << 42) - 1) == (1 << 42) - 1  # upstream's, as is
    assert core.fold_digest(1 << 42) == 1  # bit 42 lands on bit 0
    assert core.fold_digest((1 << 42) | 1) == 0
    for d in (1 << 50, (1 << 63) - 1, 1 << 200, -1, -(1 << 45)):
        assert 0 <= core.fold_digest(d) < 1 << 42
    assert core.fold_digest(-1) != core.fold_digest(1)


@pytest.mark.parametrize("high_bit", [42, 50, 63, 100])
def test_a_divergence_above_bit_42_is_caught(high_bit):
    """A tree core whose digest is wider than upstream's 42 bits: ranks that
    differ only above bit 42 must still disagree in the stamp."""
    low = 0x2A5A5A5A5A5
    hub = MinHub(peer=lambda values: [0, *slot(digest=low)])
    sync = Sync(hub.collective())
    sync.issue({"w": []}, digest=low | (1 << high_bit))
    with pytest.raises(PeerMismatch, match="ranks diverged"):
        sync.consume_due(lambda name, n: [])
