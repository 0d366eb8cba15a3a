"""What the decode engine does when a step raises: the step's requests end with ERROR
(INTERNAL to their callers) and the engine goes on; a step that lost the pool ends
everything and restarts on a fresh, empty pool."""

from __future__ import annotations

import jax.numpy as jnp
import structlog

from decode_service.sequence import Sequence

log = structlog.get_logger("megaserve.decode")


class StepFailures:
    """Mixed into DecodeEngine (its pool, scheduler, allocator, sinks and reservations)."""

    def _guarded(self, seqs: list[Sequence], step, *args) -> None:
        """Runs one step; if it raises, its requests end with ERROR (INTERNAL to their
        callers) and the engine goes on. A step that lost the pool (its donated buffers are
        gone) ends every live request and reservation and starts from a fresh, empty pool."""
        try:
            step(*args)
        except Exception as e:
            self.step_failures += 1
            msg = f"{step.__name__.strip('_')} failed: {type(e).__name__}: {e}"
            lost = self.pool.k.is_deleted() or self.pool.v.is_deleted()
            log.exception("step failed", requests=[s.request_id for s in seqs], pool_lost=lost)
            for s in list(self._live.values()) if lost else seqs:
                if s.request_id in self._live:
                    self._fail(s, msg)
            if lost:
                self._reset_pool()

    def _reset_pool(self) -> None:
        for rid in list(self.reservations.open):
            self.reservations.drop(rid)
        self.pool.k = jnp.zeros(self.pool.k.shape, self.pool.k.dtype)
        self.pool.v = jnp.zeros(self.pool.v.shape, self.pool.v.dtype)
        dropped = self.alloc.drop_cache()
        log.warning("pool reset", dropped_blocks=dropped)
