"""Run in a fresh subprocess (test_sharded_load) with forced host devices: the sharded loader
against the current path, writing a big random checkpoint, or one device's blocks of it under
an RSS watch; each mode prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

# Its largest tensors (gate/up/down, 64 MiB each in f32) outweigh what a tp=8 shard's share
# leaves below the bound: a loader that held any one of them whole would exceed it.
BIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 1024,
    "intermediate_size": 16384,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def hf_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes for a Llama config dict (no biases, untied lm_head)."""
    d, f, v, hd = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return out


def write_safetensors(path: Path, specs: dict, make: Callable[[str], np.ndarray]) -> None:
    """specs: name -> (shape, dtype); make(name) -> that array, called once per tensor while
    writing, so one tensor is in memory at a time."""
    header, offset = {}, 0
    for name, (shape, dtype) in specs.items():
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_DTYPES[np.dtype(dtype).name], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, (shape, dtype) in specs.items():
            a = np.ascontiguousarray(make(name), dtype=dtype)
            assert a.shape == tuple(shape), name
            f.write(a.view(np.uint8).data)


def write_big(d: Path) -> dict:
    """BIG as a random f32 checkpoint in d, written one tensor at a time."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(BIG))
    shapes, rng = hf_shapes(BIG), np.random.default_rng(0)
    specs = {n: (s, np.float32) for n, s in shapes.items()}
    write_safetensors(
        d / "model.safetensors", specs, lambda n: rng.random(shapes[n], dtype=np.float32) - 0.5
    )
    return {"bytes": (d / "model.safetensors").stat().st_size}


def write_odd(d: Path) -> None:
    """A qwen2 checkpoint stored in bf16 with q/k/v biases, one KV head (replicated at every
    tp), a tied embedding and a vocabulary of 97 (the lm_head padded at tp 2 and 4)."""
    from tests.conftest import random_tensors, tiny_llama_config

    hf = tiny_llama_config(model_type="qwen2", vocab_size=97, num_key_value_heads=1)
    hf["tie_word_embeddings"] = True
    t = random_tensors(hf, seed=3)
    rng = np.random.default_rng(4)
    for i in range(hf["num_hidden_layers"]):
        for proj, n in (("q", 32), ("k", 8), ("v", 8)):
            t[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = rng.standard_normal(n)
    t = {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16) for k, v in t.items()}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf))
    specs = {k: (v.shape, v.dtype) for k, v in t.items()}
    write_safetensors(d / "model.safetensors", specs, t.__getitem__)


def _same(a, b) -> bool:
    """Same shape, dtype, sharding and, device by device, the same bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.sharding.is_equivalent_to(b.sharding, a.ndim):
        return False
    mine = {s.device: np.asarray(s.data).tobytes() for s in a.addressable_shards}
    return all(mine[s.device] == np.asarray(s.data).tobytes() for s in b.addressable_shards)


def equal(dirs: list[Path], tps: list[int]) -> dict:
    """For each checkpoint, tp and serving dtype: the leaves whose sharded load differs from
    `shard_params(shard_major_params(pack_params(...)))`."""
    import jax
    import jax.numpy as jnp

    from kernels.tp_llama import param_specs, shard_major_params, shard_params
    from megaserve.checkpoint.sharded import load_tp_params
    from megaserve.model import LoadedModel
    from megaserve.parallel.mesh import ParallelConfig, make_mesh

    cases, bad = [], []
    for d in dirs:
        for dtype in (jnp.float32, jnp.bfloat16):
            host = LoadedModel.load(str(d), dtype, progress=False, on_device=False)
            for tp in tps:
                lay, mesh = (
                    ParallelConfig(tp=tp).check_model(host.cfg),
                    make_mesh(ParallelConfig(tp)),
                )
                specs = param_specs(host.params)
                want = shard_params(shard_major_params(host.cfg, lay, host.params), specs, mesh)
                got = load_tp_params(d, host.cfg, lay, mesh, dtype)
                case = f"{d.name} tp={tp} {jnp.dtype(dtype).name}"
                cases.append(case)
                if jax.tree.structure(got) != jax.tree.structure(want):
                    bad.append(f"{case}: tree {jax.tree.structure(got)}")
                    continue
                paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(want)]
                same = map(_same, jax.tree.leaves(got), jax.tree.leaves(want))
                bad += [f"{case}: {p}" for p, ok in zip(paths, same, strict=True) if not ok]
    return {"cases": cases, "mismatches": bad}


