"""The negative control of the end-to-end correctness checks: they must fail on a
server whose KV copies are broken.

One cpu-server configured as test_server.py's plugin server (TP=2, write-through,
file storage, skewed acks), but with the direct-copy stand-in broken on purpose
(``HICACHE_ASYNC_ACK_CPU_BREAK_COPIES``: ``noop`` copies nothing between device and
host, so every host or storage hit brings back stale KV). The very helpers those
tests assert with (e2e_servers.run_sequence, flush_and_resend, compare) must report
mismatches here, on answers that did use restored KV; a check that passes on a
broken cache proves nothing.
"""

from __future__ import annotations

import pytest

from support.e2e_servers import (
    RESENT,
    SEQUENCE,
    STORAGE_ARGS,
    assert_cache_dependent,
    compare,
    flush_and_resend,
    run_sequence,
    serve,
    storage_env,
)

pytestmark = pytest.mark.e2e

MODE = "noop"


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broken")
    yield from serve(
        tmp, f"broken-{MODE}", STORAGE_ARGS, env=storage_env(tmp), skew="0,3", break_copies=MODE
    )


@pytest.fixture(scope="module")
def sequence(broken_server):
    return run_sequence(broken_server)


def test_the_server_says_its_copies_are_broken(broken_server):
    assert f"KV copies BROKEN ON PURPOSE (HICACHE_ASYNC_ACK_CPU_BREAK_COPIES={MODE})" in (
        broken_server.log()
    )


def test_host_hits_on_broken_copies_are_caught(sequence):
    assert_cache_dependent(sequence)  # first answers are prefills: right, as ever
    first, resent = sequence[:RESENT], sequence[len(SEQUENCE) :]
    result = compare(first, resent)
    print(f"negative control, host hits: {result}")
    assert any(r.host > 0 for r in resent), f"nothing came back from host: {result}"
    assert result.mismatches, f"the checks passed on broken copies: {result}"
    assert_only_restored_ones_differ(first, resent)


def test_storage_hits_on_broken_copies_are_caught(broken_server, sequence):
    replies = flush_and_resend(broken_server)
    result = compare(sequence[:RESENT], replies)
    print(f"negative control, storage hits: {result}")
    assert any(r.storage > 0 for r in replies), f"nothing came back from storage: {result}"
    assert result.mismatches, f"the checks passed on broken copies: {result}"
    assert_only_restored_ones_differ(sequence[:RESENT], replies)


def assert_only_restored_ones_differ(first, again) -> None:
    # What is caught is the broken copy, not something else: an answer recomputed or
    # kept on device is right on this server too.
    for a, b in zip(first, again):
        if compare([a], [b]).mismatches:
            assert b.restored > 0, (a, b)
