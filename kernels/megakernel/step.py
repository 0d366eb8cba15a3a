"""The megakernel decode step and its reference twin (same signature and returns)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import llama, qwen3_moe
from kernels.llama import LlamaConfig
from kernels.megakernel import kernel as K
from kernels.megakernel.pack import unpack_megakernel
from kernels.megakernel.plan import MegaPlan
from kernels.qwen3_moe import Qwen3MoeConfig
from kernels.rope import RopeConfig


def step_inputs(plan: MegaPlan, mparams: dict, tokens, positions, page_table) -> dict[str, Any]:
    """Host-side (XLA) preparation: embedding rows, RoPE lane tables, write slots, page items.

    Args:
      tokens: i32[B] last token of each row; positions: i32[B] its position, -1 = padding;
      page_table: i32[B, P] pages of each row (null page 0 as padding).
    Returns:
      dict of the kernel's scalar-prefetch and VMEM inputs, keyed by kernel operand name.
    """
    p = plan
    b, pages = page_table.shape
    if b != p.batch or pages != p.pages_per_seq:
        raise ValueError(
            f"page_table shape {page_table.shape} != plan ({p.batch}, {p.pages_per_seq})"
        )
    valid = positions >= 0
    safe = jnp.where(valid, positions, 0)
    h0 = jnp.take(mparams["embed"], tokens, axis=0).astype(jnp.float32)  # [B, hidden_p]
    # RoPE per lane of a [Hkv * D] row (HF half layout repeated per head; padding lanes 0).
    lane = jnp.arange(p.ta)
    freq = mparams["inv_freq"][(lane % p.head_dim) % (p.head_dim // 2)]
    ang = safe.astype(jnp.float32)[:, None] * freq[None]
    keep = (lane < p.kv)[None]
    cos = jnp.where(keep, jnp.cos(ang) * mparams["rope_scale"], 0.0)
    sin = jnp.where(keep, jnp.sin(ang) * mparams["rope_scale"], 0.0)
    ps = p.page_size
    wlast = safe // ps
    wpage = jnp.where(valid, jnp.take_along_axis(page_table, wlast[:, None], axis=1)[:, 0], 0)
    # Pages each row reads: those holding a token before its position (the new token's own
    # K/V comes from VMEM), in blocks of `pages_per_block`; the blocks of every row form one
    # list (row-major) so the prefetch crosses rows.
    n_read = jnp.where(valid, (safe + ps - 1) // ps, 0)
    per, blocks = p.pages_per_block, p.blocks_per_seq
    n_blocks = -(-n_read // per)
    j = jnp.arange(blocks)[None]
    mask = j < n_blocks[:, None]
    slot = jnp.where(mask, jnp.cumsum(mask.reshape(-1)).reshape(b, blocks) - 1, b * blocks)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, blocks))

    def flat(values, width=1):  # [b, blocks(, width)] -> items in order, width each
        out = jnp.zeros((b * blocks, width), jnp.int32)
        values = values.reshape(b * blocks, width).astype(jnp.int32)
        return out.at[slot.reshape(-1)].set(values, mode="drop").reshape(-1)

    table = jnp.pad(page_table, ((0, 0), (0, blocks * per - pages)))
    return {
        "pos": positions.astype(jnp.int32),
        "wpage": wpage.astype(jnp.int32),
        "wslot": (safe % ps).astype(jnp.int32),
        "wlast": wlast.astype(jnp.int32),
        "it_seq": flat(rows),
        "it_page": flat(table.reshape(b, blocks, per), per),
        "it_idx": flat(jnp.broadcast_to(j, (b, blocks))),
        "it_cnt": flat(jnp.clip(n_read[:, None] - j * per, 0, per)),
        "meta": jnp.sum(n_blocks, keepdims=True).astype(jnp.int32),
        "h0": h0,
        "cos": cos.astype(jnp.float32),
        "sin": sin.astype(jnp.float32),
        "final_norm": mparams["final_norm"],
    }


def _interpret_params(interpret: bool | pltpu.InterpretParams):
    """False (compile for TPU), or the TPU interpreter's params (True: the defaults, which
    turn missing DMA waits and out-of-bounds DMAs into NaN / IndexError)."""
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret  # e.g. detect_races=True (tests/test_megakernel_tp.py)
    return pltpu.InterpretParams() if interpret else False


def _pallas_call(plan: MegaPlan, interpret: bool | pltpu.InterpretParams):
    p = plan
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    ins = K.input_names(p)
    outs = K.output_names(p)
    in_specs = [hbm if n.endswith("_hbm") else vmem for n in ins]
    # logits stay in HBM: the kernel DMAs each vocab tile there from a VMEM staging block.
    out_specs = [{"tokens": vmem, "best": vmem, "dma_count_out": smem}.get(n, hbm) for n in outs]
    scratch = []
    for s in p.scratch():
        if s.space == "sem":
            scratch.append(pltpu.SemaphoreType.DMA(s.shape))
        elif s.space == "smem":
            scratch.append(pltpu.SMEM(s.shape, s.dtype))
        else:
            scratch.append(pltpu.VMEM(s.shape, s.dtype))
    n_scalar = len(K.SCALARS)
    aliases = {}
    if not p.pages_out:
        aliases = {
            n_scalar + ins.index("k_hbm"): outs.index("k_out"),
            n_scalar + ins.index("v_hbm"): outs.index("v_out"),
        }
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=n_scalar,
        grid=(),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch,
    )
    return partial(
        pl.pallas_call,
        partial(K.kernel_body, p),
        grid_spec=grid_spec,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(
            # All of VMEM: Mosaic's internal scratch beyond the plan's estimate (8.2 MiB for
            # Llama-3.1-8B, more than VMEM_HEADROOM) must fit under the limit too.
            vmem_limit_bytes=p.vmem_limit,
            # The barrier semaphore of the tp start barrier (`collective.start_barrier`).
            collective_id=0 if p.tp > 1 else None,
        ),
        interpret=_interpret_params(interpret),
    )


def megakernel_step(
    plan: MegaPlan,
    mparams: dict,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    interpret: bool = False,
):
    """One decode step of every row through the megakernel.

    Args:
      plan: static plan (batch and page-table width included).
      mparams: `pack_megakernel` output.
      k_cache, v_cache: [L, num_pages, page_size, kv_row] pools (`KVPool`'s layout) in the
        kernel's KV dtype; donate them under jit: the kernel writes each row's new K/V into
        its page in place.
      tokens: i32[B]; positions: i32[B] (-1 = padding row); page_table: i32[B, P].
      interpret: run under the TPU interpreter (CPU tests); an `InterpretParams` selects its
        options.
    Returns:
      (i32[B] greedy tokens, f32[B, V] logits or None, k_cache, v_cache, i32[8] DMA bytes by
      kind (`kernel.DMA_KINDS`) or None).
    """
    p = plan
    res = run_kernel(p, mparams, k_cache, v_cache, tokens, positions, page_table, interpret)
    return (
        res["tokens"][:, 0],
        kernel_logits(p, res),
        res["k_out"],
        res["v_out"],
        res.get("dma_count_out"),
    )


def kernel_logits(plan: MegaPlan, res: dict):
    """f32[B, plan.vocab] rows from the kernel's f32[tiles, B, ta] logits output (None when
    the plan emits none)."""
    if not plan.emit_logits:
        return None
    return res["logits"].transpose(1, 0, 2).reshape(plan.batch, -1)[:, : plan.vocab]


def run_kernel(
    plan: MegaPlan, mparams: dict, k_cache, v_cache, tokens, positions, page_table, interpret
) -> dict[str, jax.Array]:
    """The pallas_call on `megakernel_step`'s arguments: its outputs by `kernel.output_names`
    (tokens i32[B, 128], logits f32[tiles, B, ta], best f32[B, 128] under tp, k_out, v_out
    or under tp k_pages, v_pages, dma_count_out)."""
    p = plan
    if k_cache.ndim != 4 or k_cache.shape[-1] != p.kv_row:
        raise ValueError(f"pool shape {k_cache.shape} is not [L, pages, page_size, {p.kv_row}]")
    k4, v4 = k_cache, v_cache  # the kernel's layout: one page is one DMA block
    inp = step_inputs(p, mparams, tokens, positions, page_table)
    hbm = {f"{n}_hbm": mparams[n] for n in ("ring_a", "ring_b", "vec")}
    if p.moe_layers:
        hbm |= {f"{n}_hbm": mparams[n] for n in ("router", "expert_gu", "expert_down")}
    args = inp | hbm | {"k_hbm": k4, "v_hbm": v4}
    out_shape = {
        "tokens": jax.ShapeDtypeStruct((p.batch, 128), jnp.int32),
        "logits": jax.ShapeDtypeStruct((p.vocab_tiles, p.batch, p.ta), jnp.float32),
        "k_out": jax.ShapeDtypeStruct(k4.shape, k4.dtype),
        "v_out": jax.ShapeDtypeStruct(v4.shape, v4.dtype),
        "dma_count_out": jax.ShapeDtypeStruct((8,), jnp.int32),
        "best": jax.ShapeDtypeStruct((p.batch, 128), jnp.float32),
        "k_pages": jax.ShapeDtypeStruct((p.num_layers, p.batch, *k4.shape[2:]), k4.dtype),
        "v_pages": jax.ShapeDtypeStruct((p.num_layers, p.batch, *v4.shape[2:]), v4.dtype),
    }
    outs = K.output_names(p)
    call = _pallas_call(p, interpret)(out_shape=[out_shape[n] for n in outs])
    return dict(zip(outs, call(*[args[n] for n in K.SCALARS + tuple(K.input_names(p))])))


def _family_config(plan: MegaPlan) -> Any:
    """The family config `kernels.llama.forward` reads, rebuilt from the plan's sizes."""
    p = plan
    fields = dict(
        model_type="qwen3" if p.qk_norm else "llama",
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.ffn_tiles * p.ta,  # as unpacked: padded to whole tiles
        num_layers=p.num_layers,
        num_heads=p.num_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        rms_norm_eps=p.eps,
        max_position_embeddings=0,  # not read by forward
        # Not read either: forward takes the RoPE tables (inv_freq, rope_scale) from params.
        rope=RopeConfig(head_dim=p.head_dim, theta=10000.0),
        qk_norm=p.qk_norm,
        qkv_bias=p.qkv_bias,
    )
    if not p.moe_layers:
        return LlamaConfig(**fields)
    return Qwen3MoeConfig(
        **(fields | {"model_type": "qwen3_moe"}),
        num_experts=p.num_experts,
        top_k=p.top_k,
        norm_topk_prob=p.norm_topk_prob,
        moe_intermediate_size=p.moe_inter_p,
        moe_layers=p.moe_layers,
    )


def reference_step(
    plan: MegaPlan,
    mparams: dict,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    interpret: bool = False,
):
    """The pure-JAX reference of `megakernel_step`: the same arguments and returns.

    Runs the family's XLA decode step (`kernels.llama.forward`, with the Qwen3-MoE MLP when
    the plan has MoE layers) in f32 on the weights `unpack_megakernel` rebuilds from
    `mparams`, over the same pool: read in f32, the new K/V written in the pool's dtype.

    Args:
      as `megakernel_step`; `interpret` is accepted and ignored (there is no kernel).
    Returns:
      (i32[B] greedy tokens, f32[B, V] logits, k_cache, v_cache, None).
    """
    del interpret
    p = plan
    params = unpack_megakernel(p, mparams)
    mlp = qwen3_moe.moe_mlp if p.moe_layers else llama.dense_mlp
    zeros = jnp.zeros(tokens.shape, jnp.int32)
    logits, k_cache, v_cache = llama.forward(
        _family_config(p),
        params,
        tokens[:, None],
        positions[:, None],
        k_cache,
        v_cache,
        page_table,
        zeros,
        mlp=mlp,
    )
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return greedy, logits, k_cache, v_cache, None
