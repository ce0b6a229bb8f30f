"""Two nodes on loopback, one with the plugin disabled: both must stop, and the
pipelining node must say why (never serve on pops the ranks disagree on).

TP=2 over two "nodes" (--nnodes 2, one rank each) on 127.0.0.1: node 0
pipelines, node 1 runs SGLang's blocking path (SGLANG_ENABLE_..._SYNC=0).
"""

from __future__ import annotations

import time

import pytest

from hicache_async_ack.testing.cpu_server import Server, free_port

from e2e_servers import BASE_ARGS, START_TIMEOUT_S, STOCK_ENV

pytestmark = pytest.mark.e2e

# Generous: two ranks import SGLang on a loaded box before the first step.
STOP_WITHIN_S = START_TIMEOUT_S


def test_node_without_the_plugin_stops_both_and_the_pipelining_node_names_it(tmp_path):
    tmp = tmp_path
    dist = f"127.0.0.1:{free_port()}"
    # A low gloo timeout of SGLang's own would only hide the cause; the plugin
    # must name it before any timeout.
    nodes = [
        Server(
            [*BASE_ARGS, "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist],
            env=env,
            log_path=tmp / f"node{rank}.log",
            wait=False,
        )
        for rank, env in ((0, {}), (1, STOCK_ENV))
    ]
    try:
        for node in nodes:
            node.start()
        deadline = time.monotonic() + STOP_WITHIN_S
        while time.monotonic() < deadline and not all(n.exited() for n in nodes):
            if not nodes[0].exited():
                _poke(nodes[0])  # steps with traffic, if it ever serves
            time.sleep(2.0)
        logs = [n.log() for n in nodes]
        assert all(n.exited() for n in nodes), "a node still runs:\n" + logs[0][-3000:]
        assert "HiCacheAckSyncMismatch" in logs[0], logs[0][-4000:]
        assert "pipelin" in logs[0].split("HiCacheAckSyncMismatch", 1)[1][:2000]
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
