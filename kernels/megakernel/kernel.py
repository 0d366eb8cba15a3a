"""The decode megakernel body: every layer of one decode step for the whole batch in one kernel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.plan import LANES, MegaPlan

# Kinds of DMA, indexing the optional per-kind byte counter (`plan.count_dmas`).
DMA_KINDS = ("ring_a", "ring_b", "vec", "router", "experts", "kv_read", "kv_write")
_HI = lax.Precision.HIGHEST
_NEG = -1e30
_BIG = 1 << 30


def _dot(a, b, precision=None):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _rem(k, n: int):
    return k % n if isinstance(k, int) else lax.rem(k, jnp.int32(n))


@dataclass
class Ring:
    """A ring of `depth` VMEM slots streaming hbm[0], hbm[1], ... hbm[n-1] in that order.

    Load k lives in slot k % depth; consuming k (take, use, refill) issues load k + depth, so
    `depth - 1` loads stay in flight while one is used, across layer boundaries and on into
    the lm_head tiles, because the HBM array is stored in consumption order.
    """

    hbm: Any
    buf: Any
    sem: Any
    depth: int
    n: int
    counter: Any
    kind: int

    def _copy(self, k, slot):
        return pltpu.make_async_copy(self.hbm.at[k], self.buf.at[slot], self.sem.at[slot])

    def start(self, k):
        self._copy(k, _rem(k, self.depth)).start()
        _count(self.counter, self.kind, self.buf.at[0])

    def prime(self):
        for k in range(min(self.depth, self.n)):
            self.start(k)

    def take(self, k):
        slot = _rem(k, self.depth)
        self._copy(k, slot).wait()
        return slot

    def refill(self, k):
        nxt = k + self.depth
        if isinstance(nxt, int):
            if nxt < self.n:
                self.start(nxt)
        else:
            pl.when(nxt < self.n)(lambda: self.start(nxt))


def _count(counter, kind: int, ref) -> None:
    """Adds the bytes of one DMA of `ref`'s shape to the in-kernel counter (tests only)."""
    if counter is None:
        return
    n = ref.dtype.itemsize
    for s in ref.shape:
        n *= s
    counter[kind] = counter[kind] + n


def _each(copies, method: str) -> None:
    for c in copies:
        getattr(c, method)()


def _rms(x, w, n: int, eps: float):
    """RMSNorm over the first n lanes of f32[B, W] (the padding lanes are zero)."""
    var = jnp.sum(x * x, axis=-1, keepdims=True) * (1.0 / n)
    return w * (x * lax.rsqrt(var + eps))


