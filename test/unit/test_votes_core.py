"""The engine-agnostic prefetch votes (protocol/votes.py), no SGLang: a section
read back as stock SGLang's per-request verdicts, in walk order; every reach
kept, past the slots too (as many overflow exchanges on every rank, decided by
the group's largest walk; under best_effort none where the walks agree); ranks
whose walks reached or admitted differently stop before any verdict; the book's
cost grows linearly with the walk (issue 47's finding 5)."""

from __future__ import annotations

import inspect
import sys

import pytest

from hicache_async_ack.protocol import (
    LAYOUT,
    OVERFLOW_LAYOUT,
    VOTE_SLOTS,
    BatchMismatch,
    PeerMismatch,
    VoteBook,
)

Book = VoteBook
PASS = 5  # the pass count a book's caller closes an interval at


class Op:
    def __init__(self, key):
        self.key = key


def reduced(*sections: list[int]) -> list[int]:
    """The group's MIN of several ranks' sections."""
    return [min(col) for col in zip(*sections)]


class Group:
    """The overflow exchanges of several books: each rank's values, reduced at
    once when every rank has sent (the ranks run them in the same order)."""

    def __init__(self, n: int):
        self.n = n
        self.sent: list[list[list[int]]] = [[] for _ in range(n)]
        self.runs = 0

    def exchange(self, rank: int):
        def run(values: list[int]) -> list[int]:
            self.sent[rank].append(list(values))
            self.runs += 1
            return values  # replaced by the group's MIN in read_all

        return run


def read_all(books, n=0, policy="timeout", label=""):
    """Close every book, MIN the sections, read each back. Overflow exchanges
    are reduced across the books in two rounds (a recording round, then the
    real one), as the ranks would run them in lockstep."""
    out = [b.close(PASS, n, policy, label) for b in books]
    group = reduced(*(values for values, _ in out))
    assert len(group) == LAYOUT
    record = Group(len(books))
    for rank, (b, (_, ballot)) in enumerate(zip(books, out)):
        b.read(ballot, group, record.exchange(rank))
    rounds = [reduced(*col) for col in zip(*record.sent)] if record.sent[0] else []
    assert all(len(s) == len(record.sent[0]) for s in record.sent)  # as many on every rank
    results = []
    for b, (_, ballot) in zip(books, out):
        results.append(b.read(ballot, group, replay(rounds)))
    return results, len(rounds)


def replay(rounds: list[list[int]]):
    it = iter(rounds)
    return lambda values: next(it)


def stops(verdicts) -> list:
    return [r.key for r, stop in verdicts if stop]


def test_a_stop_needs_every_rank_to_reach_it_and_one_rank_past_its_deadline():
    books = [Book(), Book()]
    ops = [Op(k) for k in range(4)]
    # op 0: both reached, rank 1 past -> stop (stock's MAX); op 1: none past;
    # op 2: both reached, rank 0 past -> stop; op 3: only rank 0's walk got there -> veto
    for b, expired in zip(books, ([False, False, True, True], [True, False, False])):
        for op, e in zip(ops, expired):
            b.poll(op.key, op, e)
    results, exchanges = read_all(books, n=4)
    assert exchanges == 0
    for v in results:
        assert stops(v) == [0, 2]
        assert [r.key for r, _ in v] == [0, 1, 2, 3][: len(v)]


