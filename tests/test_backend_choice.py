"""--backend and --dtype: what `auto` picks and why, the fallback for configs the megakernel
cannot take, exit 2 naming the flag for bad values, and a decode worker whose megakernel plan
allows fewer rows than --max-running: the 17th, 65th and 200th concurrent requests complete
or get RESOURCE_EXHAUSTED, and the engine thread lives on (real gRPC, the TPU interpreter)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import jax
import jax.numpy as jnp
import pytest

from decode_service.engine import DecodeEngine, EngineConfig, wait_idle
from decode_service.scheduler import SchedulerConfig
from decode_service.server import create_server
from kernels.megakernel.plan import make_plan
from megaserve.errors import BackendError
from megaserve.model import LoadedModel, serving_dtype
from megaserve.offline import OfflineGenerator
from megaserve.rpc import decode_pb2, decode_pb2_grpc
from megaserve.runner.factory import choose_backend
from megaserve.runner.pallas import MegakernelRunner
from megaserve.server_thread import ServerThread
from tests.conftest import FIXTURES, REPO


def _cfg(name: str):
    return LoadedModel.load(str(FIXTURES / "tiny" / name), progress=False).cfg


def test_auto_is_xla_off_tpu_and_says_why():
    assert choose_backend(_cfg("llama_gqa2"), 16) == ("xla", "auto: platform 'cpu' is not TPU")
    assert choose_backend(_cfg("llama_gqa2"), 16, "pallas") == ("pallas", "requested")
    assert choose_backend(_cfg("llama_bias"), 16, "xla") == ("xla", "requested")


def test_auto_on_tpu_falls_back_for_what_the_kernel_cannot_take(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")  # no TPU here: its name only
    assert choose_backend(_cfg("llama_gqa2"), 16)[0] == "pallas"
    assert choose_backend(_cfg("qwen2_bias"), 16)[0] == "pallas"  # q/k/v biases: in the kernel
    backend, why = choose_backend(_cfg("llama_bias"), 16)
    assert backend == "xla" and "o_bias=True" in why, why
    backend, why = choose_backend(_cfg("llama_gqa2"), 12)
    assert backend == "xla" and "page_size=12" in why, why
    with pytest.raises(BackendError, match="--backend pallas: megakernel: o_bias=True"):
        choose_backend(_cfg("llama_bias"), 16, "pallas")
    assert serving_dtype("auto") == jnp.bfloat16


def test_serving_dtype():
    assert serving_dtype() == jnp.float32  # CPU: the parity tests' f32
    assert serving_dtype("bf16") == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8'"):
        serving_dtype("fp8")


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megaserve_app.cli", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "args,needle",
    [
        (("decode-worker", "--backend", "tpu"), "argument --backend: invalid choice: 'tpu'"),
        (("prefill-worker", "--dtype", "fp8"), "argument --dtype: invalid choice: 'fp8'"),
        (("prefill-worker", "--backend", "tpu"), "argument --backend: invalid choice: 'tpu'"),
        (("prefill-worker", "--backend", "pallas"), "the prefill tier has no Pallas kernel yet"),
        (("decode-worker", "--kv-budget-mb", "0"), "argument --kv-budget-mb: '0' is not a po"),
        (("decode-worker", "--warm-up", "some"), "argument --warm-up: invalid choice: 'some'"),
        (("generate", "--prompt", "x", "--dtype", "f16"), "argument --dtype: invalid choice"),
    ],
)
def test_bad_flag_values_exit_2_naming_the_flag(args, needle):
    r = _cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_a_memory_plan_that_does_not_fit_exits_2_naming_each_term():
    ck = str(FIXTURES / "tiny" / "llama_gqa2")
    for role in ("decode-worker", "prefill-worker"):
        r = _cli(role, "--checkpoint", ck, "--kv-budget-mb", str(10**9))  # a petabyte
        assert r.returncode == 2, r.stderr[-2000:]
        for term in ("memory plan does not fit: weights", "KV pool 1048576.000 GB", "margin"):
            assert term in r.stderr, r.stderr[-2000:]
        assert "device capacity" in r.stderr


def test_pallas_on_a_config_it_cannot_take_exits_2_naming_why():
    ck = str(FIXTURES / "tiny" / "llama_bias")
    r = _cli("generate", "--checkpoint", ck, "--prompt-ids", "3,4,5", "--backend", "pallas")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--backend pallas: megakernel: o_bias=True is not implemented yet" in r.stderr


def test_generate_in_bf16_on_the_xla_backend():
    ck = str(FIXTURES / "tiny" / "llama_gqa2")
    r = _cli("generate", "--checkpoint", ck, "--prompt-ids", "3,4,5", "--dtype", "bf16",
             "--max-new-tokens", "4", "--ignore-eos", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(__import__("json").loads(r.stdout.splitlines()[-1])["token_ids"]) == 4


MAX_RUNNING, PLAN_ROWS = 64, 4


@pytest.fixture(scope="module")
def narrow_worker(tiny_model):
    """The megakernel (interpreted) with a VMEM budget that plans 4 rows, asked for 64."""
    cfg, pages = tiny_model.cfg, 4
    kw = {"kv_dtype": jnp.float32, "weight_dtype": jnp.float32}  # the pool and rings: f32
    budget = make_plan(cfg, PLAN_ROWS, 16, pages, **kw).vmem_bytes()
    assert make_plan(cfg, PLAN_ROWS * 2, 16, pages, **kw).vmem_bytes() > budget
    engine = DecodeEngine(
        tiny_model,
        EngineConfig(
            max_context=16 * pages,
            backend="pallas",
            vmem_budget_bytes=budget,
            # f32 matmul inputs: the f32 reference's arithmetic, so tokens compare exactly
            # (bf16 inputs flipped a near-tied argmax here).
            kernel_matmul_dtype=jnp.float32,
            scheduler=SchedulerConfig(max_running=MAX_RUNNING, max_waiting=24, prefill_chunk=32),
        ),
    )
    assert isinstance(engine.runner, MegakernelRunner)
    engine.start()
    servers = ServerThread(lambda: create_server(engine))
    yield engine, servers.addresses[0]
    servers.stop()
    engine.stop()


def test_requests_beyond_the_plan_complete_or_are_refused(narrow_worker, tiny_model):
    engine, addr = narrow_worker
    assert engine.sched.cfg.max_running == PLAN_ROWS  # lowered from 64, logged
    vocab = tiny_model.cfg.vocab_size
    prompts = [[(i * 13 + j) % (vocab - 3) + 3 for j in range(4 + i % 5)] for i in range(200)]

    async def one(stub, i):
        req = decode_pb2.GenerateRequest(
            request_id=f"n{i}",
            prompt_token_ids=prompts[i],
            stopping=decode_pb2.StoppingParams(max_tokens=2, ignore_eos=True),
        )
        try:
            return [t async for r in stub.Generate(req, timeout=240) for t in r.token_ids]
        except grpc.aio.AioRpcError as e:
            return (e.code(), e.details())

    async def main():
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            return await asyncio.gather(*(one(stub, i) for i in range(200)))

    got = asyncio.run(main())
    refused = [i for i, g in enumerate(got) if g[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [i for i, g in enumerate(got) if isinstance(g, list)]
    assert len(refused) + len(done) == 200, {g for g in got if not isinstance(g, list)}
    assert len(done) > PLAN_ROWS and refused, (len(done), len(refused))
    gen = OfflineGenerator(tiny_model, max_context=64)
    for i in done[:8] + done[-4:]:
        assert got[i] == gen.generate(prompts[i], 2, ignore_eos=True).token_ids, i
    wait_idle(engine, 120)
    assert engine._thread.is_alive() and engine.step_failures == 0
    fate = {n + 1: "done" if isinstance(got[n], list) else got[n][0].name for n in (16, 64, 199)}
    print(
        f"\n200 at once, plan allows {PLAN_ROWS}: {len(done)} done, {len(refused)} refused; {fate}"
    )
