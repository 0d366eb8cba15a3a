"""Rotary position embeddings with the scaling types of Llama-family configs (HF semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

# Scaling types whose frequencies we compute exactly as transformers does. "dynamic" (NTK) only
# differs from "default" beyond max_position_embeddings, which the context limit never exceeds.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, normalised from either config style (transformers 5 or 4.x)."""

    head_dim: int
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, hf: dict, head_dim: int) -> RopeConfig:
        """Reads `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x)."""
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"per-layer-type rope_parameters are not supported: {params!r}")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not implemented (supported: {SUPPORTED_ROPE_TYPES})"
            )
        partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not implemented (only 1.0)")
        max_pos = int(hf.get("max_position_embeddings", 2048))
        orig = int(
            hf.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or max_pos
        )
        factor = params.get("factor")
        if rope_type in ("linear", "dynamic", "llama3") and factor is None:
            raise ValueError(f"rope type {rope_type!r} needs a 'factor' in {params!r}")
        if rope_type == "yarn" and factor is None:
            factor = max_pos / orig
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            rope_type=rope_type,
            factor=float(factor if factor is not None else 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=orig,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
        )

    def inv_freq(self) -> tuple[np.ndarray, float]:
        """Returns (f32[head_dim // 2] inverse frequencies, cos/sin scaling), as transformers."""
        dim = self.head_dim
        exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
        base = np.float32(self.theta) ** exponents
        inv = (np.float32(1.0) / base).astype(np.float32)
        scale = 1.0
        if self.rope_type == "linear":
            inv = inv / np.float32(self.factor)
        elif self.rope_type == "llama3":
            inv = self._llama3(inv)
        elif self.rope_type == "yarn":
            inv, scale = self._yarn(base)
        return inv.astype(np.float32), float(scale)

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        old = self.original_max_position_embeddings
        low_wl = old / self.low_freq_factor
        high_wl = old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32)

    def _yarn(self, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
        dim, factor = self.head_dim, self.factor

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        att = self.attention_factor
        if att is None:
            if self.mscale and self.mscale_all_dim:
                att = get_mscale(factor, self.mscale) / get_mscale(factor, self.mscale_all_dim)
            else:
                att = get_mscale(factor)

        def corr_dim(rot: float) -> float:
            orig = self.original_max_position_embeddings
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = corr_dim(self.beta_fast), corr_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap_factor = (1 - ramp).astype(np.float32)
        inv_extrap = np.float32(1.0) / pos_freqs
        inv_interp = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        inv = inv_interp * (1 - extrap_factor) + inv_extrap * extrap_factor
        return inv.astype(np.float32), float(att)


def rope_cos_sin(
    positions: jnp.ndarray, inv_freq: jnp.ndarray, scale: float
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables for i32[...] positions -> two f32[..., head_dim] arrays (HF half layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates f32[B, T, H, D] by cos/sin f32[B, T, D] (rotate_half convention of transformers)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