@pytest.mark.parametrize("n", [VOTE_SLOTS + 1, 300, 2000])
def test_every_reach_past_the_slots_is_decided_in_overflow_exchanges(n):
    """Never dropped: ceil((n - slots) / slots) exchanges, the same on every
    rank, the verdicts in walk order (43's finding 1; 47's finding 5: one
    collective per VOTE_SLOTS reaches, where stock runs one per reach)."""
    books = [Book(), Book()]
    ops = [Op(("r", k)) for k in range(n)]
    for rank, b in enumerate(books):
        for k, op in enumerate(ops):
            b.poll(op.key, op, rank == 0 and k % 3 == 0)  # rank 0 past every third
    results, exchanges = read_all(books, n=n)
    assert exchanges == -(-(n - VOTE_SLOTS) // VOTE_SLOTS)
    for v in results:
        assert [r.key for r, _ in v] == [op.key for op in ops]
        assert stops(v) == [op.key for k, op in enumerate(ops) if k % 3 == 0]


def test_a_shorter_walk_past_the_slots_vetoes_what_it_did_not_reach():
    """47's finding 9: as below the slots, a rank whose walk ended earlier
    vetoes the rest (the group's largest walk sets the exchanges), no crash."""
    books = [Book(), Book()]
    ops = [Op(("r", k)) for k in range(300)]
    for rank, b in enumerate(books):
        for op in ops[: 300 if rank == 0 else 270]:
            b.poll(op.key, op, True)
    results, exchanges = read_all(books, n=300)
    assert exchanges == 1
    assert stops(results[0]) == [op.key for op in ops[:270]]
    assert stops(results[1]) == [op.key for op in ops[:270]]


def test_walks_that_reach_different_requests_past_the_slots_stop_naming_the_position():
    """47's finding 9: positions past the slots are hash-checked too."""
    books = [Book(), Book()]
    for rank, b in enumerate(books):
        for k in range(300):
            key = ("other", 0) if (rank == 1 and k == 280) else (f"r{k}", 0)
            b.poll(key, Op(key), False)
    with pytest.raises(PeerMismatch, match="different requests at position 281"):
        read_all(books, n=300)


def test_best_effort_walks_that_agree_need_no_exchange_past_the_slots():
    books = [Book(), Book()]
    ops = [Op(("r", k)) for k in range(600)]
    for b in books:
        for op in ops:
            b.poll(op.key, op, True)
    results, exchanges = read_all(books, n=600, policy="best_effort")
    assert exchanges == 0 and all(stops(v) == [op.key for op in ops] for v in results)
    # ... and where they do not agree, the exchanges decide (rank 1 stopped earlier)
    books = [Book(), Book()]
    for rank, b in enumerate(books):
        for op in ops[: 600 if rank == 0 else 500]:
            b.poll(op.key, op, True)
    results, exchanges = read_all(books, n=600, policy="best_effort")
    assert exchanges == 2 and all(stops(v) == [op.key for op in ops[:500]] for v in results)


def test_an_overflow_exchange_of_another_kind_is_named():
    """An overflow exchange that pairs with something else (another chunk, a
    section) stops before any verdict."""
    book = Book()
    for k in range(VOTE_SLOTS + 3):
        book.poll(k, Op(k), False)
    values, ballot = book.close(PASS, 0, "timeout")
    wrong = [0] * OVERFLOW_LAYOUT
    with pytest.raises(PeerMismatch, match="ranks disagree"):
        book.read(ballot, values, lambda v: wrong)


def test_an_interval_is_voted_on_once_then_starts_afresh():
    book = Book()
    op = Op(0)
    book.poll(0, op, True)
    first, b1 = book.close(PASS, 1, "timeout")
    second, b2 = book.close(PASS + 1, 1, "timeout")  # not reached in the next walk
    never = lambda v: pytest.fail("no exchange below the slots")  # noqa: E731
    assert stops(book.read(b1, first, never)) == [0] and book.read(b2, second, never) == []
    assert (b1.pass_no, b2.pass_no) == (PASS, PASS + 1)


def test_best_effort_stops_what_every_rank_reached():
    books = [Book(), Book()]
    x, y = Op("x"), Op("y")
    books[0].poll("x", x, True)
    books[1].poll("x", x, True)
    books[0].poll("y", y, True)  # rank 1's walk stopped before y
    results, _ = read_all(books, n=2, policy="best_effort")
    assert len(results) == 2 and all(stops(v) == ["x"] for v in results)


@pytest.mark.parametrize(
    "mine, theirs, said",
    [
        ((3, "timeout"), (2, "timeout"), "number of ongoing storage prefetch"),
        ((1, "timeout"), (1, "best_effort"), "prefetch policy differs"),
    ],
)
def test_different_ongoing_counts_or_policies_stop_before_any_verdict(mine, theirs, said):
    a, b = Book(), Book()
    va, ba = a.close(PASS, *mine)
    vb, _ = b.close(PASS, *theirs)
    with pytest.raises(PeerMismatch, match=said):
        a.read(ba, reduced(va, vb), lambda v: v)


def test_walks_that_reached_different_requests_stop_naming_the_position():
    a, b = Book(), Book()
    a.poll(("r1", 0), Op(1), False)
    b.poll(("r2", 0), Op(2), False)
    va, ba = a.close(PASS, 2, "timeout", "of forward 7")
    vb, _ = b.close(PASS, 2, "timeout", "of forward 7")
    with pytest.raises(PeerMismatch, match="reached different requests at position 1") as e:
        a.read(ba, reduced(va, vb), lambda v: v)
    assert "rid='r1'" in str(e.value) and "of forward 7" in str(e.value)


def lines_run(fn) -> int:
    """Lines of protocol/votes.py executed by ``fn()``: a cost that does not
    depend on how fast the box is."""
    count = [0]
    path = inspect.getfile(VoteBook)

    def trace(frame, event, arg):
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            count[0] += 1
        return trace

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0]


