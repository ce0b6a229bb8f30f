"""Assertions over what scenario ranks popped (shared by the multi-rank tests)."""

from __future__ import annotations


def assert_symmetric_and_complete(results: list[dict], name: str) -> dict:
    """Every rank popped the same entries in the same step, never an unfinished
    ack, and nothing is left queued at the end. Returns rank 0's result."""
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}: {r.get('traceback') or r['error']}"
        assert r["violations"] == [], f"rank {rank}: {r['violations'][:5]}"
        assert all(v == 0 for v in r["left"].values()), f"rank {rank} left {r['left']}"
        assert r["pending"] == 0 or r["pipelined"], r
    ref = per_rank[0]["pops"]
    for rank, r in enumerate(per_rank[1:], 1):
        for step, (a, b) in enumerate(zip(ref, r["pops"])):
            assert a == b, f"step {step}: rank 0 popped {a}, rank {rank} popped {b}"
        assert len(ref) == len(r["pops"])
    return per_rank[0]


def assert_lagged_equal(pipelined: list, blocking: list, k: int) -> None:
    """Step s+k of the pipelined run pops exactly what step s of the blocking run
    popped (same seed, same traffic), and the first k steps pop nothing."""
    assert any(post for _, post in blocking), "nothing popped: the test would prove nothing"
    assert [post for _, post in pipelined[k:]] == [post for _, post in blocking[:-k]]
    assert all(post == [] for _, post in pipelined[:k] + blocking[-k:])
