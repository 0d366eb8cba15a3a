"""Repacks a family's per-layer weights into the megakernel's ring order (tiles in HBM)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kernels.llama import pad_rows
from kernels.megakernel.plan import MegaPlan, VecRow


def _pad(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.zeros(shape, np.float32)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def group_columns(plan: MegaPlan, g: int) -> np.ndarray:
    """Columns of q (rows of o_proj) for query-head group g: heads h*G+g for each kv head h,
    so the group's q row lines up lane for lane with a K/V page row [Hkv * D]."""
    d, grp = plan.head_dim, plan.group
    return np.concatenate([np.arange(d) + (h * grp + g) * d for h in range(plan.num_kv_heads)])


def pack_megakernel(plan: MegaPlan, params: dict) -> dict[str, Any]:
    """Builds the ring arrays of `plan.hbm_shapes()` from `family.pack_params` output.

    Args:
      plan: the kernel plan.
      params: per-layer params as kernels.llama.finish_params lays them out ([in, out]).
    Returns:
      dict of device arrays: ring_a, ring_b, vec, final_norm, embed (+ router, expert_gu,
      expert_down for MoE models).
    """
    p = plan
    dm, ta, dp, kv = p.hidden, p.ta, p.hidden_p, p.kv
    q_size = p.num_heads * p.head_dim
    a_tiles: list[np.ndarray] = []
    b_tiles: list[np.ndarray] = []
    vec = np.zeros((p.num_layers, p.vec_rows, p.vec_width), np.float32)
    routers, egus, edowns = [], [], []
    for li, lp in enumerate(params["layers"]):
        f32 = {k: np.asarray(v, np.float32) for k, v in lp.items()}
        wqkv, wo = f32["wqkv"], f32["wo"]
        for g in range(p.group):
            cols = group_columns(p, g)
            a_tiles.append(_pad(wqkv[:, cols], (dm, ta)))
            b_tiles.append(_pad(wo[cols, :], (ta, dp)))
        a_tiles.append(_pad(wqkv[:, q_size : q_size + kv], (dm, ta)))
        a_tiles.append(_pad(wqkv[:, q_size + kv :], (dm, ta)))
        if p.qkv_bias:  # laid out as the tiles' columns: q groups, k, v
            bias = f32["bqkv"]
            for g in range(p.group):
                vec[li, VecRow.QKV_BIAS + g, :kv] = bias[group_columns(p, g)]
            vec[li, VecRow.QKV_BIAS + p.group, :kv] = bias[q_size : q_size + kv]
            vec[li, VecRow.QKV_BIAS + p.group + 1, :kv] = bias[q_size + kv :]
        vec[li, VecRow.LN_ATTN, :dm] = f32["ln_attn"]
        vec[li, VecRow.LN_MLP, :dm] = f32["ln_mlp"]
        if p.qk_norm:
            vec[li, VecRow.Q_NORM, :kv] = np.tile(f32["q_norm"], p.num_kv_heads)
            vec[li, VecRow.K_NORM, :kv] = np.tile(f32["k_norm"], p.num_kv_heads)
        if p.is_moe[li]:
            e, i = p.num_experts, p.moe_inter_p
            routers.append(_pad(f32["router"], (dm, p.experts_p)))
            wgu, wdn = f32["w_gate_up"], f32["w_down"]  # [E, D, 2I], [E, I, D]
            half = wgu.shape[2] // 2
            gu = np.zeros((e, 2, dm, i), np.float32)
            gu[:, 0, :, :half], gu[:, 1, :, :half] = wgu[..., :half], wgu[..., half:]
            egus.append(gu)
            edowns.append(_pad(wdn, (e, i, dp)))
            continue
        wgu, wdn = f32["w_gate_up"], f32["w_down"]  # [D, 2F], [F, D]
        f = wgu.shape[1] // 2
        fp = p.ffn_tiles * ta
        gate, up, down = _pad(wgu[:, :f], (dm, fp)), _pad(wgu[:, f:], (dm, fp)), _pad(wdn, (fp, dp))
        for t in range(p.ffn_tiles):
            cols = slice(t * ta, (t + 1) * ta)
            a_tiles += [gate[:, cols], up[:, cols]]
            b_tiles.append(down[cols])
    lm = _pad(np.asarray(params["lm_head"], np.float32), (dm, p.vocab_tiles * ta))
    a_tiles += [lm[:, t * ta : (t + 1) * ta] for t in range(p.vocab_tiles)]
    assert len(a_tiles) == p.n_a and len(b_tiles) == p.n_b, (len(a_tiles), p.n_a)
    wd = p.weight_dtype
    out = {
        "ring_a": jnp.asarray(np.stack(a_tiles), wd),
        "ring_b": jnp.asarray(np.stack(b_tiles), wd),
        "vec": jnp.asarray(vec),
        "final_norm": jnp.asarray(_pad(np.asarray(params["final_norm"])[None], (1, dp))),
        # Rows padded to lanes (`llama.pad_rows`, the family's params already are): a
        # [V, 576] table's default TPU layout is column-major, and the row gather re-laid the
        # whole table out before every step (compile-worker).
        "embed": jnp.asarray(pad_rows(np.asarray(params["embed"])), wd),
        "inv_freq": params["inv_freq"],
        "rope_scale": params["rope_scale"],
    }
    if p.moe_layers:
        out["router"] = jnp.asarray(np.stack(routers))
        out["expert_gu"] = jnp.asarray(np.stack(egus), wd)
        out["expert_down"] = jnp.asarray(np.stack(edowns), wd)
    for name, (shape, _) in p.hbm_shapes().items():
        assert out[name].shape == shape, (name, out[name].shape, shape)
    return out


