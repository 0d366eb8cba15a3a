"""The decode worker's model and engine, built alike by a serving process and by the
followers of a multi-host group (the same programs over one mesh)."""

from __future__ import annotations

from decode_service.config import WorkerConfig
from decode_service.engine import DecodeEngine
from megaserve.model import LoadedModel, serving_dtype


def build_engine(cfg: WorkerConfig) -> tuple[LoadedModel, DecodeEngine]:
    """The model and engine (not started), every program compiled with --warm-up all."""
    e = cfg.engine
    model = LoadedModel.load_for(
        cfg.checkpoint, serving_dtype(cfg.dtype), e.backend, e.page_size, parallel=e.parallel
    )
    engine = DecodeEngine(model, cfg.engine)
    if cfg.warm_up:
        engine.warm_up()
    return model, engine
