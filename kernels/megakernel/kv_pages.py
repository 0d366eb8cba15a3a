"""The KV page DMAs: reads of the pages each row attends to, writes of each row's new page."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.megakernel.body import Body, Dma, count_dma, each, rem


def _page_copies(ctx: Body, layer, item, j: int):
    """The K and V DMAs of page j of read item `item` (one block of one row) of `layer`, into
    rows j * page_size.. of the block buffer's slot item % depth; the slot's two semaphores
    count the bytes of all its pages."""
    r, p = ctx.refs, ctx.plan
    slot = rem(item, p.depth_kv)
    page = r["it_page"][item * p.pages_per_block + j]
    rows = pl.ds(j * p.page_size, p.page_size)
    return tuple(
        pltpu.make_async_copy(
            r[f"{x}_hbm"].at[layer, page], r[f"{x}buf"].at[slot, rows], r["sem_kv"].at[slot, i]
        )
        for i, x in enumerate("kv")
    )


def _each_page(ctx: Body, layer, item, method: str) -> None:
    """Starts or waits the page DMAs of read item `item`: only its `it_cnt` pages exist."""
    count = ctx.refs["it_cnt"][item]
    for j in range(ctx.plan.pages_per_block):

        @pl.when(j < count)
        def _(j=j):
            each(_page_copies(ctx, layer, item, j), method)
            if method == "start":
                for _ in range(2):
                    count_dma(
                        ctx.counter,
                        Dma.KV_READ,
                        ctx.refs["kbuf"].at[0, pl.ds(0, ctx.plan.page_size)],
                    )


def kv_read_wait(ctx: Body, layer, item) -> None:
    """Waits for read item `item`'s page DMAs."""
    _each_page(ctx, layer, item, "wait")


def kv_read_start(ctx: Body, layer, item) -> None:
    """Starts read item `item`'s page DMAs."""
    _each_page(ctx, layer, item, "start")


def kv_prime(ctx: Body, layer) -> None:
    """Starts the first `depth_kv` read items of `layer` (those that exist)."""
    for item in range(ctx.plan.depth_kv):
        pl.when(item < ctx.n_items)(lambda item=item: kv_read_start(ctx, layer, item))


def kv_write_copies(ctx: Body, layer, row: int):
    """The DMAs writing row `row`'s new-token page (K and V) back into the pool, or under tp
    into the `k_pages`/`v_pages` outputs [L, B, page_size, kv_row] that XLA puts in the pool
    after the kernel (`plan.pages_out`)."""
    r = ctx.refs

    def target(x):
        if ctx.plan.pages_out:
            return r[f"{x}_pages"].at[layer, row]
        return r[f"{x}_out"].at[layer, r["wpage"][row]]

    return tuple(
        pltpu.make_async_copy(r[f"{x}w"].at[row], target(x), r["sem_w"].at[row, i])
        for i, x in enumerate("kv")
    )
