"""Static per-step cost of the decode megakernel from its own schedule: MXU flops, vector and
transcendental work, DMA count, and the time each takes at stated tpu7x peaks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kernels.megakernel import schedule
from kernels.megakernel.plan import LANES, MegaPlan

# f32 matmuls at Precision.HIGHEST run as 6 bf16 MXU passes (the kernel's head-segment sums
# and router); every other matmul is one pass in the serving dtype.
HIGHEST_PASSES = 6


@dataclass(frozen=True)
class Peaks:
    """Per JAX device (one TensorCore) rates. MXU and HBM are Google's published TPU7x
    figures per chip (2307 TFLOP/s dense bf16, half of 4.6 PFLOP/s fp8; 7.37 TB/s), halved:
    a chip is two TensorCore devices and a `pallas_call` runs on one. Google publishes no VPU
    or EUP rates: `vpu_ops_per_s` (1024 f32 lanes x 2 ops per cycle) and `eup_per_s` (1024
    lanes, one transcendental per cycle) at an assumed 1.9 GHz are assumptions, stated as such."""

    mxu_flops_per_s: float = 2307e12 / 2
    hbm_bytes_per_s: float = 7.37e12 / 2
    vpu_ops_per_s: float = 1024 * 2 * 1.9e9  # assumed
    eup_per_s: float = 1024 * 1.9e9  # assumed


TPU7X = Peaks()


@dataclass
class Work:
    """Counts for one part of the step."""

    mxu_flops: int = 0  # 2*M*K*N of every matmul as issued (padding included), x passes
    vpu_ops: int = 0  # f32 elementwise/reduction ops (approximate: the main ones per element)
    transcendentals: int = 0  # exp, sigmoid, rsqrt elements
    dmas: int = 0

    def matmul(self, m: int, k: int, n: int, count: int = 1, passes: int = 1) -> None:
        self.mxu_flops += 2 * m * k * n * count * passes

    def add(self, other: Work) -> None:
        for f in ("mxu_flops", "vpu_ops", "transcendentals", "dmas"):
            setattr(self, f, getattr(self, f) + getattr(other, f))

    def seconds(self, peaks: Peaks) -> dict[str, float]:
        return {
            "mxu_s": self.mxu_flops / peaks.mxu_flops_per_s,
            "vpu_s": self.vpu_ops / peaks.vpu_ops_per_s,
            "eup_s": self.transcendentals / peaks.eup_per_s,
        }


def _heads_per_chunk(p: MegaPlan) -> list[tuple[int, int]]:
    """(chunk width, heads sharing its matmuls) per K/V lane chunk, as `_attend_block`."""
    chunk = max(LANES, p.head_dim)
    out = []
    for c in range(0, p.kv, chunk):
        w = min(chunk, p.kv - c)
        out.append((w, 1 if w <= p.head_dim else w // p.head_dim))
    return out


def attention_work(p: MegaPlan, positions: Sequence[int]) -> Work:
    """One step's attention over the K/V pages (all layers): the block loop, the per-row
    softmax start and normalisation, and the page DMAs."""
    w = Work()
    g, t = p.group, p.block_width
    live = [x for x in positions if x >= 0]
    blocks = sum(math.ceil(math.ceil(x / p.page_size) / p.pages_per_block) for x in live)
    for width, heads in _heads_per_chunk(p):
        # Per block and head: scores [g, w] x [w, T] and values [g, T] x [T, w].
        w.matmul(g, width, t, 2 * heads * blocks)
        # Scores: mask, max, subtract, sum, cast (5 per element); state: rescale and add.
        w.vpu_ops += heads * blocks * (5 * g * t + 6 * g * width)
        w.transcendentals += heads * blocks * g * (t + 1)
    rows = len(live)
    # Start (q.k of the new token per head) and the merge of the rewritten page, per row.
    w.matmul(g, p.kv, LANES, rows, HIGHEST_PASSES)
    w.matmul(g, LANES, p.kv, rows, HIGHEST_PASSES)
    w.vpu_ops += rows * (3 * g * p.kv + 4 * p.page_size * p.kv)
    w.dmas += 2 * schedule.pages_read(p, positions) + 2 * rows
    scale = p.num_layers
    return Work(w.mxu_flops * scale, w.vpu_ops * scale, w.transcendentals * scale, w.dmas * scale)


def weights_work(p: MegaPlan, distinct_experts: Sequence[int] = ()) -> Work:
    """One step's weight matmuls (projections, MLPs or experts, router, vocab) and their DMAs."""
    w = Work()
    b, d, dp, ta = p.batch, p.hidden, p.hidden_p, p.ta
    moe = set(p.moe_layers)
    for layer in range(p.num_layers):
        w.matmul(b, d, ta, p.group + 2)  # q groups, k, v
        if p.qk_norm:  # per-head RMS of each q group and k: two segment matmuls each
            w.matmul(b, ta, LANES, p.group + 1, HIGHEST_PASSES)
            w.matmul(b, LANES, ta, p.group + 1, HIGHEST_PASSES)
            w.transcendentals += (p.group + 1) * b * LANES
        w.matmul(b, ta, dp, p.group)  # o_proj
        w.vpu_ops += 4 * b * (p.group + 2) * ta + 2 * 4 * b * dp  # RoPE, 2 RMSNorms, residual
        w.transcendentals += 2 * b
        if layer in moe:
            w.matmul(b, d, p.experts_p, 1, HIGHEST_PASSES)  # router
            w.vpu_ops += 4 * p.top_k * b * p.experts_p
            w.transcendentals += b * p.experts_p
        else:
            w.matmul(b, d, ta, 2 * p.ffn_tiles)  # gate, up
            w.matmul(b, ta, dp, p.ffn_tiles)  # down
            w.vpu_ops += 3 * b * ta * p.ffn_tiles
            w.transcendentals += b * ta * p.ffn_tiles
    for n in distinct_experts:  # each fetched expert runs over the whole batch
        i = p.moe_inter_p
        w.matmul(b, d, i, 2 * n)
        w.matmul(b, i, dp, n)
        w.vpu_ops += n * (3 * b * i + 2 * b * dp)
        w.transcendentals += n * b * i
        w.dmas += 2 * n
    w.matmul(b, d, ta, p.vocab_tiles)  # lm_head
    w.vpu_ops += 3 * b * ta * p.vocab_tiles  # running max / argmax
    w.dmas += p.n_a + p.n_b + p.num_layers + len(p.moe_layers)
    w.dmas += p.vocab_tiles if p.emit_logits else 0
    return w


