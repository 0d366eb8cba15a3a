"""Run in a subprocess started with forced host devices (test_tensor_parallel): one device and
tensor-parallel generation on tiny transformers fixtures, results as one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from megaserve import compile_cache  # noqa: E402
from megaserve.model import LoadedModel  # noqa: E402
from megaserve.offline import OfflineGenerator  # noqa: E402
from megaserve.parallel.mesh import ParallelConfig  # noqa: E402
from megaserve.runner.batch import TokenBatch  # noqa: E402
from megaserve.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import FIXTURES  # noqa: E402

compile_cache.configure_jax()

SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)


def run_one(model: LoadedModel, ref: dict, mesh: str, steps: int, logprobs: bool) -> dict:
    """Greedy and sampled tokens, prefill logits at two lengths, two decode steps' logits
    and (logprobs) the prompt's log-probabilities. mesh: "tp" or "tpxep" ("2x4")."""
    prompt, want = ref["prompt_ids"], ref["greedy_ids"]
    tp, _, ep = mesh.partition("x")
    gen = OfflineGenerator(
        model,
        max_context=len(prompt) + len(want) + 8,
        steps_per_call=steps,
        parallel=ParallelConfig(tp=int(tp), ep=int(ep or 1)),
    )
    greedy = gen.generate(prompt, len(want), ignore_eos=True).token_ids
    sampled = gen.generate(prompt, 8, SAMPLED, ignore_eos=True).token_ids
    _, final = gen.prefill(prompt + want[:-1], SamplingParams())
    first, last = gen.prefill(prompt, SamplingParams())
    rows = gen._rows(SamplingParams(), prompt, [first])
    batch = TokenBatch.from_rows([([first], len(prompt), gen.pages)])
    toks, logits = gen.runner.decode(batch, rows, n_steps=2, want_logits=True)
    out = {}
    if logprobs:  # the scoring prefill: each prompt position's next-token log-probability
        batch = TokenBatch.from_rows([(prompt, 0, gen.pages)])
        targets = np.asarray([*prompt[1:], first], np.int32)
        _, _, scores = gen.runner.prefill_with_logprobs(batch, rows, targets)
        out = {"target": scores.target[0, : len(prompt)].tolist()}
        out["top_ids"] = scores.top_ids[0, : len(prompt)].tolist()
    return out | {
        "greedy": greedy,
        "sampled": sampled,
        "decode_tokens": toks[:, 0].tolist(),
        "last_logits": np.asarray(last).tolist(),
        "final_logits": np.asarray(final).tolist(),
        "decode_logits": np.asarray(logits)[:, 0].tolist(),
    }


def main(argv: list[str]) -> None:
    """argv: fixture names, `--tp 2 4` (or tp x ep meshes: `--tp 2x4 1x2`), `--steps N`
    (decode steps per call), then optionally `--logprobs` (score the prompt too)."""
    names = argv[: argv.index("--tp")]
    meshes = argv[argv.index("--tp") + 1 : argv.index("--steps")]
    steps = int(argv[argv.index("--steps") + 1])
    out = {"devices": jax.device_count()}
    for name in names:
        d = FIXTURES / "tiny" / name
        ref = json.loads((d / "reference.json").read_text())
        model = LoadedModel.load(str(d), progress=False)
        out[name] = {"want": ref["greedy_ids"]}
        for mesh in ("1", *meshes):
            out[name][mesh] = run_one(model, ref, mesh, steps, "--logprobs" in argv)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
