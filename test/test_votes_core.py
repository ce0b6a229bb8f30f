"""The engine-agnostic prefetch votes (votes.py): with more ongoing operations
than vote slots, every one past its deadline is voted on and stopped within
ceil(n / VOTE_SLOTS) + 2 passes, whatever order the keys sort in (no SGLang)."""

from __future__ import annotations

import math

import pytest

from hicache_async_ack.votes import VOTE_SLOTS, PipelinedVotes
from hicache_async_ack_lab.sim.collectives import MinHub


class Op:
    def __init__(self, key: int, born: int, stuck: bool):
        self.key, self.born, self.stuck = key, born, stuck


def fifo_churn(n: int, arrivals: int, passes: int, deadline: int = 3):
    """``n`` ongoing operations whose keys sort in arrival order; each pass the
    oldest healthy one completes and new ones arrive until there are ``n``
    again (at least ``arrivals``); every seventh is stuck: it never completes
    and its deadline passes ``deadline`` passes after it arrived. Returns, per
    stuck operation stopped, the passes from its deadline to its stop, and
    the stuck operations never stopped."""
    votes = PipelinedVotes(MinHub().collective())
    ongoing: list[Op] = []
    next_key = 0
    late: list[int] = []
    for p in range(passes):
        verdicts = votes.consume()
        if verdicts is not None:
            for op in [op for op in ongoing if verdicts(op)]:
                assert op.stuck, "a healthy operation was stopped"
                late.append(p - (op.born + deadline))
                ongoing.remove(op)
        done = 0
        for op in list(ongoing):  # FIFO completion of the healthy ones
            if done >= arrivals:
                break
            if not op.stuck:
                ongoing.remove(op)
                done += 1
        while len(ongoing) < n:
            ongoing.append(Op(next_key, p, next_key % 7 == 3))
            next_key += 1
        votes.issue([(op.key, op, op.stuck and p >= op.born + deadline) for op in ongoing])
    # stuck ones whose deadline passed long enough ago to have had their turn
    bound = math.ceil(n / VOTE_SLOTS) + 2
    missed = [op for op in ongoing if op.stuck and passes - (op.born + deadline) > bound]
    return late, missed


@pytest.mark.parametrize("n, arrivals", [(257, 1), (260, 4), (300, 44)])
def test_every_deadline_is_voted_on_within_bounded_passes(n, arrivals):
    late, missed = fifo_churn(n, arrivals, passes=600)
    assert len(late) > 20, "too few stuck operations stopped: the scenario is broken"
    bound = math.ceil(n / VOTE_SLOTS) + 2
    assert max(late) <= bound, (max(late), bound)
    assert missed == []


def test_under_the_slot_count_every_deadline_is_voted_on_the_next_pass():
    late, missed = fifo_churn(200, 1, passes=300)
    assert late and max(late) <= 1 and missed == []
