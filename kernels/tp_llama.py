"""Tensor-parallel Llama family: shard plan, shard-major weights, the forward under shard_map."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels.kv_cache import pool_row
from kernels.llama import LlamaConfig, dense_mlp, final_hidden, mm

AXIS = "tp"  # the mesh axis the shards of this module live on
EP_AXIS = "ep"  # the mesh axis routed experts are split over (`kernels.tp_moe`)
REPLICATED = P()
KV_SPEC = P(None, None, None, AXIS)  # the pool [L, pages, page_size, tp * row]: by KV heads


@dataclass(frozen=True)
class TpLayout:
    """What one of `tp` shards holds of a Llama-family model (`tp_layout` checks it)."""

    tp: int
    heads: int  # query heads per shard
    kv_heads: int  # KV heads per shard (1 when KV heads are replicated)
    kv_replicas: int  # shards holding each KV head (tp / Hkv when Hkv < tp, else 1)
    ffn: int  # intermediate (gate/up) columns per shard
    vocab: int  # lm_head columns per shard (the vocabulary padded to a multiple of tp)
    # Mixture-of-experts models (`kernels.tp_moe.expert_layout`): the EP_AXIS size, routed
    # experts per ep shard and each expert's intermediate columns per tp shard (0: none).
    ep: int = 1
    experts: int = 0
    moe_ffn: int = 0

    @property
    def stored_kv_heads(self) -> int:
        """KV heads across the whole (global) pool row: Hkv, or tp where they are replicated."""
        return self.tp * self.kv_heads


def tp_layout(cfg: LlamaConfig, tp: int) -> TpLayout:
    """The shard plan for `tp` shards; ValueError naming the value that does not divide.

    Query heads and intermediate columns must split evenly. KV heads split evenly when
    Hkv >= tp (Hkv % tp == 0); when Hkv < tp each KV head is replicated on tp / Hkv shards
    (tp % Hkv == 0), so that every shard's query heads share the one KV head it holds.
    """
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    hq, hkv, f = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if hq % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={hq}")
    if f % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={f}")
    if hkv >= tp and hkv % tp:
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={hkv}")
    if hkv < tp and tp % hkv:
        raise ValueError(
            f"tp={tp} is not a multiple of num_key_value_heads={hkv}: KV heads can only be "
            "replicated a whole number of times"
        )
    kv_heads = max(hkv // tp, 1)
    return TpLayout(tp, hq // tp, kv_heads, max(tp // hkv, 1), f // tp, -(-cfg.vocab_size // tp))


def local_config(cfg: LlamaConfig, lay: TpLayout) -> LlamaConfig:
    """The config one shard's layers see: its heads and intermediate columns only."""
    return dataclasses.replace(
        cfg, num_heads=lay.heads, num_kv_heads=lay.kv_heads, intermediate_size=lay.ffn
    )


def local_pool_row(cfg: LlamaConfig, lay: TpLayout, platform: str) -> int:
    """Elements of one shard's pool row (its KV heads, lane-padded on TPU)."""
    return pool_row(lay.kv_heads, cfg.head_dim, platform)


# -- weights: host arrays re-ordered shard-major, so one PartitionSpec splits them ---------


