"""The KV page DMAs: reads of the pages each row attends to, writes of each row's new page."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import Body, Dma, count_dma, rem


def kv_read_copies(ctx: Body, layer, item):
    """The K and V page DMAs of read item `item` of `layer`, into KV ring slot item % depth."""
    r = ctx.refs
    slot = rem(item, ctx.plan.depth_kv)
    page = r["it_page"][item]
    return (
        pltpu.make_async_copy(
            r["k_hbm"].at[layer, page], r["kbuf"].at[slot], r["sem_kv"].at[slot, 0]
        ),
        pltpu.make_async_copy(
            r["v_hbm"].at[layer, page], r["vbuf"].at[slot], r["sem_kv"].at[slot, 1]
        ),
    )


def kv_read_start(ctx: Body, layer, item) -> None:
    """Starts read item `item`'s two page DMAs."""
    for copy in kv_read_copies(ctx, layer, item):
        copy.start()
        count_dma(ctx.counter, Dma.KV_READ, ctx.refs["kbuf"].at[0])


def kv_prime(ctx: Body, layer) -> None:
    """Starts the first `depth_kv` read items of `layer` (those that exist)."""
    for item in range(ctx.plan.depth_kv):
        pl.when(item < ctx.n_items)(lambda item=item: kv_read_start(ctx, layer, item))


def kv_write_copies(ctx: Body, layer, row: int):
    """The DMAs writing row `row`'s new-token page (K and V) back into the pool."""
    r = ctx.refs
    return (
        pltpu.make_async_copy(
            r["kw"].at[row], r["k_out"].at[layer, r["wpage"][row]], r["sem_w"].at[row, 0]
        ),
        pltpu.make_async_copy(
            r["vw"].at[row], r["v_out"].at[layer, r["wpage"][row]], r["sem_w"].at[row, 1]
        ),
    )
