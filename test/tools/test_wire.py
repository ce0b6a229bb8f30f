"""The version moves whenever the wire does (issue 51): ``hicache_async_ack.wire``
records, per plugin release, the fingerprint of the wire's constants and the
protocol numbers it spoke; the tree's wire must be the one recorded for
``__version__``. Negative controls: a changed constant, a new flag bit, a table
whose wire moved without its protocol, a version bumped without its row."""

from __future__ import annotations

from dataclasses import replace

from hicache_async_ack import __version__
from hicache_async_ack.protocol import PROTOCOL_VERSION
from hicache_async_ack.wire import (
    RELEASES,
    describe_protocol,
    protocol_hint,
    release,
    tie_problems,
    versions_speaking,
    wire_constants,
    wire_fingerprint,
)
from hicache_async_ack_lab import __version__ as lab_version


def test_the_wire_of_this_tree_is_the_one_recorded_for_this_version():
    assert tie_problems() == []
    row = release(__version__)
    assert row is not None and row.wire == wire_fingerprint()
    assert row.protocol == PROTOCOL_VERSION
    assert lab_version == __version__  # released together


def test_the_fingerprint_covers_every_wire_constant():
    constants = wire_constants()
    for name in (
        "stamp.PROTOCOL_VERSION",
        "stamp.DIGEST_BITS",
        "stamp.STORAGE_FLAG",
        "stamp.VOTES_FLAG",
        "stamp.OFFLOAD_CODE",
        "votes.VOTES_PROTOCOL",
        "votes.OVERFLOW_PROTOCOL",
        "votes.VOTE_SLOTS",
        "votes.ADMIT_SLOTS",
        "votes.LAYOUT",
        "votes.POLICIES",
    ):
        assert name in constants, name
    # Only what each module assigns itself: votes imports STOCK_LIMIT from stamp.
    assert "votes.STOCK_LIMIT" not in constants and "stamp.STOCK_LIMIT" in constants
    assert not any(isinstance(v, bool) for v in constants.values())


def test_a_wire_change_without_a_version_bump_fails():
    """Negative control: each change below moves the fingerprint, and the tie check
    then names the version and what to do."""
    constants = wire_constants()
    assert constants, "no wire constant found"
    changed = [
        {**constants, "stamp.PROTOCOL_VERSION": PROTOCOL_VERSION + 1},
        {**constants, "votes.VOTE_SLOTS": 512},
        {**constants, "stamp.NEW_FLAG": 9},  # a flag bit added
        {**constants, "votes.POLICIES": {**constants["votes.POLICIES"], "other": 4}},
    ]
    fingerprints = {wire_fingerprint(c) for c in changed}
    assert len(fingerprints) == len(changed) and wire_fingerprint() not in fingerprints
    for c in changed:
        problems = "\n".join(tie_problems(constants=c))
        assert f"hicache-async-ack {__version__} is recorded with" in problems, problems
        assert "bump the version" in problems and "wire.RELEASES" in problems


def test_the_table_refuses_a_wire_change_that_kept_its_protocol():
    newest = RELEASES[-1]
    moved = replace(newest, version="9.0.0", wire="0" * 16)  # same protocols
    problems = tie_problems(version="9.0.0", releases=(*RELEASES, moved))
    assert any("bump PROTOCOL_VERSION" in p for p in problems), problems
    # Control: the same row with its protocol moved on (and the tree's constants
    # describing it) is accepted.
    bumped = replace(moved, protocols=(newest.protocol + 1,))
    tree = {**wire_constants(), "stamp.PROTOCOL_VERSION": newest.protocol + 1}
    bumped = replace(bumped, wire=wire_fingerprint(tree))
    assert tie_problems(version="9.0.0", releases=(*RELEASES, bumped), constants=tree) == []


def test_a_version_without_a_row_or_out_of_order_fails():
    assert tie_problems(version="9.9.9") == [
        "no row for hicache-async-ack 9.9.9 in wire.RELEASES: add one"
    ]
    older = (RELEASES[-1], *RELEASES[:-1])
    assert any("follows" in p for p in tie_problems(releases=older))
    assert any("not the newest row" in p for p in tie_problems(releases=older))


def test_messages_name_the_releases_that_speak_a_protocol():
    assert RELEASES and all(r.protocols for r in RELEASES)
    assert versions_speaking(1) == ("0.1.0",)
    assert describe_protocol(1) == "protocol 1 (hicache-async-ack 0.1.0)"
    assert versions_speaking(PROTOCOL_VERSION)[-1] == __version__
    assert "a later release than hicache-async-ack" in describe_protocol(PROTOCOL_VERSION + 7)
    hint = protocol_hint()
    assert f"hicache-async-ack {__version__}, protocol {PROTOCOL_VERSION}" in hint
    for row in RELEASES:
        assert f"hicache-async-ack {row.version}" in hint