def step_cost(
    plan: MegaPlan,
    positions: Sequence[int],
    distinct_experts: Sequence[int] = (),
    peaks: Peaks = TPU7X,
) -> dict:
    """The step's work and time at `peaks`, attention apart; `bound` names the largest of
    HBM, MXU, VPU and EUP time (the kernel overlaps its DMAs with compute)."""
    attention = attention_work(plan, positions)
    weights = weights_work(plan, distinct_experts)
    total = Work()
    total.add(attention)
    total.add(weights)
    dma = schedule.dma_bytes(plan, positions, distinct_experts)
    kv_bytes = dma["kv_read"] + dma["kv_write"]
    out = {}
    for name, work, nbytes in (
        ("attention", attention, kv_bytes),
        ("total", total, sum(dma.values())),
    ):
        times = work.seconds(peaks) | {"hbm_s": nbytes / peaks.hbm_bytes_per_s}
        out[name] = {
            "mxu_flops": work.mxu_flops,
            "vpu_ops": work.vpu_ops,
            "transcendentals": work.transcendentals,
            "dmas": work.dmas,
            "hbm_bytes": nbytes,
            **{k: round(v * 1e3, 5) for k, v in times.items()},  # milliseconds
            "compute_ms": round(max(times["mxu_s"], times["vpu_s"], times["eup_s"]) * 1e3, 5),
            "bound": max(times, key=times.get).removesuffix("_s"),
        }
        out[name] = {k.replace("_s", "_ms") if k.endswith("_s") else k: v
                     for k, v in out[name].items()}  # fmt: skip
    out["peaks"] = {
        "mxu_flops_per_s": peaks.mxu_flops_per_s,
        "hbm_bytes_per_s": peaks.hbm_bytes_per_s,
        "vpu_ops_per_s_assumed": peaks.vpu_ops_per_s,
        "eup_per_s_assumed": peaks.eup_per_s,
    }
    return out
