"""The buffer_only host mode's staging, as far as the prefetch lifecycle of
:mod:`.lifecycle` needs it: the hit-sized bounce is allocated when the hit
answer is drained (parked while the pool is busy, as upstream's pipeline
parks it), filled by the read, staged when the read completes, and held
once its request is admitted (the load-back owns it then). Test support."""

from __future__ import annotations

from collections import deque


class BufferStage:
    """Stands in for SGLang's BufferModePipeline on the lifecycle's cache."""

    def __init__(self, cache, record):
        self._cache = cache
        self.record = record
        self.pending_hit_allocs: deque = deque()
        self.staged_prefetches: dict = {}  # handle -> (host indices, occupied)
        self.ongoing_write_through: dict = {}

    # -- what the cache calls on the prefetch path
    def has_staged(self, request) -> bool:
        return request in self.staged_prefetches

    def set_prefix_ctx(self, request, matched_prefix_tokens, extra_key=None, cache_salt=None):
        pass

    def pop_prefix_ctx(self, request) -> None:
        pass

    def release_anchor_lock(self, request) -> None:
        pass

    def try_lock_anchor(self, request, remaining_full_tokens: int):
        return "locked", 0

    def staged_span_covered(self, request, span_tokens: int) -> bool:
        return False

    def allocate_and_queue_prefetch(self, operation, info, hit_tokens, aux_hit_tokens) -> bool:
        """False parks the operation (upstream retries it at the next drain)."""
        cache = self._cache
        cc = cache.cache_controller
        host, alloc_len = cc.allocate_storage_hit(
            operation,
            hit_tokens,
            allow_partial=False,
            min_tokens=cache.prefetch_threshold,
            evict_host=cache.evict_host,
        )
        if host is None:
            return False
        request = operation.handle
        operation.storage_hit_count = alloc_len
        operation.hash_value = operation.hash_value[:alloc_len]
        operation.host_indices = host
        cache.ongoing_prefetch[request] = info._replace(host_indices=host)
        operation.buffer_host_occupied_units = len(host)
        cc.prefetch_tokens_occupied += len(host)
        cc.prefetch_buffer.put(operation)
        return True

    def stage_completed_prefetch(self, request, num_tokens: int, hash_value) -> bool:
        cache = self._cache
        cc = cache.cache_controller
        info = cache.ongoing_prefetch.pop(request)
        occupied = info.operation.buffer_host_occupied_units or 0
        self.record.add((request.rid, request.attempt_id), "staged", num_tokens)
        if num_tokens == 0:
            cache.discard_storage_prefetch_accounting(request)
            cc.append_host_mem_release(info.host_indices[:0])
            cc.prefetch_tokens_occupied -= occupied
            cache.prefetch_loaded_tokens_by_reqid[request] = 0
            return True
        self.staged_prefetches[request] = (info.host_indices[:num_tokens], occupied)
        cache.prefetch_loaded_tokens_by_reqid[request] = num_tokens
        cache.prefetch_loaded_storage_start_by_reqid[request] = info.operation.storage_start
        return True

    def release_staged_hold(self, request, reason=None) -> bool:
        staged = self.staged_prefetches.pop(request, None)
        if staged is None:
            return False
        cache = self._cache
        cache._finish_storage_prefetch(request, fulfilled_tokens=0, reason=reason)
        cache.cache_controller.append_host_mem_release(staged[0])
        cache.cache_controller.prefetch_tokens_occupied -= staged[1]
        return True

    # -- what the scheduler and the cache's pass call
    def consume(self, request) -> None:
        """Admission: the load-back takes the staged bounce (held from here on)."""
        self.staged_prefetches.pop(request, None)

    def flush_pending_writes(self) -> None:
        pass

    def finish_storage_write_ack(self, operation_id) -> None:
        pass

    def reset(self) -> None:
        self.pending_hit_allocs.clear()
        self.staged_prefetches.clear()