def kernel_body(plan: MegaPlan, *refs) -> None:
    """The pallas_call body; `refs` follow `operand_names(plan)` then `plan.scratch()`."""
    p = plan
    names = operand_names(p) + [s.name for s in p.scratch()]
    assert len(names) == len(refs), (len(names), len(refs))
    r = dict(zip(names, refs))
    counter = r.get("dma_count_out")
    if counter is not None:
        for i in range(len(DMA_KINDS)):
            counter[i] = 0
    g_, kv, ta, dp, dm, hd, ps = p.group, p.kv, p.ta, p.hidden_p, p.hidden, p.head_dim, p.page_size
    b_ = p.batch
    shift = hd.bit_length() - 1
    # Matmul inputs: bf16 on the MXU (f32 accumulation). `act_dtype=f32` upcasts each weight
    # tile in VMEM instead, so tests can check the kernel's logic to f32 precision.
    wd = p.act_dtype

    def w(tile):
        return tile if tile.dtype == wd else tile.astype(wd)

    kvd = p.kv_dtype
    pos, wpage, wslot, wlast = r["pos"], r["wpage"], r["wslot"], r["wlast"]
    it_seq, it_page, it_idx, n_items = r["it_seq"], r["it_page"], r["it_idx"], r["meta"][0]

    ring_a = Ring(r["ring_a_hbm"], r["ring_a"], r["sem_a"], p.depth_a, p.n_a, counter, 0)
    ring_b = Ring(r["ring_b_hbm"], r["ring_b"], r["sem_b"], p.depth_b, p.n_b, counter, 1)
    vecs = Ring(r["vec_hbm"], r["vec"], r["sem_vec"], 2, p.num_layers, counter, 2)
    router = None
    if p.moe_layers:
        router = Ring(
            r["router_hbm"], r["router"], r["sem_router"], 2, len(p.moe_layers), counter, 3
        )

    # Head-segment matrices: seg[j, h] = 1 when lane j of a K/V row belongs to kv head h.
    # Per-head sums become one small matmul, so no head is ever sliced out of its lanes.
    def seg_matrix(rows, cols, transpose):
        a = lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
        c = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
        lane, head = (c, a) if transpose else (a, c)
        return ((lane >> shift == head) & (lane < kv)).astype(jnp.float32)

    r["seg"][...] = seg_matrix(kv, LANES, False)
    r["seg_t"][...] = seg_matrix(LANES, kv, True)
    r["attn"][...] = jnp.zeros(r["attn"].shape, jnp.float32)
    r["h"][...] = r["h0"][...]
    ring_a.prime()
    ring_b.prime()
    vecs.start(0)
    if router is not None:
        router.prime()

    def kv_copies(layer, i):
        slot = _rem(i, p.depth_kv)
        page = it_page[i]
        return (
            pltpu.make_async_copy(
                r["k_hbm"].at[layer, page], r["kbuf"].at[slot], r["sem_kv"].at[slot, 0]
            ),
            pltpu.make_async_copy(
                r["v_hbm"].at[layer, page], r["vbuf"].at[slot], r["sem_kv"].at[slot, 1]
            ),
        )

    def kv_start(layer, i):
        for c in kv_copies(layer, i):
            c.start()
            _count(counter, 5, r["kbuf"].at[0])

    def kv_prime(layer):
        for i in range(p.depth_kv):
            pl.when(i < n_items)(lambda i=i: kv_start(layer, i))

    kv_prime(0)

    def write_copies(layer, b):
        return (
            pltpu.make_async_copy(
                r["kw"].at[b], r["k_out"].at[layer, wpage[b]], r["sem_w"].at[b, 0]
            ),
            pltpu.make_async_copy(
                r["vw"].at[b], r["v_out"].at[layer, wpage[b]], r["sem_w"].at[b, 1]
            ),
        )

    lane_ta = lax.broadcasted_iota(jnp.int32, (b_, ta), 1)
    first_half = (lane_ta & (hd - 1)) < hd // 2
    seg_p = seg_matrix(ta, LANES, False)
    seg_pt = seg_matrix(LANES, ta, True)
    row_ps = lax.broadcasted_iota(jnp.int32, (ps, kv), 0)
    row_ps1 = lax.broadcasted_iota(jnp.int32, (ps, 1), 0)

    def rope(y):
        # rotate_half within each head: lanes of the first half take -x[j + D/2], the
        # second half x[j - D/2]; rolls over the whole 128-aligned row never cross a head
        # for the lanes that are kept.
        fwd = pltpu.roll(y, ta - hd // 2, 1)
        back = pltpu.roll(y, hd // 2, 1)
        return y * r["cos"][...] + jnp.where(first_half, -fwd, back) * r["sin"][...]

    def head_norm(y, w):
        ms = _dot(y * y, seg_p, _HI) * (1.0 / hd)
        return w * (y * _dot(lax.rsqrt(ms + p.eps), seg_pt, _HI))

    def attention(layer, a0, b0, vslot):
        """q/k/v tiles, paged online-softmax attention, KV page writes, o_proj."""
        ln = r["vec"][vslot, 0:1, :dp]
        xb = _rms(r["h"][...], ln, dm, p.eps)[:, :dm].astype(wd)

        def proj(j):
            slot = ring_a.take(a0 + j)
            y = _dot(xb, w(r["ring_a"][slot]))
            ring_a.refill(a0 + j)
            return y

        scale = hd**-0.5
        for g in range(g_):
            y = proj(g)
            if p.qk_norm:
                y = head_norm(y, r["vec"][vslot, 2:3, :ta])
            y = rope(y) * scale
            for b in range(b_):
                r["q"][b, g] = y[b : b + 1, :kv]
        k = proj(g_)
        if p.qk_norm:
            k = head_norm(k, r["vec"][vslot, 3:4, :ta])
        # Rounded as the pool stores them, so this token's own score matches a re-read.
        k = rope(k)[:, :kv].astype(kvd).astype(jnp.float32)
        v = proj(g_ + 1)[:, :kv].astype(kvd).astype(jnp.float32)
        for b in range(b_):
            kb, vb = k[b : b + 1], v[b : b + 1]
            r["kw"][b] = jnp.where(row_ps == wslot[b], kb, 0.0).astype(kvd)
            r["vw"][b] = jnp.where(row_ps == wslot[b], vb, 0.0).astype(kvd)
            # The online softmax starts from the new token itself: every row has one finite
            # score before any page is read, so masked pages can never divide by zero.
            for g in range(g_):
                r["m"][b, g] = _dot(r["q"][b, g] * kb, r["seg"][...], _HI)
                r["l"][b, g] = jnp.ones((1, LANES), jnp.float32)
                r["acc"][b, g] = vb

        def item(i, carry):
            slot = _rem(i, p.depth_kv)
            for c in kv_copies(layer, i):
                c.wait()
            b, pidx = it_seq[i], it_idx[i]
            kp, vp = r["kbuf"][slot], r["vbuf"][slot]

            @pl.when(pidx == wlast[b])
            def _merge():  # the page this step rewrites keeps every other row as it was
                r["kw"][b] = jnp.where(row_ps == wslot[b], r["kw"][b], kp)
                r["vw"][b] = jnp.where(row_ps == wslot[b], r["vw"][b], vp)

            valid = pidx * ps + row_ps1 < pos[b]
            kf = jnp.where(valid, kp.astype(jnp.float32), 0.0)
            vf = jnp.where(valid, vp.astype(jnp.float32), 0.0)
            for g in range(g_):
                s = _dot(kf * r["q"][b, g], r["seg"][...], _HI)
                s = jnp.where(valid, s, _NEG)
                m_old = r["m"][b, g]
                m_new = jnp.maximum(m_old, jnp.max(s, axis=0, keepdims=True))
                alpha = jnp.exp(m_old - m_new)
                pr = jnp.exp(s - m_new)
                r["m"][b, g] = m_new
                r["l"][b, g] = alpha * r["l"][b, g] + jnp.sum(pr, axis=0, keepdims=True)
                pv = jnp.sum(_dot(pr, r["seg_t"][...], _HI) * vf, axis=0, keepdims=True)
                r["acc"][b, g] = r["acc"][b, g] * _dot(alpha, r["seg_t"][...], _HI) + pv
            pl.when(i + p.depth_kv < n_items)(lambda: kv_start(layer, i + p.depth_kv))
            return carry

        lax.fori_loop(0, n_items, item, 0)
        # The next layer's first pages load while this layer's o_proj and MLP stream.
        pl.when(layer + 1 < p.num_layers)(lambda: kv_prime(layer + 1))
        for b in range(b_):
            pl.when(pos[b] >= 0)(lambda b=b: _each(write_copies(layer, b), "start"))
            if counter is not None:
                for _ in range(2):
                    pl.when(pos[b] >= 0)(lambda: _count(counter, 6, r["kw"].at[0]))
            for g in range(g_):
                den = _dot(r["l"][b, g], r["seg_t"][...], _HI)
                r["attn"][g, b : b + 1, :kv] = r["acc"][b, g] / den
        o = jnp.zeros((b_, dp), jnp.float32)
        for g in range(g_):
            slot = ring_b.take(b0 + g)
            o = o + _dot(r["attn"][g].astype(wd), w(r["ring_b"][slot]))
            ring_b.refill(b0 + g)
        r["h"][...] = r["h"][...] + o

    def dense_mlp(a0, b0, vslot):
        x = _rms(r["h"][...], r["vec"][vslot, 1:2, :dp], dm, p.eps)[:, :dm].astype(wd)
        y = jnp.zeros((b_, dp), jnp.float32)
        for t in range(p.ffn_tiles):
            ka, kb = a0 + g_ + 2 + 2 * t, b0 + g_ + t
            slot = ring_a.take(ka)
            gate = _dot(x, w(r["ring_a"][slot]))
            ring_a.refill(ka)
            slot = ring_a.take(ka + 1)
            up = _dot(x, w(r["ring_a"][slot]))
            ring_a.refill(ka + 1)
            act = (gate * jax.nn.sigmoid(gate) * up).astype(wd)
            slot = ring_b.take(kb)
            y = y + _dot(act, w(r["ring_b"][slot]))
            ring_b.refill(kb)
        r["h"][...] = r["h"][...] + y

    def moe_mlp(mi, vslot):
        """Routing in-kernel; then only the batch's distinct selected experts are fetched."""
        x = _rms(r["h"][...], r["vec"][vslot, 1:2, :dp], dm, p.eps)[:, :dm]
        rslot = router.take(mi)
        logits = _dot(x, r["router"][rslot], _HI)
        router.refill(mi)
        ep = p.experts_p
        lane = lax.broadcasted_iota(jnp.int32, (b_, ep), 1)
        logits = jnp.where(lane < p.num_experts, logits, _NEG)
        ex = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        probs = ex / jnp.sum(ex, axis=1, keepdims=True)
        rows = lax.broadcasted_iota(jnp.int32, (b_, 1), 0)
        live = jnp.zeros((b_, 1), jnp.bool_)
        for b in range(b_):
            live = live | ((rows == b) & (pos[b] >= 0))
        coef = jnp.zeros((b_, ep), jnp.float32)
        chosen = jnp.zeros((b_, ep), jnp.bool_)
        for _ in range(p.top_k):  # ties go to the lower expert id, as lax.top_k
            mx = jnp.max(probs, axis=1, keepdims=True)
            idx = jnp.min(jnp.where(probs == mx, lane, _BIG), axis=1, keepdims=True)
            sel = lane == idx
            coef = jnp.where(sel, mx, coef)
            chosen = chosen | sel
            probs = jnp.where(sel, -1.0, probs)
        if p.norm_topk_prob:
            coef = coef / jnp.sum(coef, axis=1, keepdims=True)
        coef = jnp.where(live, coef, 0.0)  # padding rows fetch no experts
        used = jnp.max(jnp.where(chosen & live, 1, 0), axis=0, keepdims=True)
        r["used_v"][...] = used.astype(jnp.int32)
        cp = pltpu.make_async_copy(r["used_v"], r["used_s"], r["sem_used"].at[0])
        cp.start()
        cp.wait()

        def compact(e, n):
            r["elist"][n] = e
            return n + r["used_s"][0, e]

        n_used = lax.fori_loop(0, p.num_experts, compact, jnp.int32(0))

        def e_copies(u):
            slot, e = _rem(u, p.depth_e), r["elist"][u]
            return (
                pltpu.make_async_copy(
                    r["expert_gu_hbm"].at[mi, e], r["egu"].at[slot], r["sem_e"].at[slot, 0]
                ),
                pltpu.make_async_copy(
                    r["expert_down_hbm"].at[mi, e], r["edown"].at[slot], r["sem_e"].at[slot, 1]
                ),
            )

        def e_start(u):
            for c, ref in zip(e_copies(u), (r["egu"], r["edown"])):
                c.start()
                _count(counter, 4, ref.at[0])

        for u in range(p.depth_e):  # issued as soon as routing is known
            pl.when(u < n_used)(lambda u=u: e_start(u))
        xb = x.astype(wd)

        def expert(u, y):
            slot = _rem(u, p.depth_e)
            for c in e_copies(u):
                c.wait()
            gate = _dot(xb, w(r["egu"][slot, 0]))
            up = _dot(xb, w(r["egu"][slot, 1]))
            act = (gate * jax.nn.sigmoid(gate) * up).astype(wd)
            ye = _dot(act, w(r["edown"][slot]))
            c = jnp.sum(jnp.where(lane == r["elist"][u], coef, 0.0), axis=1, keepdims=True)
            pl.when(u + p.depth_e < n_used)(lambda: e_start(u + p.depth_e))
            return y + c * ye

        y = lax.fori_loop(0, n_used, expert, jnp.zeros((b_, dp), jnp.float32))
        r["h"][...] = r["h"][...] + y

    def layer_fn(moe: bool, l0: int):
        na, nb = p.a_per_layer(moe), p.b_per_layer(moe)
        a_start, b_start, m_start = p.a_base(l0), p.b_base(l0), p.moe_index(l0)

        def body(i, carry):
            layer = l0 + i
            vslot = vecs.take(layer)
            pl.when(layer + 1 < p.num_layers)(lambda: vecs.start(layer + 1))
            a0, b0 = a_start + i * na, b_start + i * nb
            attention(layer, a0, b0, vslot)
            if moe:
                moe_mlp(m_start + i, vslot)
            else:
                dense_mlp(a0, b0, vslot)
            for b in range(b_):
                pl.when(pos[b] >= 0)(lambda b=b: _each(write_copies(layer, b), "wait"))
            return carry

        return body

    for moe, l0, n in p.segments:
        lax.fori_loop(0, n, layer_fn(moe, l0), 0)

    # Final norm, then lm_head vocab tiles from the same ring with a running greedy argmax.
    xf = _rms(r["h"][...], r["final_norm"][...], dm, p.eps)[:, :dm].astype(wd)
    lane = lax.broadcasted_iota(jnp.int32, (b_, ta), 1)

    def vocab_tile(t, carry):
        best_v, best_i = carry
        k = p.lm_base + t
        slot = ring_a.take(k)
        lg = _dot(xf, w(r["ring_a"][slot]))
        ring_a.refill(k)
        col = t * ta + lane
        lg = jnp.where(col < p.vocab, lg, -jnp.inf)
        if p.emit_logits:
            r["logits"][t] = lg
        mx = jnp.max(lg, axis=1, keepdims=True)
        ix = jnp.min(jnp.where(lg == mx, col, _BIG), axis=1, keepdims=True)
        better = mx > best_v  # strict: the earlier tile keeps ties (first index wins)
        return jnp.where(better, mx, best_v), jnp.where(better, ix, best_i)

    init = (jnp.full((b_, 1), -jnp.inf, jnp.float32), jnp.zeros((b_, 1), jnp.int32))
    _, best = lax.fori_loop(0, p.vocab_tiles, vocab_tile, init)
    r["tokens"][...] = jnp.broadcast_to(best, (b_, LANES))


SCALARS = ("pos", "wpage", "wslot", "wlast", "it_seq", "it_page", "it_idx", "meta")


def input_names(plan: MegaPlan) -> list[str]:
    names = ["h0", "cos", "sin", "final_norm", "ring_a_hbm", "ring_b_hbm", "vec_hbm"]
    if plan.moe_layers:
        names += ["router_hbm", "expert_gu_hbm", "expert_down_hbm"]
    return names + ["k_hbm", "v_hbm"]


def output_names(plan: MegaPlan) -> list[str]:
    names = ["tokens"] + (["logits"] if plan.emit_logits else []) + ["k_out", "v_out"]
    return names + (["dma_count_out"] if plan.count_dmas else [])


def operand_names(plan: MegaPlan) -> list[str]:
    return list(SCALARS) + input_names(plan) + output_names(plan)
