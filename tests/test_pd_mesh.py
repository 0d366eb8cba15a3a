"""P/D across mesh sizes: prefill and decode workers with different --tp hand the KV over in
the one-device wire layout and give the tokens of one device and of transformers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megaserve.kv import wire
from megaserve.parallel.mesh import with_device_count
from megaserve.rpc import prefill_pb2
from megaserve.sampling_params import SamplingParams
from megaserve_app.launch import megaserve_cmd
from tests.conftest import FIXTURES, REPO
from tests.stack import disagg_generate, mesh_cluster, solo_generator

FIX = FIXTURES / "tiny" / "llama_gqa2"  # 4 query / 2 KV heads: tp=4 stores each KV head twice
PS = 4  # small pages: the 12-token reference prompt spans 3
L, HKV, HD = 2, 2, 16  # the fixture's layers, KV heads, head_dim
WORKERS = {"p4": ("prefill", 4), "p2": ("prefill", 2), "d2": ("decode", 2), "d4": ("decode", 4)}
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=5)


def _env(devices: int) -> dict:
    flags = with_device_count(os.environ.get("XLA_FLAGS", ""), devices)
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


@pytest.fixture(scope="module")
def mesh_stack(tmp_path_factory):
    """Prefill workers at tp 4 and 2, decode workers at tp 2 and 4 (each a real process with
    its own forced host devices), registered in one Redis; programs compile on first use."""
    workers = {w: (kind, ("--tp", str(tp))) for w, (kind, tp) in WORKERS.items()}
    with mesh_cluster(tmp_path_factory.mktemp("pd_mesh"), FIX, "gqa2", workers, PS) as out:
        yield out


@pytest.fixture(scope="module")
def solo():
    """One device, in this process: the co-located tokens each hand-off must give."""
    return solo_generator(FIX, PS, 64, 32)


def _ask(st, pre, dec, rid, prompt, n, sp=GREEDY, transport=prefill_pb2.TRANSPORT_GRPC):
    """(reserve, prefill, tokens) of one request on decode worker `dec`, its KV from `pre`
    (None: `dec` prefills it itself)."""
    p_addr = st.procs[pre].address if pre else None
    coro = disagg_generate(st.procs[dec].address, p_addr, rid, prompt, n, sp, transport)
    return asyncio.run(coro)


@pytest.mark.parametrize("pre,dec", [("p4", "d2"), ("p2", "d4")], ids=["tp4-tp2", "tp2-tp4"])
def test_handoff_across_meshes(mesh_stack, solo, pre, dec):
    """The reference prompt handed from one mesh to the other decodes transformers' greedy
    tokens; each page travels once, without replicas; a prompt extending it sends only the
    pages the decode worker lacks; seeded sampling over the jax transfer and co-located
    serving on the tp decode worker give one device's tokens."""
    st, _ = mesh_stack
    ref = json.loads((FIX / "reference.json").read_text())
    prompt, want = ref["prompt_ids"], ref["greedy_ids"]
    res, pr, toks = _ask(st, pre, dec, f"{pre}-{dec}-ref", prompt, len(want))
    assert toks == want
    assert (res.cached_pages, pr.pages_sent) == (0, 3)
    assert pr.bytes_sent == 3 * 2 * L * PS * HKV * HD * 4  # one-device rows: no replica sent
    k = 9
    res, pr, toks = _ask(st, pre, dec, f"{pre}-{dec}-ext", prompt + want[:k], len(want) - k)
    assert toks == want[k:]
    assert res.cached_pages > 0 and pr.pages_sent == res.total_pages - res.cached_pages
    rng = np.random.default_rng(WORKERS[dec][1])
    other, fresh = (rng.integers(0, 512, n).tolist() for n in (30, 19))
    jax_t = prefill_pb2.TRANSPORT_JAX_TRANSFER
    _, pr, toks = _ask(st, pre, dec, f"{pre}-{dec}-jax", other, 8, SAMPLED, jax_t)
    assert pr.pages_sent == 8 and toks == solo.generate(other, 8, SAMPLED, True).token_ids
    _, _, toks = _ask(st, None, dec, f"{dec}-own", fresh, 8)
    assert toks == solo.generate(fresh, 8, ignore_eos=True).token_ids
    _, _, toks = _ask(st, None, dec, f"{dec}-own-ref", prompt, len(want))
    assert toks == want


def test_workers_register_their_tp(mesh_stack):
    import redis

    from megaserve.state_keys import WorkerInfo, worker_key

    st, rs = mesh_stack
    r = redis.Redis.from_url(rs.url)
    got = {w: WorkerInfo.from_hash(r.hgetall(worker_key(w))).tp for w in WORKERS}
    assert got == {w: tp for w, (_, tp) in WORKERS.items()}


