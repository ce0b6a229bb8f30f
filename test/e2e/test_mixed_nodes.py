"""Two nodes on loopback, one configured otherwise: both must stop, and the
pipelining node must say why (never serve on pops the ranks disagree on).

TP=2 over two "nodes" (--nnodes 2, one rank each) on 127.0.0.1: node 0
pipelines; node 1 runs SGLang's blocking path, or only its prefetch votes.
"""

from __future__ import annotations

import time

import pytest

from hicache_async_ack.env import PREFETCH_VOTES_VAR
from hicache_async_ack_lab.cpu_server import Server, free_port

from support.e2e_servers import BASE_ARGS, START_TIMEOUT_S, STOCK_ENV

pytestmark = pytest.mark.e2e

# Generous: two ranks import SGLang on a loaded box before the first step.
STOP_WITHIN_S = START_TIMEOUT_S


@pytest.mark.parametrize(
    "node1_env, storage, cause",
    [
        # The plugin disabled on node 1: the ack sync's first exchange names it.
        (STOCK_ENV, False, "HiCacheAckSyncMismatch: HiCache ack sync"),
        # Only the prefetch votes off on node 1 (a storage backend attached): node 1
        # keeps SGLang's storage path (storage_without_votes, 0.2.0) and its votes run
        # their own first exchange, which node 0's ack sync names by its protocol.
        ({PREFETCH_VOTES_VAR: "0"}, True, f"{PREFETCH_VOTES_VAR} is off there"),
    ],
    ids=["plugin-disabled", "prefetch-votes-off"],
)
def test_a_node_configured_otherwise_stops_both_and_the_cause_is_named(
    tmp_path, node1_env, storage, cause
):
    dist = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank, env in ((0, {}), (1, node1_env)):
        args = [*BASE_ARGS, "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist]
        env = dict(env)
        if storage:
            args += ["--hicache-storage-backend", "file"]
            env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(tmp_path / f"storage{rank}")
        nodes.append(Server(args, env=env, log_path=tmp_path / f"node{rank}.log", wait=False))
    try:
        for node in nodes:
            node.start()
        # No gloo timeout is lowered: the plugin must name the cause before any.
        deadline = time.monotonic() + STOP_WITHIN_S
        while time.monotonic() < deadline and not all(n.exited() for n in nodes):
            if not nodes[0].exited():
                _poke(nodes[0])  # steps with traffic, if it ever serves
            time.sleep(2.0)
        logs = [n.log() for n in nodes]
        assert len(nodes) == 2  # all() below is over both nodes, never over none
        assert all(n.exited() for n in nodes), "a node still runs:\n" + logs[0][-3000:]
        # Node 0 pipelines, and knows: its log says why.
        assert cause in logs[0], logs[0][-4000:]
        if storage:  # and node 1's votes name the same setting from their side
            said = f"{PREFETCH_VOTES_VAR} is on there and off here"
            assert said in logs[1], logs[1][-4000:]
    finally:
        for node in nodes:
            node.stop()


def _poke(node: Server) -> None:
    try:
        reply = node.generate("alpha beta gamma " * 20, max_new_tokens=4, timeout=10)
    except OSError:
        return
    # A reply here means a step ran on disagreeing ranks and nothing stopped it.
    pytest.fail(f"the mixed group served a request: {reply}")
