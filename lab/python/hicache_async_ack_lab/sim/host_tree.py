"""The tree core under the differential's real ``UnifiedRadixCache``: a radix tree
of token segments, each node resident on the device, backed on the host, or both,
as far as the prefetch lifecycle and the scheduler's matching touch it.

Test support (:mod:`hicache_async_ack_lab.testing.differential`). SGLang's own
``UnifiedTreeCore`` needs the device pools, the components and their allocators;
this stands in for it with the same answers on what the lifecycle reads:

* ``match_prefix``: the path of nodes matching the key, page by page, a node split
  where the key leaves it (as upstream splits); the device prefix is the run of
  device-resident nodes from the root, ``best_match_node`` (the prefetch anchor,
  ``last_host_node``) the deepest matched node, ``host_hit_length`` the tokens past
  the device prefix, backed on the host;
* ``insert_host(anchor, key, ...)``: the key inserted *under the anchor*; nodes
  already backed count as the prefix (upstream frees the caller's copy of those),
  a device-only node on the way takes its host pages;
* locks: host locks (a prefetch anchor, a pin) and device locks (``lock``: a
  running request's path) protect a node; host eviction takes leaves only, host-only,
  unlocked, oldest first (creation order, not LRU: the walk's matches would
  otherwise move the victims with timing the contract lets move); device eviction
  takes unlocked device leaves, a backed node staying on the host;
* ``dfs_weight_order`` through upstream's own ``_dfs_weight_order`` on these nodes.

Tokens are page-aligned (``page_size``); host pages come from the lifecycle's
:class:`~hicache_async_ack_lab.sim.lifecycle.HostPool`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hicache_async_ack_lab.sim.cache import SimTreeCore

ROOT = 0


class SimViolation(AssertionError):
    """The lifecycle broke an invariant SGLang relies on (a double free, a
    release of pages never allocated, a lock released more than taken)."""


@dataclass(eq=False)
class TreeNode:
    id: int
    parent: Optional["TreeNode"]
    tokens: tuple  # this node's own segment
    host: Any = None  # host indices (a tensor), or None
    written: bool = False  # backed without pages of the pool (a warm write-through)
    device: bool = False
    key: Any = None  # who put it there: a request's (rid, attempt), or a name
    origin: str = "prefetch"  # prefetch, cold, warm
    host_locks: int = 0
    locks: int = 0  # device locks (a running request's path)
    children: dict = field(default_factory=dict)  # first page -> TreeNode
    born: int = 0  # creation order of its segment (a split's head keeps it)

    @property
    def backed(self) -> bool:
        return self.host is not None or self.written


class Tally(dict):
    """Tokens per owner, in first-seen order: one record per owner and eviction
    (however often matches split its nodes, which differs between runs)."""

    def add(self, key: Any, n: int) -> None:
        self[key] = self.get(key, 0) + n


class HostTree(SimTreeCore):
    """The tree core's answers (module docstring)."""

    def __init__(self, record, page_size: int = 1, exposed: bool = False):
        super().__init__()
        self.record = record
        self.page_size = page_size
        self.exposed = exposed  # a prefetched node may be evicted from the host
        self.is_eagle = False
        self.has_swa_host_pool = False
        self.owner: Any = None  # the request whose prefetch result is being inserted
        self.root = TreeNode(ROOT, None, (), device=True, written=True)
        self.nodes: dict[int, TreeNode] = {ROOT: self.root}
        self._next = ROOT + 1

    # -- structure
    def node_by_id(self, node_id) -> TreeNode:
        return self.nodes[node_id]

    def _new(self, parent: TreeNode, tokens: tuple, **kw) -> TreeNode:
        node = TreeNode(self._next, parent, tokens, born=self._next, **kw)
        self._next += 1
        self.nodes[node.id] = node
        parent.children[tokens[: self.page_size]] = node
        return node

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (a page boundary): the head is a new node."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.tokens)
        del parent.children[node.tokens[: self.page_size]]
        # the original id keeps the deeper part (anchors and matches name a path's
        # end); the head is on every path through it, so it carries its device locks
        head = TreeNode(self._next, parent, node.tokens[:at], written=node.written,
                        device=node.device, key=node.key, origin=node.origin,
                        locks=node.locks, born=node.born)  # fmt: skip
        self._next += 1
        if node.host is not None:
            head.host, node.host = node.host[:at].clone(), node.host[at:].clone()
        self.nodes[head.id] = head
        parent.children[head.tokens[: self.page_size]] = head
        node.tokens, node.parent = node.tokens[at:], head
        head.children[node.tokens[: self.page_size]] = node
        return head

    def _common(self, a: tuple, b: tuple) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n // self.page_size * self.page_size

    def _walk(self, start: TreeNode, tokens: tuple) -> tuple[list[TreeNode], int]:
        """The nodes under ``start`` matching ``tokens`` (split where the key leaves
        one), and how many tokens they cover."""
        node, at, path = start, 0, []
        while at < len(tokens):
            child = node.children.get(tokens[at : at + self.page_size])
            if child is None:
                break
            n = self._common(child.tokens, tokens[at:])
            if n == 0:
                break
            if n < len(child.tokens):
                child = self._split(child, n)
            path.append(child)
            at += n
            node = child
        return path, at

    def path_of(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def tokens_of(self, node: TreeNode) -> tuple:
        return tuple(t for n in self.path_of(node) for t in n.tokens)

    def _aligned(self, key) -> tuple:
        tokens = tuple(int(t) for t in key.raw_token_ids())
        return tokens[: len(tokens) // self.page_size * self.page_size]

    # -- what the cache reads
    def match_prefix(self, params):
        from sglang.srt.mem_cache.base_prefix_cache import MatchResult

        path, _ = self._walk(self.root, self._aligned(params.key))
        device, last_device = 0, self.root
        for node in path:
            if not node.device:
                break
            device, last_device = device + len(node.tokens), node
        best = path[-1] if path else self.root
        total = sum(len(n.tokens) for n in path)
        return MatchResult(device_prefix_len=device, last_device_node=last_device.id,
                           last_host_node=best.id, best_match_node=best.id,
                           host_hit_length=total - device, full_kv_hit_length=total,
                           cache_actions=[])  # fmt: skip

    @property
    def empty_match_result(self):
        from sglang.srt.mem_cache.base_prefix_cache import MatchResult

        return MatchResult(0, ROOT, ROOT, ROOT)

    def supports_fast_match_prefix(self) -> bool:
        return False

    def is_backuped(self, node_id) -> bool:
        return self.nodes[node_id].backed

    def is_root(self, node_id) -> bool:
        return node_id == ROOT

    def root_node_handle(self, extra_key=None) -> int:
        return ROOT

    @property
    def root_node(self) -> TreeNode:
        return self.root

    def get_last_hash_value(self, node_id) -> Optional[str]:
        node = self.nodes[node_id]
        return None if node_id == ROOT or not node.backed else f"h{node_id}"

    def get_prefix_hash_values(self, node_id) -> list[str]:
        return [f"h{n.id}" for n in self.path_of(self.nodes[node_id]) if n.backed]

    def prefetch_anchor_info(self, node_id):
        return None, None

    def is_full_device_evicted(self, node_id) -> bool:
        return not self.nodes[node_id].device

    def dfs_weight_order(self, node_ids) -> list[int]:
        from sglang.srt.mem_cache.base_prefix_cache import _dfs_weight_order

        return _dfs_weight_order(self.root, node_ids, self.node_by_id)

    def build_hicache_transfers(self, *args, **kwargs) -> list:
        return []

    def commit_hicache_transfers(self, *args, **kwargs) -> None:
        pass

    # -- locks
    def inc_host_lock_ref(self, node_id):
        from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult

        if node_id in self.nodes:
            self.nodes[node_id].host_locks += 1
        return IncLockRefResult(delta=0, node_id=node_id)

    def dec_host_lock_ref(self, node_id, params=None):
        from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult

        node = self.nodes.get(node_id)
        if node is not None:
            if node.host_locks <= 0:
                raise SimViolation(f"host lock of node {node_id} released more than taken")
            node.host_locks -= 1
        return DecLockRefResult(delta=0)

    def inc_lock_ref(self, node_id, skip_lock_components=()):
        from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult

        node = self.nodes.get(node_id)
        for n in [] if node is None else self.path_of(node):
            n.locks += 1
        return IncLockRefResult(delta=0, node_id=node_id)

    def dec_lock_ref(self, node_id, params=None, skip_swa=False):
        from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult

        node = self.nodes.get(node_id)
        for n in [] if node is None else self.path_of(node):
            n.locks -= 1
        return DecLockRefResult(delta=0)

    def host_locks(self) -> int:
        """Host locks held on the tree's nodes (prefetch anchors, pins)."""
        return sum(n.host_locks for n in self.nodes.values())

    def evictable_size(self) -> int:
        return sum(len(n.tokens) for n in self.nodes.values()
                   if n.device and not n.locks and n.id != ROOT)  # fmt: skip

    full_evictable_size = evictable_size

    def protected_size(self) -> int:
        return sum(len(n.tokens) for n in self.nodes.values() if n.locks and n.id != ROOT)

    # -- inserts
    def insert_host(self, node_id, key, host_value, hash_value):
        from sglang.srt.mem_cache.base_prefix_cache import InsertResult

        owner, anchor = self.owner, self.nodes.get(node_id)
        tokens = self._aligned(key)
        if not tokens or anchor is None:
            return InsertResult(prefix_len=0, total_len=len(key), mamba_exist=True)
        path, at = self._walk(anchor, tokens)
        prefix = offset = 0
        for node in path:
            n = len(node.tokens)
            if not node.backed:  # a device-only node takes its host copy
                node.host = host_value[offset : offset + n].clone()
            elif prefix == offset:
                prefix += n  # already on the host: upstream frees the caller's copy
            else:
                raise SimViolation(f"node {node.id} backed under an unbacked one")
            offset += n
        last = path[-1] if path else anchor
        if at < len(tokens):
            last = self._new(last, tokens[at:], host=host_value[at : len(tokens)].clone(),
                             key=owner)  # fmt: skip
        self.record.add(owner, "inserted", len(key), prefix)
        return InsertResult(prefix_len=prefix, total_len=len(key), inserted_host_node=last.id)

    def add_cold(self, name: str, pages) -> None:
        """Another request's cached prefix, on the host only (evictable)."""
        first = -(len(self.root.children) + 1) * 1_000_000
        self._new(self.root, tuple(range(first, first + len(pages))), host=pages,
                  key=name, origin="cold")  # fmt: skip

    def add_warm(self, name: str, tokens: tuple, pages) -> None:
        """A prefix resident on the device (``pages``: its host copy, or None)."""
        self._new(self.root, tokens, host=pages, device=True, key=name, origin="warm")

    # -- device side
    def load_back(self, node_id) -> int:
        """Admission's load-back: the path to ``node_id`` resident on the device;
        returns the tokens it loaded."""
        loaded = 0
        for node in self.path_of(self.nodes[node_id]):
            if not node.device:
                node.device, loaded = True, loaded + len(node.tokens)
        return loaded

    def evict_device(self, num_tokens: int) -> int:
        """Device pressure: unlocked device leaves go, oldest first; a backed node
        stays on the host, an unbacked one leaves the tree."""
        freed, gone = 0, Tally()
        while freed < num_tokens:
            node = next((n for n in sorted(self.nodes.values(), key=self.age)
                         if n.id != ROOT and n.device and not n.locks
                         and not any(c.device for c in n.children.values())), None)  # fmt: skip
            if node is None:
                break
            node.device = False
            freed += len(node.tokens)
            gone.add((node.key, node.backed), len(node.tokens))
            if not node.backed:
                self._remove(node)
        for (key, backed), n in gone.items():
            self.record.add(key, "device_evicted", n, backed)
        return freed

    @staticmethod
    def age(node: TreeNode) -> tuple:
        """Eviction order: oldest segment first, whatever matches split it since."""
        return (node.born, node.id)

    # -- host side
    def _remove(self, node: TreeNode) -> None:
        assert node.parent is not None and not node.children
        del node.parent.children[node.tokens[: self.page_size]]
        del self.nodes[node.id]

    def evictable(self, node: TreeNode) -> bool:
        if node.id == ROOT or node.device or node.host is None or node.children:
            return False
        if node.host_locks or node.locks:
            return False
        return node.origin == "cold" or self.exposed

    def evict(self, num_tokens: int, pool) -> int:
        freed, gone = 0, Tally()
        while freed < num_tokens:
            node = next((n for n in sorted(self.nodes.values(), key=self.age)
                         if self.evictable(n)), None)  # fmt: skip
            if node is None:
                break
            self._remove(node)
            pool.free(node.host)
            freed += len(node.host)
            gone.add(node.key, len(node.host))
        for key, n in gone.items():
            self.record.add(key, "evicted", n)
        return freed

    def reset(self) -> None:
        """``flush_cache``: the tree is empty, its locks gone with it (upstream builds
        a new root; the pool is cleared by the cache)."""
        self.root = TreeNode(ROOT, None, (), device=True, written=True)
        self.nodes = {ROOT: self.root}
