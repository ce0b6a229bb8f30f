"""The pipelined reduce goes through torch.distributed.all_reduce, as upstream's
blocking one does: whatever wraps or patches it (tracing, fault injection,
SGLang-style unit tests with a stand-in group) sees our collective too."""

from __future__ import annotations

from hicache_async_ack.sglang_plugin import Collectives


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True
        return True

    def is_completed(self):
        return True


def test_the_collective_goes_through_torch_distributed_all_reduce(monkeypatch):
    import torch.distributed as dist

    calls, works = [], []

    def traced(tensor, op=None, group=None, async_op=False):
        calls.append((tensor.tolist(), op, group, async_op))
        works.append(_Work())
        return works[-1]

    monkeypatch.setattr(dist, "all_reduce", traced)
    group = object()  # a stand-in group, as SGLang-style unit tests pass
    issue = Collectives().async_min(group)  # torch's, the default
    handle = issue([2, 0, 9, -9])
    assert calls == [([2, 0, 9, -9], dist.ReduceOp.MIN, group, True)]
    assert handle.is_completed() and handle.wait() == [2, 0, 9, -9]
    assert works[0].waited
    issue([1, 1, 9, -9])  # the next one, into another preallocated tensor
    assert [c[0] for c in calls] == [[2, 0, 9, -9], [1, 1, 9, -9]]
    assert handle.wait() == [2, 0, 9, -9]  # not refilled while it may be in flight
