"""Run seeded scenarios on real gloo ranks (fresh processes) from a test."""

from __future__ import annotations

from hicache_async_ack.tools import Job, RanksFailed
from hicache_async_ack_lab.fresh import run_fresh

SCENARIOS = "hicache_async_ack_lab.testing.scenarios:run_specs"


def scenario_job(
    world: int,
    specs: list[dict],
    *,
    layout: dict | None = None,
    timeout: float = 900.0,
    group_timeout: float = 30.0,
    allow_exit: tuple[int, ...] = (),
    rank_env: dict[int, dict[str, str]] | None = None,
) -> Job:
    return Job(
        target=SCENARIOS,
        world_size=world,
        payload={"specs": specs, "layout": layout or {}, "group_timeout_s": group_timeout},
        timeout_s=timeout,
        label=f"{world} scenario ranks",
        group_timeout_s=group_timeout,
        rank_env=rank_env or {},
        allow_exit=allow_exit,
    )


def run_scenarios(world: int, specs: list[dict], **kwargs) -> list[dict]:
    """Every rank's results by scenario name ({} for an allowed rank that died)."""
    (out,) = run_fresh([scenario_job(world, specs, **kwargs)])
    if isinstance(out, RanksFailed):
        raise AssertionError(str(out))
    return [r or {} for r in out]
