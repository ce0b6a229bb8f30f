"""``hicache-async-ack-lab bench``: what the blocking ack-count reduce costs on this
host, and what the plugin gives back.

TP scheduler-like ranks run as separate processes over real gloo on 127.0.0.1
(:mod:`..ranks`), each driving SGLang's real ``check_hicache_events`` on a cache
built by :mod:`hicache_async_ack_lab.sim.cache`. The package reads top down:
:mod:`.workload` (what each arm runs), :mod:`.rank_loop` (one rank's step loop),
:mod:`.summary` (figures and table), :mod:`.plot` (PNG), :mod:`.driver` (options,
arms back to back, report).
"""
