"""The engine-agnostic prefetch votes (votes.py): with more ongoing operations
than vote slots, every one past its deadline that the walk reaches is voted on
and stopped within ceil(n / VOTE_SLOTS) + 2 passes, whatever order the keys
sort in; a section is read back as stock SGLang's per-request verdicts (no
SGLang)."""

from __future__ import annotations

import math

import pytest

from hicache_async_ack.votes import (
    LAYOUT,
    VOTE_SLOTS,
    AdmissionMismatch,
    PrefetchVoteMismatch,
    VoteBook,
)


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
    book = VoteBook()
    pending = None  # the section closed at the previous pass (one rank: MIN is itself)
    ongoing: list[Op] = []
    next_key = 0
    late: list[int] = []
    for p in range(passes):
        verdicts = book.read(*pending) if pending is not None else None
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
        for op in ongoing:  # the walk reaches every waiting request
            book.poll(op, op.stuck and p >= op.born + deadline)
        values, ballot = book.close([(op.key, op) for op in ongoing])
        pending = (ballot, values)
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


def reduced(*sections: list[int]) -> list[int]:
    """The group's MIN of several ranks' sections."""
    return [min(col) for col in zip(*sections)]


def test_a_verdict_needs_every_rank_to_reach_it_and_one_rank_past_its_deadline():
    books = [VoteBook(), VoteBook()]
    ops = [Op(k, 0, False) for k in range(4)]
    # op 0: both reached, rank 1 past its deadline -> stop (stock's MAX)
    # op 1: both reached, none past -> go on; op 2: rank 0 only reached, past -> veto
    # op 3: nobody reached
    books[0].poll(ops[0], False)
    books[1].poll(ops[0], True)
    books[0].poll(ops[1], False)
    books[1].poll(ops[1], False)
    books[0].poll(ops[2], True)
    closed = [b.close([(op.key, op) for op in ops]) for b in books]
    group = reduced(*(values for values, _ in closed))
    assert len(group) == LAYOUT
    for b, (_, ballot) in zip(books, closed):
        verdicts = b.read(ballot, group)
        assert [verdicts(op) for op in ops] == [True, False, False, False]


def test_a_walk_is_voted_on_once_then_starts_afresh():
    book = VoteBook()
    op = Op(0, 0, True)
    book.poll(op, True)
    first, b1 = book.close([(0, op)])
    second, b2 = book.close([(0, op)])  # not reached in the next walk
    assert book.read(b1, first)(op) and not book.read(b2, second)(op)
    assert (b1.pass_no, b2.pass_no) == (0, 1)


def test_different_sets_stop_before_any_verdict():
    a, b = VoteBook(), VoteBook()
    ops = [Op(k, 0, True) for k in range(3)]
    for op in ops:
        a.poll(op, True)
        b.poll(op, True)
    va, ba = a.close([(op.key, op) for op in ops])
    vb, bb = b.close([(op.key, op) for op in ops[:2]])
    with pytest.raises(PrefetchVoteMismatch, match="number of ongoing storage prefetch"):
        a.read(ba, reduced(va, vb))


@pytest.mark.parametrize(
    "left, right, first, mine",
    [
        (["x", "y"], ["x"], "request #2 of the batch", ("rid='y'", "nothing")),
        (["x", "y"], ["y", "x"], "request #1 of the batch", ("rid='x'", "rid='y'")),
        (
            [f"r{i}" for i in range(20)],
            [f"r{i}" for i in range(19)] + ["z"],
            "past request #16",
            None,
        ),
    ],
)
def test_different_admissions_stop_naming_the_first_difference(left, right, first, mine):
    books = (VoteBook(), VoteBook())
    for book, rids in zip(books, (left, right)):
        for rid in rids:
            book.admit((rid, 0))
    closed = [book.close([]) for book in books]
    group = reduced(*(values for values, _ in closed))
    for rank, (book, (_, ballot)) in enumerate(zip(books, closed)):
        with pytest.raises(AdmissionMismatch, match="SGLang #30760") as err:
            book.read(ballot, group)
        msg = str(err.value)
        assert first in msg and "scheduling pass 0" in msg, msg
        if mine is not None:
            assert f"where this rank admitted {mine[rank]}" in msg, msg


def test_the_same_admissions_in_the_same_order_pass():
    a, b = VoteBook(), VoteBook()
    for book in (a, b):
        for rid in ("x", "y", "z"):
            book.admit((rid, 0))
    va, ba = a.close([])
    vb, bb = b.close([])
    assert len(a.read(ba, reduced(va, vb))) == 0