def walk_of(n: int):
    def run():
        book = Book()
        for k in range(n):
            book.poll(k, None, False)

    return run


def test_a_walk_costs_the_same_per_reach_however_long_it_is():
    """47's finding 5: poll used to recount the carried reaches on every call
    (quadratic past the slots). Lines run per reach stay the same from 500 to
    4000 reaches."""
    small, large = lines_run(walk_of(500)), lines_run(walk_of(4000))
    assert small > 0
    assert large <= 8 * small + 10


def test_the_cost_check_sees_a_quadratic_walk():
    """Negative control of the cost check: a poll that scans the book each time."""

    class Scanning(VoteBook):
        def poll(self, key, op, expired):
            sum(1 for r in self.reaches if r.expired)  # the old recount
            super().poll(key, op, expired)

    def walk(n):
        def run():
            book = Scanning()
            for k in range(n):
                book.poll(k, None, False)

        return run

    path = inspect.getfile(VoteBook)
    count = [0]

    def trace(frame, event, arg):
        if event == "line" and frame.f_code.co_filename in (path, __file__):
            count[0] += 1
        return trace

    costs = []
    for n in (500, 4000):
        count[0] = 0
        sys.settrace(trace)
        try:
            walk(n)()
        finally:
            sys.settrace(None)
        costs.append(count[0])
    assert costs[1] > 8 * costs[0] + 10


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
    books = (Book(), Book())
    for book, admitted in zip(books, (left, right)):
        for rid, prefix, extend in admitted:
            book.admit((rid, 0), prefix, extend)
    out = [book.close(PASS, 0, "timeout", "of forward 3") for book in books]
    group = reduced(*(values for values, _ in out))
    for rank, (book, (_, ballot)) in enumerate(zip(books, out)):
        with pytest.raises(BatchMismatch, match="SGLang #30760") as err:
            book.read(ballot, group, lambda v: v)
        msg = str(err.value)
        assert first in msg and "scheduling pass of forward 3" in msg, msg
        if mine is not None:
            assert mine[rank] in msg, msg


def test_the_same_admissions_in_the_same_order_pass():
    books = (Book(), Book())
    for book in books:
        for rid in ("x", "y", "z"):
            book.admit((rid, 0), 2, 5)
    results, _ = read_all(books)
    assert len(results) == 2 and all(v == [] for v in results)