def generate(d: Path, tp: int) -> dict:
    """`LoadedModel.load_sharded` then greedy tokens through the tp runner, which must keep the
    params it was given (no host copy, no second placement)."""
    from megaserve.model import LoadedModel
    from megaserve.offline import OfflineGenerator
    from megaserve.parallel.mesh import ParallelConfig

    ref = json.loads((d / "reference.json").read_text())
    prompt, want = ref["prompt_ids"], ref["greedy_ids"]
    model = LoadedModel.load_sharded(str(d), np.float32, ParallelConfig(tp=tp))
    gen = OfflineGenerator(
        model, max_context=len(prompt) + len(want) + 8, parallel=ParallelConfig(tp=tp)
    )
    tokens = gen.generate(prompt, len(want), ignore_eos=True).token_ids
    return {"same": tokens == want, "kept": gen.runner.params is model.params}


def _hwm_reset() -> bool:
    """Resets this process's peak RSS (VmHWM) to its current RSS, where Linux lets it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def rss(d: Path, tp: int) -> dict:
    """Bytes of device 0's blocks (its share of a tp mesh) and the peak RSS growth while its
    blocks are built by the loader's own per-block functions, then kept (as a device keeps
    them)."""
    import jax
    from jax.sharding import NamedSharding

    from kernels.llama import LlamaConfig
    from kernels.tp_llama import param_specs
    from megaserve.checkpoint.hf import tensor_index
    from megaserve.checkpoint.sharded import TensorFiles, model_leaves, ranges_of
    from megaserve.parallel.mesh import ParallelConfig, make_mesh

    cfg = LlamaConfig.from_hf(json.loads((d / "config.json").read_text()))
    lay, mesh = ParallelConfig(tp=tp).check_model(cfg), make_mesh(ParallelConfig(tp=tp))
    dev, plan = mesh.devices.flat[0], []
    with TensorFiles(tensor_index(d)) as src:
        leaves = model_leaves(cfg, lay, src, np.float32)

        def of_device(leaf, spec):
            index = NamedSharding(mesh, spec).devices_indices_map(leaf.shape)[dev]
            plan.append((leaf, ranges_of(index, leaf.shape)))

        jax.tree.map(of_device, leaves, param_specs(leaves))
        share = sum(int(np.prod([b - a for a, b in r])) * 4 for _, r in plan)
        reset = _hwm_reset()
        before = _status("VmRSS")
        blocks = [leaf.block(r) for leaf, r in plan]
        # VmHWM, the address space's own peak, which clear_refs resets; not ru_maxrss, which
        # also keeps the peak any exited thread saw before the reset (4 GB once, in a full
        # test run).
        peak = _status("VmHWM")
    return {"share": share, "growth": peak - before, "reset": reset, "values": _spot(d, blocks)}


def _spot(d: Path, blocks: list) -> bool:
    """Device 0's layer-0 wqkv and w_down blocks (tp=8: q heads 0-1, KV head 0; down's
    first 2048 columns) hold what the file holds there, transposed."""
    from megaserve.checkpoint.safetensors_file import read_safetensors

    t, p = read_safetensors(d / "model.safetensors"), "model.layers.0."
    attn = [t[p + f"self_attn.{x}_proj.weight"][:n] for x, n in (("q", 128), ("k", 64), ("v", 64))]
    wqkv = np.concatenate(attn).T
    down = t[p + "mlp.down_proj.weight"][:, :2048].T
    return any(np.array_equal(b, wqkv) for b in blocks) and any(
        np.array_equal(b, down) for b in blocks
    )


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "write":
        out = write_big(Path(args[0]))
    elif mode == "equal":
        write_odd(Path(args[0]))
        tps = [int(x) for x in args[args.index("--tp") + 1 :]]
        out = equal([Path(a) for a in args[: args.index("--tp")]], tps)
        out["generate"] = generate(Path(args[1]), 2)
    else:
        out = rss(Path(args[0]), int(args[1]))
    print(json.dumps(out))
