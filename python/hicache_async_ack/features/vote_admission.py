"""The prefetch votes' hooks on SGLang's scheduler side: what the batch admits
(for the admission check: SGLang #30760) and how the scheduler numbers the
pass (for the messages).

Every request the prefill adder admits goes through
``PrefillAdder._account_prefill_cache_admission`` (new requests, DLLM ones),
with its prefix length and its extend end; a chunked request's next chunk
through ``PrefillAdder.add_chunked_req``. Each is noted as (request, prefix
length, extend length) in the pass's section: ranks whose batches differ in a
request, or only in how much of it they take from the cache, stop by name.
The scheduler numbers its passes by the forward each one runs
(``Scheduler.forward_ct``, the batch's ``forward_iter``): the messages say that
number.
"""

from __future__ import annotations

from typing import Optional

from .vote_apply import operation_key

ADDER_CLASS = "sglang.srt.managers.schedule_policy.PrefillAdder"
SCHEDULER_CLASS = "sglang.srt.managers.scheduler.Scheduler"
ADMISSION_HOOKED = ("_account_prefill_cache_admission", "add_chunked_req")


def note(feature, cache, req, prefix_len: int) -> None:
    state = feature.state_of(cache) if cache is not None else None
    if state is not None and state.active:
        extend = int(getattr(req, "extend_end", prefix_len) or prefix_len) - int(prefix_len)
        state.book.admit(operation_key(req.cache_request_handle), prefix_len, extend)


def declare(feature) -> None:
    """Declare these hooks on ``feature`` (the prefetch votes)."""

    @feature.hook(ADDER_CLASS, "_account_prefill_cache_admission", "AFTER")
    def after_account_prefill_cache_admission(result, adder, req, prefix_len, *a, **kw):
        """PrefillAdder._account_prefill_cache_admission, AFTER.
        Why: the adder calls it for every request it admits, in order.
        How: notes (request, prefix length, extend length) for the section.
        Stands down: outside a held interval."""
        note(feature, getattr(adder, "tree_cache", None), req, prefix_len)
        return result

    @feature.hook(ADDER_CLASS, "add_chunked_req", "AFTER")
    def after_add_chunked_req(result, adder, req, *a, **kw):
        """PrefillAdder.add_chunked_req, AFTER.
        Why: a chunked request's next chunk joins the batch here, without the
        admission accounting.
        How: notes it as above when it joined (it is the adder's last request).
        Stands down: outside a held interval, or when the chunk did not fit."""
        admitted = getattr(adder, "can_run_list", None) or ()
        if admitted and admitted[-1] is req:
            note(feature, getattr(adder, "tree_cache", None), req, int(req.prefix_len))
        return result

    @feature.hook(SCHEDULER_CLASS, "_process_hicache_events", "BEFORE")
    def before_process_hicache_events(scheduler, *a, **kw):
        """Scheduler._process_hicache_events, BEFORE.
        Why: the pass boundary; the scheduler numbers the pass by its forwards.
        How: keeps that number for the pass's messages.
        Stands down: never changes anything."""
        cache = getattr(scheduler, "tree_cache", None)
        state = feature.state_of(cache) if cache is not None else None
        if state is not None:
            ct = getattr(scheduler, "forward_ct", None)
            state.label = None if ct is None else forward_label(int(ct))
        return None


def forward_label(forward_ct: int) -> str:
    """The walk after a boundary builds the batch of the scheduler's next forward."""
    return f"of forward {forward_ct + 1} (the scheduler's forward_ct, batch.forward_iter)"


def hooks_missing() -> Optional[str]:
    """Why the admission hooks are not in place, or None."""
    from ..kit.hooks import unhooked
    from ..names import VOTES

    try:
        from sglang.srt.managers.schedule_policy import PrefillAdder
    except Exception as exc:  # no scheduler module: nothing admits here
        return f"sglang.srt.managers.schedule_policy cannot be imported ({exc!r})"
    return unhooked(PrefillAdder, ADMISSION_HOOKED, VOTES)
