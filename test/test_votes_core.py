"""The engine-agnostic prefetch votes (votes.py), no SGLang: a section read
back as stock SGLang's per-request verdicts, in walk order, with the
interval's held-back calls in their place; reaches past the slots kept in
order with the answer decided for them (never dropped, whatever n); ranks
whose walks reached or admitted differently stop before any verdict."""

from __future__ import annotations

import pytest

from hicache_async_ack.protocol.votes import (
    LAYOUT,
    VOTE_SLOTS,
    AdmissionMismatch,
    PrefetchVoteMismatch,
    VoteBook,
)


class Op:
    def __init__(self, key):
        self.key = key


def reduced(*sections: list[int]) -> list[int]:
    """The group's MIN of several ranks' sections."""
    return [min(col) for col in zip(*sections)]


def closed(books, n=0, policy="timeout"):
    out = [b.close(n, policy) for b in books]
    group = reduced(*(values for values, _ in out))
    assert len(group) == LAYOUT
    return [b.read(ballot, group) for b, (_, ballot) in zip(books, out)]


def stops(verdicts) -> list:
    return [op.key for op in verdicts.stops()]


def test_a_stop_needs_every_rank_to_reach_it_and_one_rank_past_its_deadline():
    books = [VoteBook(), VoteBook()]
    ops = [Op(k) for k in range(4)]
    # op 0: both reached, rank 1 past -> stop (stock's MAX); op 1: none past;
    # op 2: both reached, rank 0 past -> stop; op 3: only rank 0's walk got there -> veto
    for b, expired in zip(books, ([False, False, True, True], [True, False, False])):
        for op, e in zip(ops, expired):
            b.poll(op.key, op, e)
    for v in closed(books, n=4):
        assert stops(v) == [0, 2]
        assert [p[0].key for _, kind, p in v.entries] == [0, 1, 2, 3][: len(v.entries)]


def test_reaches_and_held_calls_come_back_in_the_order_they_happened():
    book = VoteBook()
    a, b = Op("a"), Op("b")
    book.defer("retry")
    book.poll("a", a, True)
    book.defer("abort x")
    book.poll("b", b, False)
    book.defer("arrival y")
    (v,) = closed([book], n=2)
    kinds = [(kind, p if kind == "deferred" else p[0].key) for _, kind, p in v.entries]
    assert kinds == [
        ("deferred", "retry"),
        ("reach", "a"),
        ("deferred", "abort x"),
        ("reach", "b"),
        ("deferred", "arrival y"),
    ]
    assert stops(v) == ["a"]


@pytest.mark.parametrize("n", [VOTE_SLOTS + 1, 300, 2000])
def test_no_reach_is_ever_lost_past_the_slots(n):
    """Every reach is kept, in order: the first VOTE_SLOTS ride the section, the
    rest carry the answer the caller decided for them (SGLang's own reduce)."""
    books = [VoteBook(), VoteBook()]
    ops = [Op(k) for k in range(n)]
    for b in books:
        for op in ops:
            expired = op.key % 97 == 5 or op.key == n - 1  # sparse, on and past the slots
            if not b.poll(op.key, op, expired):
                b.poll(op.key, op, expired, decided=expired)
    for v in closed(books, n=n):
        assert len(v.entries) == n
        assert stops(v) == [k for k in range(n) if k % 97 == 5 or k == n - 1]


def test_poll_says_when_the_section_is_full():
    book = VoteBook()
    for k in range(VOTE_SLOTS):
        assert book.poll(k, Op(k), False)
    assert not book.poll("late", Op("late"), True)
    assert book.poll("late", Op("late"), True, decided=True)


def test_an_interval_is_voted_on_once_then_starts_afresh():
    book = VoteBook()
    op = Op(0)
    book.poll(0, op, True)
    first, b1 = book.close(1, "timeout")
    second, b2 = book.close(1, "timeout")  # not reached in the next walk
    assert stops(book.read(b1, first)) == [0] and stops(book.read(b2, second)) == []
    assert (b1.pass_no, b2.pass_no) == (0, 1)


def test_best_effort_stops_what_every_rank_reached():
    books = [VoteBook(), VoteBook()]
    x, y = Op("x"), Op("y")
    books[0].poll("x", x, True)
    books[1].poll("x", x, True)
    books[0].poll("y", y, True)  # rank 1's walk stopped before y
    verdicts = closed(books, n=2, policy="best_effort")
    assert len(verdicts) == 2 and all(stops(v) == ["x"] for v in verdicts)


@pytest.mark.parametrize(
    "mine, theirs, said",
    [
        ((3, "timeout"), (2, "timeout"), "number of ongoing storage prefetch"),
        ((1, "timeout"), (1, "best_effort"), "prefetch policy differs"),
    ],
)
def test_different_ongoing_counts_or_policies_stop_before_any_verdict(mine, theirs, said):
    a, b = VoteBook(), VoteBook()
    va, ba = a.close(*mine)
    vb, _ = b.close(*theirs)
    with pytest.raises(PrefetchVoteMismatch, match=said):
        a.read(ba, reduced(va, vb))


def test_walks_that_reached_different_requests_stop_naming_the_position():
    a, b = VoteBook(), VoteBook()
    a.poll(("r1", 0), Op(1), False)
    b.poll(("r2", 0), Op(2), False)
    va, ba = a.close(2, "timeout", "of forward 7")
    vb, _ = b.close(2, "timeout", "of forward 7")
    with pytest.raises(PrefetchVoteMismatch, match="reached different requests at position 1") as e:
        a.read(ba, reduced(va, vb))
    assert "rid='r1'" in str(e.value) and "of forward 7" in str(e.value)


X, Y = ("x", 0, 4), ("y", 0, 4)  # (key, prefix length, extend length)


@pytest.mark.parametrize(
    "left, right, first, mine",
    [
        ([X, Y], [X], "request #2 of the batch", ("rid='y'", "nothing")),
        ([X, Y], [Y, X], "request #1", ("rid='x'", "rid='y'")),
        # the same request, another prefix length: the batches differ all the same
        ([("x", 8, 4)], [("x", 0, 12)], "request #1",
         ("prefix 8 and extend 4", "prefix 0 and extend 12")),
        (
            [(f"r{i}", 0, 1) for i in range(20)],
            [(f"r{i}", 0, 1) for i in range(19)] + [("z", 0, 1)],
            "past request #16",
            None,
        ),
    ],
)  # fmt: skip
def test_different_admissions_stop_naming_the_first_difference(left, right, first, mine):
    books = (VoteBook(), VoteBook())
    for book, admitted in zip(books, (left, right)):
        for rid, prefix, extend in admitted:
            book.admit((rid, 0), prefix, extend)
    out = [book.close(0, "timeout", "of forward 3") for book in books]
    group = reduced(*(values for values, _ in out))
    for rank, (book, (_, ballot)) in enumerate(zip(books, out)):
        with pytest.raises(AdmissionMismatch, match="SGLang #30760") as err:
            book.read(ballot, group)
        msg = str(err.value)
        assert first in msg and "scheduling pass of forward 3" in msg, msg
        if mine is not None:
            assert mine[rank] in msg, msg


def test_the_same_admissions_in_the_same_order_pass():
    books = (VoteBook(), VoteBook())
    for book in books:
        for rid in ("x", "y", "z"):
            book.admit((rid, 0), 2, 5)
    verdicts = closed(books)
    assert len(verdicts) == 2 and all(v.entries == [] for v in verdicts)