def test_bad_tp_exits_2_naming_the_numbers():
    cases = {
        "tp=3 does not divide num_attention_heads=4": ("decode-worker", "3"),
        "tp=0 must be an integer >= 1": ("prefill-worker", "0"),
    }
    procs = {
        msg: subprocess.Popen(
            megaserve_cmd(kind, "--checkpoint", str(FIX), "--tp", tp, "--warm-up", "none"),
            cwd=REPO,
            env=_env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for msg, (kind, tp) in cases.items()
    }
    for msg, p in procs.items():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and msg in err, err[-2000:]


def test_header_of_other_kv_heads_is_refused():
    """What a sender's replicated rows (a tp=4 pool's 4 stored heads) would announce, or
    another head_dim: refused before any page lands, naming the numbers."""
    geo = wire.PageGeometry(L, PS, HKV, HD, "float32")
    for sent, match in [
        (dataclasses.replace(geo, kv_heads=4), r"KV heads \[0, 4\): this receiver's model has 2"),
        (dataclasses.replace(geo, head_dim=8), "head_dim=8, the pool's heads have 16"),
    ]:
        with pytest.raises(wire.TransferError, match=match):
            wire.check_header(wire.header("r", sent, 0, 3).header, geo)


def test_stored_row_with_lane_padding():
    """A TPU-style stored row (each shard's block padded to 128 lanes) round-trips: the
    heads land in their shards' blocks (replicas repeated), padding zero, and come back."""
    from megaserve.parallel.tp_pool import StoredRow

    x = np.random.default_rng(1).standard_normal((2, 3, HKV * HD)).astype(np.float32)
    for row in (StoredRow(4, 1, 2, HD, 128), StoredRow(2, 1, 1, HD, 128)):
        stored = np.asarray(row.from_model(x)).reshape(2, 3, row.tp, 128)
        heads = np.repeat(x.reshape(2, 3, HKV, HD), row.replicas, axis=2)
        assert np.array_equal(stored[..., :HD], heads) and not stored[..., HD:].any()
        assert np.array_equal(np.asarray(row.to_model(row.from_model(x))), x)


def resplit_checks() -> None:
    """Run with 4 host devices (`test_pages_resplit_between_meshes`): one-device pages into
    a tp=4 pool (each KV head stored twice), out in the wire layout as device arrays, into a
    tp=2 pool: every read gives the pages back and the tp=2 pool stores one device's rows."""
    from kernels.kv_cache import KVPool
    from kernels.llama import LlamaConfig
    from megaserve.parallel.mesh import ParallelConfig
    from megaserve.parallel.tp_pool import tp_pool

    cfg = LlamaConfig.from_hf(json.loads((FIX / "config.json").read_text()))
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((L, 3, PS, HKV, HD)).astype(np.float32) for _ in "kv")
    p4, p2 = (tp_pool(cfg, ParallelConfig(tp=n), 8, PS, np.float32) for n in (4, 2))
    src, dst = np.array([5, 2, 7]), np.array([1, 3, 4])
    p4.write_pages(src, k, v)
    stored = np.asarray(p4.k)[:, src].reshape(L, 3, PS, 4, HD)
    assert np.array_equal(stored, np.repeat(k, 2, axis=3))  # heads 0 0 1 1
    for off, pk, pv in p4.read_pages(src):  # one device's arrays, as a pull hands them over
        shape = p2.heads_shape(pk.shape[1])
        p2.write_pages(dst[off : off + pk.shape[1]], pk.reshape(shape), pv.reshape(shape))
    one = KVPool.create(L, 8, PS, HKV, HD)
    one.write_pages(dst, k, v)
    assert np.array_equal(np.asarray(p2.k), np.asarray(one.k))
    assert np.array_equal(np.asarray(p2.v), np.asarray(one.v))
    for pool, pages in [(p4, src), (p2, dst)]:
        got = wire.extract_pages(pool, pages)
        assert np.array_equal(got[0], k) and np.array_equal(got[1], v)
    assert wire.PageGeometry.of_pool(p4) == wire.PageGeometry.of_pool(one)
    print("resplit ok")


def test_pages_resplit_between_meshes():
    code = "from tests.test_pd_mesh import resplit_checks; resplit_checks()"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=_env(4), capture_output=True, text=True
    )
    assert run.returncode == 0 and "resplit ok" in run.stdout, run.stderr[-4000:]
