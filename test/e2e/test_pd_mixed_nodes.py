"""A PD decode server over two nodes, the plugin off on one: both nodes must stop, and
the pipelining node must say why (never pop on counts the ranks disagree on).

Decode TP=2 over two "nodes" (--nnodes 2, one rank each) on 127.0.0.1, in a PD pair's
private network namespace (cpu_server/pd.py), with KV offload to a file store: node 0
pipelines the offload progress, node 1 runs SGLang's blocking reduce. The decode loop
checks offload progress every pass, requests or not, so no prefill is needed: the
first pass meets the one-time agreement.
"""

from __future__ import annotations

import time

import pytest

from hicache_async_ack_lab.cpu_server.pd import PDPair

from support.e2e_servers import START_TIMEOUT_S, STOCK_ENV

pytestmark = pytest.mark.e2e

STOP_WITHIN_S = START_TIMEOUT_S  # two ranks import SGLang on a loaded box first
# The message, not the exception's class name (the runtime names its own classes).
CAUSE = "HiCache decode offload sync: this node pipelines, a peer does not"
MISMATCH = "Mismatch: " + CAUSE  # raised as a mismatch, whatever its class is called


def test_a_decode_node_without_the_plugin_stops_both_and_is_named(tmp_path):
    pd = PDPair(workdir=tmp_path / "pd", decode_nodes=[{}, dict(STOCK_ENV)])
    try:
        pd.start(wait=False)  # the two decode nodes only
        nodes = pd.decode_nodes
        assert len(nodes) == 2  # all() below is over both nodes, never over none
        deadline = time.monotonic() + STOP_WITHIN_S
        while time.monotonic() < deadline and not all(n.exited() for n in nodes):
            time.sleep(2.0)
        logs = [n.log() for n in nodes]
        assert all(n.exited() for n in nodes), "a node still runs:\n" + logs[0][-3000:]
        # Node 0 pipelines, and knows: its log names the cause.
        assert MISMATCH in logs[0], logs[0][-4000:]
        assert "Enable offload kv cache for decode side" in logs[1]  # node 1 got that far
    finally:
        pd.stop()