def unpack_megakernel(plan: MegaPlan, mparams: dict) -> dict[str, Any]:
    """The family's params (`kernels.llama.finish_params` layout, f32) rebuilt from the rings.

    The inverse of `pack_megakernel`, in jnp (traceable), so `step.reference_step` can take
    the kernel's own arguments. Lane padding the packer added to the dense MLP and the
    experts' intermediate dim stays: zero gate/up columns and down rows add exact zeros.

    Args:
      plan: the kernel plan; mparams: `pack_megakernel` output.
    Returns:
      dict with embed, lm_head, final_norm, inv_freq, rope_scale, and per layer wqkv, wo,
      ln_attn, ln_mlp (+ q_norm, k_norm; router for MoE layers), w_gate_up, w_down.
    """
    p = plan
    dm, kv, group = p.hidden, p.kv, p.group

    def f32(a):
        return jnp.asarray(a).astype(jnp.float32)

    ring_a, ring_b, vec = f32(mparams["ring_a"]), f32(mparams["ring_b"]), f32(mparams["vec"])
    # Packed q column j (group-major) is original column `order[j]`; argsort inverts that.
    order = np.concatenate([group_columns(p, g) for g in range(group)])
    inverse = np.argsort(order)
    layers = []
    for li in range(p.num_layers):
        a0, b0 = p.a_base(li), p.b_base(li)
        wq = jnp.concatenate([ring_a[a0 + g, :, :kv] for g in range(group)], axis=1)[:, inverse]
        wk, wv = ring_a[a0 + group, :, :kv], ring_a[a0 + group + 1, :, :kv]
        wo = jnp.concatenate([ring_b[b0 + g, :kv, :dm] for g in range(group)], axis=0)[inverse]
        lp = {
            "wqkv": jnp.concatenate([wq, wk, wv], axis=1),
            "wo": wo,
            "ln_attn": vec[li, VecRow.LN_ATTN, :dm],
            "ln_mlp": vec[li, VecRow.LN_MLP, :dm],
        }
        if p.qkv_bias:
            rows = vec[li, VecRow.QKV_BIAS : VecRow.QKV_BIAS + group + 2, :kv]
            bq = rows[:group].reshape(-1)[inverse]
            lp["bqkv"] = jnp.concatenate([bq, rows[group], rows[group + 1]])
        if p.qk_norm:  # packed once per kv head; every copy is the same
            lp["q_norm"] = vec[li, VecRow.Q_NORM, : p.head_dim]
            lp["k_norm"] = vec[li, VecRow.K_NORM, : p.head_dim]
        if p.is_moe[li]:
            mi = p.moe_index(li)
            gate_up = f32(mparams["expert_gu"][mi])  # [E, 2, D, I_p]
            lp["router"] = f32(mparams["router"][mi])[:, : p.num_experts]
            lp["w_gate_up"] = jnp.concatenate([gate_up[:, 0], gate_up[:, 1]], axis=-1)
            lp["w_down"] = f32(mparams["expert_down"][mi])[:, :, :dm]
        else:
            first = a0 + group + 2  # gate, up alternate after q, k, v
            tiles = range(p.ffn_tiles)
            gate = jnp.concatenate([ring_a[first + 2 * t] for t in tiles], axis=1)
            up = jnp.concatenate([ring_a[first + 2 * t + 1] for t in tiles], axis=1)
            lp["w_gate_up"] = jnp.concatenate([gate, up], axis=1)
            down = [ring_b[b0 + group + t, :, :dm] for t in tiles]
            lp["w_down"] = jnp.concatenate(down, axis=0)
        layers.append(lp)
    lm_head = jnp.concatenate([ring_a[p.lm_base + t] for t in range(p.vocab_tiles)], axis=1)
    return {
        "embed": f32(mparams["embed"]),  # lane-padded rows, as the family's (`pad_rows`)
        "lm_head": lm_head[:, : p.vocab],
        "final_norm": f32(mparams["final_norm"])[0, :dm],
        "inv_freq": mparams["inv_freq"],
        "rope_scale": mparams["rope_scale"],
        "layers": layers,
    }


def abstract_params(plan: MegaPlan) -> dict[str, Any]:
    """ShapeDtypeStructs of `pack_megakernel`'s output, for AOT compilation at real shapes."""
    import jax

    out = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in plan.hbm_shapes().items()}
    out["final_norm"] = jax.ShapeDtypeStruct((1, plan.hidden_p), jnp.float32)
    # The whole vocabulary under tp too: every shard embeds its rows itself.
    vocab = plan.vocab_global or plan.vocab
    out["embed"] = jax.ShapeDtypeStruct((vocab, plan.hidden_p), plan.weight_dtype)
    out["inv_freq"] = jax.ShapeDtypeStruct((plan.head_dim // 2,), jnp.float32)
    out["rope_scale"] = jax.ShapeDtypeStruct((), jnp.float32)
    return out
