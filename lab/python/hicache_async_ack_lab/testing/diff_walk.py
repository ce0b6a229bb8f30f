"""The waiting-queue walk of one differential pass (:mod:`.diff_scheduler`), as
SGLang 0.5.23's ``Scheduler._get_new_batch_prefill_raw`` runs it, through its own
pieces: the queue ordered by ``SchedulePolicy.calc_priority`` (fcfs, lpm,
dfs-weight, priority scheduling), a real ``PrefillAdder`` (``budget_state``,
``add_one_req``: the token budget, the refusal, the host load-back, the admission
accounting), ``check_prefetch_progress`` for every request the walk reaches,
``pop_prefetch_loaded_span``, ``Req.init_next_round_input`` and
``Scheduler._prefetch_after_device_hit_loss``.

Its body is written here, not called: the method builds a ``ScheduleBatch`` and
reads the model runner, the grammar, LoRA, the prefill delayer and chunked
prefill, none of which the prefetch path touches. What limits the walk is
recorded: a spent token budget (``budget_state``, or the admission that spent it),
a full batch (the running requests allowed), a refusal (``add_one_req`` answered
otherwise for a request it did not admit), and the arrival-based limits a
scenario draws (a full pass, a cutoff by arrival).
"""

from __future__ import annotations

from hicache_async_ack_lab.sim.lifecycle import handle_key
from hicache_async_ack_lab.sim.sched_shim import new_adder


def walk(sched, p: int) -> list:
    """One pass's walk; returns the requests it admitted."""
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.managers.scheduler import Scheduler as Upstream

    shim, cache, lim = sched.shim, sched.cache, sched.limits_spec
    if p in lim.get("full", ()) or not shim.waiting_queue:
        return []
    cutoff = lim.get("cutoff", {}).get(str(p))
    running = [req for req, _ in sched.running.values()]
    allocatable = None if lim.get("running") is None else lim["running"] - len(running)
    shim.policy.calc_priority(shim.waiting_queue, None)
    adder = new_adder(shim, running, lim.get("tokens"))
    storage = shim.enable_hicache_storage
    for req in list(shim.waiting_queue):
        key = handle_key(req.cache_request_handle)
        if cutoff is not None and sched.arrived[req.rid] >= cutoff:
            sched.limits.append((p, "cutoff", key))
            break  # the batch is full from here on (by arrival)
        if adder.budget_state() == AddReqResult.OTHER:
            sched.limits.append((p, "token_budget", key))
            break
        if allocatable is not None and len(adder.can_run_list) >= allocatable:
            sched.limits.append((p, "batch_full", key))
            break
        if storage:
            if not cache.check_prefetch_progress(req.cache_request_handle):
                continue
            loaded, start = cache.pop_prefetch_loaded_span(req.cache_request_handle)
            if loaded > 0:
                req.storage_hit_length, req.storage_hit_start = loaded, start
                req.host_hit_is_storage = False
                sched.popped[key] = loaded  # kept across a refused admission
        req.init_next_round_input(cache)
        if storage and Upstream._prefetch_after_device_hit_loss(shim, req):
            sched.record.add(key, "requery")
            continue
        host = req.host_hit_length  # what the load-back promises from the host
        sched.record.admitting = True  # its accounting's exit is the admission's
        try:
            res = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        finally:
            sched.record.admitting = False
        added = bool(adder.can_run_list) and adder.can_run_list[-1] is req
        if added:
            host = min(host, req.host_loaded_length) if host > 0 else 0
            sched.admitted(req, p, sched.popped.pop(key, 0), host)
        if res != AddReqResult.CONTINUE:
            sched.limits.append((p, "token_budget" if added else "refused", key))
            break
    admitted = list(adder.can_run_list)
    if storage:
        for req in admitted:
            cache.storage_prefetch_retries.cancel(req.rid)
    taken = set(map(id, admitted))
    shim.waiting_queue = [r for r in shim.waiting_queue if id(r) not in taken]
    return admitted
