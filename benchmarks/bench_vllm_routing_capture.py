"""What recording the vLLM engine's routing costs its generation (docs/moe.md, vLLM engine).

    .venv-vllm/bin/python benchmarks/bench_vllm_routing_capture.py [--recipe jetrl] [--reps 5]

One engine (the tiny Qwen3-MoE of examples/configs/local/moe, random weights, `VllmRolloutEngine`
under the recipe, eager mode), the same seeded batch (32 prompts x 24 tokens, ignore_eos) generated
``--reps`` times with the recorder off and on, alternating; prints the median wall seconds of each
and of `routing_capture.take` (the per-request assembly, driver side). On a shared machine the
medians measure the other tenants too: compare the two columns, not the absolute values.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_JSON = REPO / "examples" / "configs" / "local" / "moe" / "qwen3_moe_tiny.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="jetrl", choices=("jetrl", "bf16"))
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import os

    import torch

    from nemo_jetrl.backends.local.model import build_model, load_model_config
    from nemo_jetrl.backends.local.tokenizer import load_tokenizer
    from nemo_jetrl.backends.local.vllm_moe import engine_weights
    from nemo_jetrl.backends.local.vllm_rollout import cpu_engine_env, write_model_dir
    from nemo_jetrl.recipe import Recipe
    from nemo_jetrl.vllm_patch import routing_capture
    from nemo_jetrl.vllm_patch.engine import VllmRolloutEngine

    os.environ.update(cpu_engine_env())
    model = build_model(load_model_config(str(MODEL_JSON)), seed=0, dtype=torch.bfloat16)
    d = write_model_dir(model, load_tokenizer(None), Path(tempfile.mkdtemp()) / "m")
    kw = dict(dtype="bfloat16", load_format="dummy", max_model_len=64, max_num_seqs=32,
              enforce_eager=True, seed=0, enable_prefix_caching=False)  # fmt: skip
    prompts = [[1, 3 + i % 10, 13, 3 + (i * 7) % 10, 16] for i in range(32)]
    with VllmRolloutEngine(
        d, Recipe.preset(args.recipe), engine_kwargs=kw, initial_refit=False
    ) as eng:
        eng.refit(engine_weights(model.state_dict()))
        times: dict[str, list[float]] = {"off": [], "on": [], "take": []}
        for rep in range(args.reps + 1):  # the first pair is a warm-up
            for mode in ("off", "on"):
                if mode == "on":
                    routing_capture.start(eng.llm)
                t0 = time.perf_counter()
                eng.generate(prompts, max_tokens=24, seed=list(range(32)), ignore_eos=True)
                dt = time.perf_counter() - t0
                if mode == "on":
                    t1 = time.perf_counter()
                    got = routing_capture.take(eng.llm)
                    took = time.perf_counter() - t1
                    routing_capture.stop(eng.llm)
                    assert len(got) == 32, len(got)
                    if rep:
                        times["take"].append(took)
                if rep:
                    times[mode].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.recipe}: generate median {med['off']:.3f} s off, {med['on']:.3f} s on "
          f"({med['on'] / med['off']:.3f}x), take {med['take']:.3f} s; {args.reps} reps")  # fmt: skip


if __name__ == "__main__":
    main()
