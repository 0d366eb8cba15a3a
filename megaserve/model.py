"""A loaded model: family code, static config, device weights, tokenizer and EOS ids."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import structlog

from kernels.llama import LlamaConfig
from kernels.registry import family_for
from megaserve.checkpoint import Checkpoint, load_checkpoint
from megaserve.choices import DTYPE_CHOICES
from megaserve.errors import CheckpointError
from megaserve.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from megaserve.parallel.mesh import ParallelConfig

log = structlog.get_logger("megaserve.model")


def serving_dtype(name: str = "auto") -> Any:
    """Weights and KV dtype for --dtype: `auto` is bf16 on TPU, f32 elsewhere (the CPU
    parity tests compare f32 against transformers)."""
    import jax

    if name not in DTYPE_CHOICES:
        raise ValueError(f"dtype={name!r} is not one of {DTYPE_CHOICES}")
    if name == "auto":
        name = "bf16" if jax.default_backend() == "tpu" else "f32"
    return jnp.bfloat16 if name == "bf16" else jnp.float32


@dataclass(frozen=True)
class LoadedModel:
    """Everything a runner needs to execute one checkpoint."""

    name: str
    family: ModuleType
    cfg: Any
    params: dict
    tokenizer: TextTokenizer | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_checkpoint(
        cls, ck: Checkpoint, dtype: Any = jnp.float32, on_device: bool = True
    ) -> LoadedModel:
        """on_device=False keeps the packed params on the host (in dtype): for a runner that
        repacks them into its own layout, so the device holds only that copy."""
        try:
            family, config_cls = family_for(ck.config.get("model_type"))
            cfg = config_cls.from_hf(ck.config)
            params = family.pack_params(cfg, ck.tensors, dtype, on_device)
        except CheckpointError:
            raise
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{ck.source}: {e}") from e
        return cls(ck.source, family, cfg, params, ck.tokenizer, _checked_eos(ck, cfg))

    @classmethod
    def load(
        cls, spec: str, dtype: Any = jnp.float32, progress: bool = True, on_device: bool = True
    ) -> LoadedModel:
        return cls.from_checkpoint(load_checkpoint(spec, progress=progress), dtype, on_device)

    @classmethod
    def load_for(
        cls,
        spec: str,
        dtype: Any,
        backend: str,
        page_size: int,
        progress: bool = False,
        parallel: ParallelConfig | None = None,
    ) -> LoadedModel:
        """Loads for a worker whose decode backend is `backend` (auto/pallas/xla): on the
        host when that resolves to the megakernel, which packs its own device copy. Over
        `parallel`'s several devices the tensor-parallel runner takes the params: already
        split by `load_sharded` where it applies, else on the host for the runner to split."""
        from megaserve.runner.factory import choose_backend

        devices = 1 if parallel is None else parallel.devices
        if devices > 1:
            model = cls.load_sharded(spec, dtype, parallel)
            if model is not None:
                return model
        ck = load_checkpoint(spec, progress=progress)
        try:
            _, config_cls = family_for(ck.config.get("model_type"))
            cfg = config_cls.from_hf(ck.config)
        except (ValueError, KeyError):
            return cls.from_checkpoint(ck, dtype)  # which reports the config error
        on_device = devices == 1 and choose_backend(cfg, page_size, backend)[0] != "pallas"
        return cls.from_checkpoint(ck, dtype, on_device)

    @classmethod
    def load_sharded(cls, spec: str, dtype: Any, parallel: ParallelConfig) -> LoadedModel | None:
        """The model with its params split over `parallel`'s mesh as `TpXlaRunner` lays
        them out, each process reading from the safetensors files only the blocks its own
        devices hold (`megaserve.checkpoint.sharded`, which states the host memory bound).
        None where that does not apply: not an HF directory (GGUF), a config the family
        refuses (the whole loader reports it), Qwen3-MoE (loaded whole, split by the runner)."""
        import jax

        from megaserve.checkpoint import resolve_checkpoint_path
        from megaserve.checkpoint.hf import load_hf_meta
        from megaserve.checkpoint.sharded import load_tp_params
        from megaserve.parallel.mesh import make_mesh

        path = resolve_checkpoint_path(spec)
        if not path.is_dir():
            return None
        ck = load_hf_meta(path)
        try:
            family, config_cls = family_for(ck.config.get("model_type"))
            cfg = config_cls.from_hf(ck.config)
        except (ValueError, KeyError):
            return None
        if type(cfg) is not LlamaConfig:
            log.info("sharded loading skipped", model_type=cfg.model_type, why="experts")
            return None
        lay = parallel.check_model(cfg)
        try:
            params = load_tp_params(path, cfg, lay, make_mesh(parallel), dtype)
        except ValueError as e:
            raise CheckpointError(f"{ck.source}: {e}") from e
        held = sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)
        log.info("sharded load", tp=parallel.tp, local_devices_bytes=held)
        return cls(ck.source, family, cfg, params, ck.tokenizer, _checked_eos(ck, cfg))


def _checked_eos(ck: Checkpoint, cfg: Any) -> tuple[int, ...]:
    bad = [i for i in ck.eos_token_ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise CheckpointError(f"{ck.source}: eos ids {bad} outside vocab {cfg.vocab_size}")
    return ck.eos_token_ids
