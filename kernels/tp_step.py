"""Tensor-parallel whole-step programs: `xla_step`'s prefill and decode under shard_map."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kernels.llama import LlamaConfig
from kernels.tp_llama import (
    AXIS,
    KV_SPEC,
    REPLICATED,
    TpLayout,
    distributed_argmax,
    gather_vocab,
)
from kernels.tp_moe import shard_forward
from kernels.xla_step import decode_program, pick, prefill_logprobs_program

LOGITS_SPEC = P(None, AXIS)  # f32[B, V] leave the step vocab-sharded; the host gathers them


def tp_pick(cfg: LlamaConfig, lay: TpLayout, local: jnp.ndarray, s: dict, pos: jnp.ndarray):
    """`xla_step.pick` on vocab-sharded logits f32[B, vocab_local]: an all-greedy batch takes
    the distributed argmax ([tp, B, 2] on the wire); a batch with a sampled or penalized row
    gathers the whole rows (B x V) and runs `pick` on every shard alike (same logits, same
    keys: the same tokens)."""

    def whole(_):
        return pick(gather_vocab(local, cfg), s, pos)

    if "counts" in s:  # penalties read whole rows
        return whole(None)
    greedy = distributed_argmax(local, lay)
    # The predicate is replicated, so every shard takes the same branch (and its collectives).
    return jax.lax.cond(jnp.any(s["temperature"] > 0), whole, lambda _: greedy, None)


def _shard(mesh: Any, specs: dict, n_rest: int, out_specs: tuple, body):
    """shard_map over (params, k, v, *n_rest replicated host inputs)."""
    in_specs = (specs, KV_SPEC, KV_SPEC, *([REPLICATED] * n_rest))
    # check_vma=False: the one-device attention (`paged_attention`) starts its loop carries
    # as fresh (invariant) zeros that the loop makes shard-varying, which the varying-axis
    # type check refuses; the layers run that code unchanged rather than pcast inside it.
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def tp_prefill_program(cfg, lay, mesh, specs, params, k, v, tokens, positions, pt, last, s):
    """`xla_step.prefill_program` over tp shards (same arguments and returns)."""

    def body(params, k, v, tokens, positions, pt, last, s):
        logits, k, v = shard_forward(cfg, lay, params, tokens, positions, k, v, pt, last)
        pos = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0] + 1
        return tp_pick(cfg, lay, logits, s, pos), logits, k, v

    out = (REPLICATED, LOGITS_SPEC, KV_SPEC, KV_SPEC)
    nxt, logits, k, v = _shard(mesh, specs, 5, out, body)(
        params, k, v, tokens, positions, pt, last, s
    )
    return nxt, logits[:, : cfg.vocab_size], k, v


def tp_prefill_logprobs_program(cfg, lay, mesh, specs, top_k, params, k, v, *rest):
    """`xla_step.prefill_logprobs_program` over tp shards: every position's logits are
    gathered whole (B x T x V: scoring requests are rare) and scored alike on each shard."""

    def forward(cfg, params, tokens, positions, k, v, pt, idx):
        local, k, v = shard_forward(cfg, lay, params, tokens, positions, k, v, pt, idx)
        return gather_vocab(local, cfg), k, v

    gathered = SimpleNamespace(forward=forward)  # a family whose logits are whole rows
    body = partial(prefill_logprobs_program, gathered, cfg, top_k)
    out = (*([REPLICATED] * 5), KV_SPEC, KV_SPEC)
    return _shard(mesh, specs, 6, out, body)(params, k, v, *rest)


def tp_decode_program(cfg, lay, mesh, specs, n_steps, want_logits, params, k, v, tok, pos, pt, s):
    """`xla_step.decode_program` over tp shards (same arguments and returns)."""

    def forward(cfg, params, tokens, positions, k, v, pt, idx):
        return shard_forward(cfg, lay, params, tokens, positions, k, v, pt, idx)

    sharded = SimpleNamespace(forward=forward)  # a family whose logits are vocab slices
    choose = partial(tp_pick, cfg, lay)
    body = partial(decode_program, sharded, cfg, n_steps, want_logits, choose=choose)
    out = (REPLICATED, P(None, None, AXIS) if want_logits else None, KV_SPEC, KV_SPEC)
    toks, logits, k, v = _shard(mesh, specs, 4, out, body)(params, k, v, tok, pos, pt, s)
    return toks, (logits[..., : cfg.vocab_size] if want_logits else None), k, v


def tp_jit(fn, mesh: Any, specs: dict, n_rest: int):
    """`fn(params, k, v, *rest)` jitted with its inputs placed as the shard_map reads them
    (abstract arguments without shardings, as warm-up lowers them, then compile the same
    program) and the pool donated."""
    named = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    kv, repl = NamedSharding(mesh, KV_SPEC), NamedSharding(mesh, REPLICATED)
    return jax.jit(fn, in_shardings=(named, kv, kv, *([repl] * n_rest)), donate_argnums=(1, 2))
