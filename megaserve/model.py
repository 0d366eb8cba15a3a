"""A loaded model: family code, static config, device weights, tokenizer and EOS ids."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax.numpy as jnp

from kernels.registry import family_for
from megaserve.checkpoint import Checkpoint, load_checkpoint
from megaserve.choices import DTYPE_CHOICES
from megaserve.errors import CheckpointError
from megaserve.tokenizer import TextTokenizer


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
        eos = ck.eos_token_ids
        bad = [i for i in eos if not 0 <= i < cfg.vocab_size]
        if bad:
            raise CheckpointError(f"{ck.source}: eos ids {bad} outside vocab {cfg.vocab_size}")
        return cls(ck.source, family, cfg, params, ck.tokenizer, eos)

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
        devices: int = 1,
    ) -> LoadedModel:
        """Loads for a worker whose decode backend is `backend` (auto/pallas/xla): on the
        host when that resolves to the megakernel, which packs its own device copy, or when
        the model runs over several `devices` (the tensor-parallel runner splits it)."""
        from megaserve.runner.factory import choose_backend

        ck = load_checkpoint(spec, progress=progress)
        try:
            _, config_cls = family_for(ck.config.get("model_type"))
            cfg = config_cls.from_hf(ck.config)
        except (ValueError, KeyError):
            return cls.from_checkpoint(ck, dtype)  # which reports the config error
        on_device = devices == 1 and choose_backend(cfg, page_size, backend)[0] != "pallas"
        return cls.from_checkpoint(ck, dtype, on_device)
