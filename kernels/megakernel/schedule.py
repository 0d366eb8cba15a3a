"""DMA accounting: the bytes the kernel's schedule moves per step, and the HBM floor to compare."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kernels.megakernel.kernel import DMA_KINDS
from kernels.megakernel.plan import MegaPlan, padded_bytes


def _block_bytes(plan: MegaPlan, scratch_name: str, padded: bool = False) -> int:
    """Bytes of one DMA into slot 0 of a scratch buffer: the kernel's DMA block shape.

    padded: count the (8,128)-tiled HBM layout instead (a [16, 192] bf16 page occupies, and
    moves, 16 x 256 elements).
    """
    s = {x.name: x for x in plan.scratch()}[scratch_name]
    if padded:
        return padded_bytes(s.shape[1:], s.dtype)
    return int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize


def pages_read(plan: MegaPlan, positions: Sequence[int]) -> int:
    """Pages the attention loop reads per layer: those holding tokens before each position."""
    return sum(math.ceil(p / plan.page_size) for p in positions if p >= 0)


def dma_bytes(
    plan: MegaPlan,
    positions: Sequence[int],
    distinct_experts: Sequence[int] = (),
    padded: bool = False,
) -> dict[str, int]:
    """Bytes per DMA kind (`kernel.DMA_KINDS`) one step issues, walking the kernel's schedule.

    Ring A/B stream each of their `n_a` / `n_b` tiles exactly once; the per-layer vector and
    router rings one block per layer; experts one (gate|up, down) pair per distinct selected
    expert per MoE layer; each layer reads `pages_read` K and V pages and writes back one K
    and one V page per live row; with `emit_logits`, one f32[B, ta] logits block per vocab tile.

    Args:
      positions: the step's position per row (-1 = padding).
      distinct_experts: distinct experts the batch selects, one count per MoE layer.
      padded: count tile-padded HBM bytes (see `_block_bytes`).
    """
    p = plan
    if len(distinct_experts) != len(p.moe_layers):
        raise ValueError(f"{len(distinct_experts)=} must equal {len(p.moe_layers)} MoE layers")
    live = sum(1 for x in positions if x >= 0)
    kv_page = _block_bytes(p, "kbuf", padded) // p.pages_per_block  # DMAs are per page
    out = {
        "ring_a": p.n_a * _block_bytes(p, "ring_a", padded),
        "ring_b": p.n_b * _block_bytes(p, "ring_b", padded),
        "vec": p.num_layers * _block_bytes(p, "vec", padded),
        "router": 0,
        "experts": 0,
        "kv_read": p.num_layers * pages_read(p, positions) * 2 * kv_page,
        "kv_write": p.num_layers * live * 2 * kv_page,
        # One staging block per vocab tile, DMA'd to the HBM logits output.
        "logits": p.vocab_tiles * _block_bytes(p, "logits_stage", padded) if p.emit_logits else 0,
    }
    if p.moe_layers:
        out["router"] = len(p.moe_layers) * _block_bytes(p, "router", padded)
        pair = _block_bytes(p, "egu", padded) + _block_bytes(p, "edown", padded)
        out["experts"] = sum(distinct_experts) * pair
    assert tuple(out) == DMA_KINDS
    return out


def floor_bytes(
    cfg, plan: MegaPlan, positions: Sequence[int], distinct_experts: Sequence[int] = ()
) -> dict[str, int]:
    """What any decode step must read from HBM: active weights at their serving width (no
    padding), embedding rows of the batch's tokens, and the K/V of every earlier token."""
    p = plan
    w = np.dtype(p.weight_dtype).itemsize
    kvb = np.dtype(p.kv_dtype).itemsize
    d, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, p.kv
    attn = (d * (q + 2 * kv) + q * d) * w + 2 * d * 4
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim * 4
    dense = 3 * d * cfg.intermediate_size * w
    layers = 0
    for i in range(p.num_layers):
        layers += attn + (0 if i in p.moe_layers else dense)
    experts = 0
    if p.moe_layers:
        per_expert = 3 * d * cfg.moe_intermediate_size * w
        layers += len(p.moe_layers) * d * cfg.num_experts * w
        experts = sum(distinct_experts) * per_expert
    live = [x for x in positions if x >= 0]
    return {
        "weights": layers + experts + d * cfg.vocab_size * w + d * 4,
        "embedding_rows": len(live) * d * w,
        "kv": p.num_layers * sum(live) * 2 * kv * kvb,
    }


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> int:
    """Distinct experts a batch selects if routing were uniform: E * (1 - (1 - k/E)^N)."""
    if num_experts == 0:
        return 0
    if tokens <= 1:
        return min(top_k, num_experts) * tokens
    return round(num_experts * (1 - (1 - top_k / num_experts) ** tokens))
