"""What a decode engine compiles: its buckets and its whole program set (the runner's, and
the KV page writes imported KV takes), shared with `megaserve kernels compile-worker`."""

from __future__ import annotations

from dataclasses import replace

import structlog

from decode_service.scheduler import SchedulerConfig
from kernels.kv_cache import KVPool
from kernels.programs import Program
from megaserve.runner.base import Runner
from megaserve.runner.buckets import StepConfig

log = structlog.get_logger("megaserve.decode")


def step_config(sc: SchedulerConfig, max_running: int, max_pages_per_seq: int) -> StepConfig:
    """The decode tier's buckets: decode batches up to max_running; a prefill call takes
    pieces of up to `prefill_rows` sequences (no more than max_running, nor than the
    budget, `prefill_chunk` tokens, gives the smallest token bucket each)."""
    step = StepConfig.for_limits(max_running, sc.prefill_chunk, max_pages_per_seq)
    rows = min(sc.prefill_rows, max_running, sc.prefill_chunk // step.token_buckets[0])
    return replace(step, prefill_rows=max(rows, 1))


def engine_programs(runner: Runner, pool: KVPool, max_pages_per_seq: int) -> list[Program]:
    """Every program a decode engine can run: the runner's (prefill only at the shapes the
    token budget lets the scheduler ask for: `StepConfig.prefill_in_budget`), its prompt
    log-probability prefill (in the set: serving compiles nothing; one row: a scored
    sequence runs in a call of its own), and the KV page writes that imported KV takes (any
    reservation size up to a whole sequence)."""
    sc = runner.step_cfg
    own = [
        p
        for p in runner.programs()
        if p.name != "prefill" or sc.prefill_in_budget(p.key[0], p.key[1])
    ]
    scoring = [p for p in runner.logprob_programs() if p.key[0] == 1]
    return own + scoring + pool.page_programs(max_pages_per_seq, read=False, write=True)


def fit_running(runner: Runner, sc: SchedulerConfig) -> SchedulerConfig:
    """The scheduler config with max_running lowered to what one decode call can take:
    requests beyond it wait in the queue (bounded by max_waiting, then refused)."""
    most, why = runner.max_batch()
    if most >= sc.max_running:
        return sc
    log.warning("max_running lowered", requested=sc.max_running, to=most, why=why)
    return replace(sc, max_running=most)
