"""--ep on the worker commands: a Qwen3-MoE decode worker over tp 2 x ep 2 devices gives
transformers' greedy tokens; a prefill worker over ep 2 hands the KV to it (another mesh) in
the one-device wire layout; a --tp/--ep the model cannot split exits 2 naming the numbers
before any weights load; `megaserve serve` passes --tp/--ep to its workers."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess

import numpy as np
import pytest

from megaserve.errors import MeshError
from megaserve.parallel.distributed import GroupConfig
from megaserve.parallel.mesh import ParallelConfig
from megaserve.rpc import prefill_pb2
from megaserve.sampling_params import SamplingParams
from megaserve.worker_args import check_checkpoint_fits, parallel_from_args
from megaserve_app.launch import child_env, megaserve_cmd
from tests.conftest import FIXTURES, REPO
from tests.stack import disagg_generate, mesh_cluster, solo_generator

FIX = FIXTURES / "tiny" / "qwen3_moe_e8k2"  # 8 experts, top 2; 4 query / 2 KV heads
DENSE = FIXTURES / "tiny" / "llama_gqa2"
PS = 4  # small pages: the 10-token reference prompt spans 3
L, HKV, HD = 2, 2, 16  # the fixture's layers, KV heads, head_dim
WORKERS = {"p-ep2": ("prefill", 1, 2), "d-tp2-ep2": ("decode", 2, 2)}
PRE, DEC = WORKERS
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=5)


@pytest.fixture(scope="module")
def ep_stack(tmp_path_factory):
    """A prefill worker over tp 1 x ep 2 and a decode worker over tp 2 x ep 2 (real
    processes, each forcing its own host devices), registered in one Redis."""
    workers = {
        w: (kind, ("--tp", str(tp), "--ep", str(ep))) for w, (kind, tp, ep) in WORKERS.items()
    }
    with mesh_cluster(tmp_path_factory.mktemp("worker_ep"), FIX, "moe", workers, PS) as out:
        yield out


def _ask(st, pre, rid, prompt, n, sp=GREEDY, transport=prefill_pb2.TRANSPORT_GRPC):
    """(reserve, prefill, tokens) of one request on the decode worker, its KV from `pre`
    (None: the decode worker prefills it itself)."""
    p_addr = st.procs[pre].address if pre else None
    coro = disagg_generate(st.procs[DEC].address, p_addr, rid, prompt, n, sp, transport)
    return asyncio.run(coro)


def test_decode_worker_tp2_ep2_gives_transformers_tokens(ep_stack):
    st, _ = ep_stack
    ref = json.loads((FIX / "reference.json").read_text())
    _, _, toks = _ask(st, None, "own-ref", ref["prompt_ids"], len(ref["greedy_ids"]))
    assert toks == ref["greedy_ids"]


def test_handoff_from_ep_prefill_to_other_mesh(ep_stack):
    """Prompts prefilled over tp 1 x ep 2 and decoded over tp 2 x ep 2 give one device's
    tokens (greedy over gRPC, seeded sampling over the jax transfer); every page travels
    once, in one-device rows; a prompt extending one sends only the missing pages."""
    st, _ = ep_stack
    solo = solo_generator(FIX, PS, 64, 32)
    rng = np.random.default_rng(7)
    a, b = (rng.integers(0, 512, n).tolist() for n in (13, 21))
    res, pr, toks = _ask(st, PRE, "h-greedy", a, 10)
    want = solo.generate(a, 10, ignore_eos=True).token_ids
    assert toks == want
    assert (res.cached_pages, pr.pages_sent) == (0, 4)
    assert pr.bytes_sent == 4 * 2 * L * PS * HKV * HD * 4  # one-device rows: no ep copy sent
    res, pr, toks = _ask(st, PRE, "h-ext", a + want[:6], 4)
    assert toks == want[6:]
    assert res.cached_pages > 0 and pr.pages_sent == res.total_pages - res.cached_pages
    jax_t = prefill_pb2.TRANSPORT_JAX_TRANSFER
    _, pr, toks = _ask(st, PRE, "h-jax", b, 8, SAMPLED, jax_t)
    assert pr.pages_sent == 6 and toks == solo.generate(b, 8, SAMPLED, True).token_ids


def test_workers_register_their_mesh(ep_stack):
    import redis

    from megaserve.state_keys import WorkerInfo, worker_key

    st, rs = ep_stack
    r = redis.Redis.from_url(rs.url)
    infos = {w: WorkerInfo.from_hash(r.hgetall(worker_key(w))) for w in WORKERS}
    assert {w: (i.tp, i.ep) for w, i in infos.items()} == {
        w: (tp, ep) for w, (_, tp, ep) in WORKERS.items()
    }
    for w, (_, tp, ep) in WORKERS.items():  # the runner's backend line names the mesh
        assert any(f"tp={tp} x ep={ep}" in line for line in st.procs[w].lines), w


def _config_only(src, dst):
    """A checkpoint directory with the config and nothing else: loading it would fail, so a
    worker that exits 2 naming the mesh checked before any load."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_bad_ep_exits_2_before_any_load(tmp_path):
    moe, dense = _config_only(FIX, tmp_path / "moe"), _config_only(DENSE, tmp_path / "dense")
    cases = {
        "ep=3 does not divide num_experts=8": ("decode-worker", moe, "2", "3"),
        "ep=2: expert parallelism needs a mixture-of-experts model": (
            "prefill-worker", dense, "1", "2"
        ),
    }  # fmt: skip
    procs = {
        msg: subprocess.Popen(
            megaserve_cmd(kind, "--checkpoint", str(ck), "--tp", tp, "--ep", ep),
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for msg, (kind, ck, tp, ep) in cases.items()
    }
    for msg, p in procs.items():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and msg in err, err[-2000:]


def _args(checkpoint, tp=1, ep=1):
    return argparse.Namespace(checkpoint=str(checkpoint), tp=tp, ep=ep)


def test_mesh_checked_against_the_config():
    """In this process (nothing reaches JAX's backend before the checks): ep < 1, ep on the
    packaged GGUF (dense Llama), tp on the MoE's heads, a tp x ep group that does not split
    over its processes, all MeshErrors naming the numbers."""
    with pytest.raises(MeshError, match=r"ep=0 must be an integer >= 1"):
        parallel_from_args(_args(FIX, ep=0))
    with pytest.raises(MeshError, match=r"tp=3 does not divide num_attention_heads=4"):
        parallel_from_args(_args(FIX, tp=3, ep=2))
    with pytest.raises(MeshError, match=r"ep=16 does not divide num_experts=8"):
        parallel_from_args(_args(FIX, ep=16))
    from megaserve.checkpoint import load_config, resolve_checkpoint_path

    if resolve_checkpoint_path("smollm2").exists():
        assert load_config("smollm2")["model_type"] == "llama"
        with pytest.raises(MeshError, match=r"ep=2: .*model_type 'llama' has no experts"):
            check_checkpoint_fits("smollm2", ParallelConfig(ep=2))
    check_checkpoint_fits(str(FIX), ParallelConfig(tp=2, ep=4))  # fits
    check_checkpoint_fits(str(FIX / "missing"), ParallelConfig(ep=2))  # left to the loader
    group = GroupConfig("127.0.0.1:1", processes=3, process_id=1)
    with pytest.raises(MeshError, match=r"tp x ep = 4 devices do not split over 3 processes"):
        parallel_from_args(_args(FIX, tp=2, ep=2), group)
    assert GroupConfig("127.0.0.1:1", 2, 1).local_devices(ParallelConfig(2, 2).devices) == 2


def test_serve_passes_tp_and_ep_to_its_workers():
    from megaserve_app.serve import add_arguments, worker_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = worker_args(p.parse_args(["--tp", "2", "--ep", "4", "--warm-up", "none"]))
    assert args[args.index("--tp") + 1] == "2" and args[args.index("--ep") + 1] == "4"
    assert worker_args(p.parse_args([]))[-4:] == ("--tp", "1", "--ep", "1")