def kv_heads_of(lay: TpLayout, i: int) -> list[int]:
    """The KV heads shard i holds (its query heads' group; replicas repeat a head)."""
    if lay.kv_replicas > 1:
        return [i // lay.kv_replicas]
    return list(range(i * lay.kv_heads, (i + 1) * lay.kv_heads))


def _qkv_shard_major(cfg: LlamaConfig, lay: TpLayout, w: np.ndarray) -> np.ndarray:
    """Fused q|k|v columns [..., q + 2 kv] -> [..., tp * (q/tp + 2 kv_local)], shard i's
    own q|k|v block at columns i (works for the [D, N] weight and the [N] bias)."""
    hd, q, kv = cfg.head_dim, cfg.q_size, cfg.kv_size
    lead = w.shape[:-1]
    wq = w[..., :q].reshape(*lead, cfg.num_heads, hd)
    wk = w[..., q : q + kv].reshape(*lead, cfg.num_kv_heads, hd)
    wv = w[..., q + kv :].reshape(*lead, cfg.num_kv_heads, hd)
    blocks = []
    for i in range(lay.tp):
        heads = wq[..., i * lay.heads : (i + 1) * lay.heads, :]
        kvh = kv_heads_of(lay, i)
        for part in (heads, wk[..., kvh, :], wv[..., kvh, :]):
            blocks.append(part.reshape(*lead, -1))
    return np.concatenate(blocks, axis=-1)


def _gate_up_shard_major(lay: TpLayout, w: np.ndarray) -> np.ndarray:
    """Fused gate|up [..., D, 2F] -> [..., D, tp * 2F/tp], shard i's gate_i|up_i at block i
    (a dense MLP's [D, 2F] or routed experts' [E, D, 2I], each expert alike)."""
    f = w.shape[-1] // 2
    per = f // lay.tp
    gate, up = w[..., :f], w[..., f:]
    cols = [slice(i * per, (i + 1) * per) for i in range(lay.tp)]
    return np.concatenate([np.concatenate([gate[..., c], up[..., c]], -1) for c in cols], -1)


# Per-layer tensors and how they split: q/k/v and gate/up by output columns (column-parallel),
# o and down by input rows (row-parallel, a psum after), norms and biases added after a psum
# replicated.
_LAYER_SPECS = {
    "wqkv": P(None, AXIS),
    "bqkv": P(AXIS),
    "wo": P(AXIS, None),
    "w_gate_up": P(None, AXIS),
    "w_down": P(AXIS, None),
}
# Routed-expert layers (Qwen3-MoE): the experts [E, D, 2I] / [E, I, D] over EP_AXIS, each
# expert's gate|up columns and down rows over AXIS as a dense MLP's; the router replicated.
_EXPERT_SPECS = {"w_gate_up": P(EP_AXIS, None, AXIS), "w_down": P(EP_AXIS, AXIS, None)}


def param_specs(params: dict) -> dict:
    """PartitionSpecs for `shard_params`' output (the same tree)."""
    top = {"embed": REPLICATED, "lm_head": P(None, AXIS)}
    layers = []
    for lp in params["layers"]:
        plan = _LAYER_SPECS | (_EXPERT_SPECS if "router" in lp else {})
        layers.append({k: plan.get(k, REPLICATED) for k in lp})
    return {k: top.get(k, REPLICATED) for k in params if k != "layers"} | {"layers": layers}


def shard_major_params(cfg: LlamaConfig, lay: TpLayout, params: dict) -> dict:
    """`llama.pack_params` output (device or host) -> host arrays laid out shard-major, the
    global arrays `param_specs` splits: each shard gets exactly its contiguous block."""
    host = jax.tree.map(np.asarray, params)
    layers = []
    for lp in host["layers"]:
        out = dict(lp)
        out["wqkv"] = _qkv_shard_major(cfg, lay, lp["wqkv"])
        if "bqkv" in lp:
            out["bqkv"] = _qkv_shard_major(cfg, lay, lp["bqkv"])
        out["w_gate_up"] = _gate_up_shard_major(lay, lp["w_gate_up"])
        layers.append(out)
    head = host["lm_head"]  # [D, V], zero columns up to tp * vocab (masked in `tp_forward`)
    pad = lay.tp * lay.vocab - head.shape[1]
    return host | {"lm_head": np.pad(head, ((0, 0), (0, pad))), "layers": layers}


# -- the forward, per shard (called inside shard_map over AXIS) -----------------------------


def tp_forward(
    cfg: LlamaConfig,
    lay: TpLayout,
    params: dict,
    tokens: jnp.ndarray,
    positions: jnp.ndarray,
    k_cache: jnp.ndarray,
    v_cache: jnp.ndarray,
    page_table: jnp.ndarray,
    logits_index: jnp.ndarray | None,
    mlp: Any = dense_mlp,
    mlp_reduce: Any = None,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """`llama.forward` on one shard, inside shard_map over AXIS (and EP_AXIS).

    params: this shard's block of `shard_major_params`; k_cache, v_cache: its pool block
    [L, pages, page_size, row_local]; tokens, positions: i32[B, T]; page_table: i32[B, P];
    logits_index: i32[B] or None (every position). Returns (f32[B, vocab_local] (or
    [B, T, vocab_local]) this shard's vocabulary slice of the logits, columns past the real
    vocabulary at -inf, k_cache, v_cache). mlp, mlp_reduce: as `llama.final_hidden`'s (the
    MoE family's come from `tp_moe.shard_forward`).
    """
    # Column-parallel q/k/v and gate|up, row-parallel o and down: one psum after each of the
    # two row-parallel products per layer.
    last, k_cache, v_cache = final_hidden(
        local_config(cfg, lay), params, tokens, positions, k_cache, v_cache, page_table,
        logits_index, mlp, functools.partial(jax.lax.psum, axis_name=AXIS), mlp_reduce,
    )  # fmt: skip
    logits = mm(last, params["lm_head"])  # vocab-parallel: no collective here
    col = jax.lax.axis_index(AXIS) * lay.vocab + jnp.arange(lay.vocab)
    return jnp.where(col < cfg.vocab_size, logits, -jnp.inf), k_cache, v_cache


def distributed_argmax(local: jnp.ndarray, lay: TpLayout) -> jnp.ndarray:
    """Greedy tokens i32[B] from vocab-sharded logits f32[B, vocab_local], equal to
    `jnp.argmax` of the whole row (first index on ties): each shard's max and its global
    index travel in one all-gather of [tp, B, 2] (the index bit-cast to f32, exact), then
    the first shard holding the largest max wins."""
    idx = jnp.argmax(local, axis=-1)
    best = jnp.take_along_axis(local, idx[:, None], axis=-1)[:, 0].astype(jnp.float32)
    return shard_winner(best, idx, lay)


def shard_winner(best: jnp.ndarray, idx: jnp.ndarray, lay: TpLayout) -> jnp.ndarray:
    """Greedy tokens i32[B] from each shard's best logit f32[B] and its local column i32[B]
    (the first shard wins ties: the lowest global index, as one device's argmax)."""
    gidx = (idx + jax.lax.axis_index(AXIS) * lay.vocab).astype(jnp.int32)
    packed = jnp.stack([best, jax.lax.bitcast_convert_type(gidx, jnp.float32)], axis=-1)
    every = jax.lax.all_gather(packed, AXIS)  # f32[tp, B, 2]
    win = jnp.argmax(every[..., 0], axis=0)  # first shard on ties = lowest global index
    chosen = jnp.take_along_axis(every[..., 1], win[None], axis=0)[0]
    return jax.lax.bitcast_convert_type(chosen, jnp.int32)


def gather_vocab(local: jnp.ndarray, cfg: LlamaConfig) -> jnp.ndarray:
    """The whole f32[..., V] rows from vocab-sharded f32[..., vocab_local] (an all-gather)."""
    full = jax.lax.all_gather(local, AXIS, axis=local.ndim - 1, tiled=True)
    return full[..., : cfg.vocab_size]


def shard_params(params: dict, specs: dict, mesh: Any) -> dict:
    """Host shard-major params onto the mesh, each leaf split by its spec."""
    return jax.tree.map(
        lambda a, s: jax.device_put(a, jax.sharding.NamedSharding(mesh, s)), params, specs
    )
