"""Step-time breakdown of the local backend per recipe, and the FP8-emulated step vs the BF16 step.

For each recipe: build the run (warm start from the cache), run ``--warmup`` steps, then time
``--steps`` GRPO steps phase by phase (refit / rollout / rewards / scoring / update / KV
calibration). Both wall-clock and process CPU time are reported: on a shared machine the wall
clock mostly measures the other tenants, while CPU time of this single-threaded process is what
the step costs (a fair estimate of the unloaded wall time with one thread).

    .venv/bin/python benchmarks/bench_local_step.py [--steps 5] [--num-ops 3] [--recipes ...]

FP8 here is *emulated* in fp32 on CPU (quantize, dequantize, fp32 GEMM), so the ratio measures
emulation overhead, not the speed-up of real FP8 tensor cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PHASES = (
    ("prepare_for_generation", "refit"),
    ("generation", "rollout"),
    ("reward_calculation", "rewards"),
    ("policy_and_reference_logprobs", "scoring"),
    ("policy_training", "update"),
    ("kv_calibration", "kv_calib"),
    ("total_step_time", "total"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,fp8_rollout,jetrl,jetrl_kv")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--num-ops", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the numbers here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run
    from nemo_jetrl.commands.demo import recipe_config

    out_dir = Path("/tmp/jetrl_bench_local")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for recipe in args.recipes.split(","):
        cfg = recipe_config(
            recipe,
            out_dir,
            [
                f"jetrl.local.task.num_ops={args.num_ops}",
                "checkpointing.enabled=false",
                *args.set,
            ],
        )
        run = LocalRun(resolve_run(cfg), log=lambda m: print(m, file=sys.stderr))
        for _ in range(args.warmup):
            run.train_step(Hooks())
        rows: list[dict[str, float]] = []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            s, _ = run.train_step(Hooks())
            rows.append(s)
        if run.kv is not None:
            run.kv.detach()
        res = {}
        for key, label in PHASES:
            wall = [r.get(f"timing/train/{key}") for r in rows]
            cpu = [r.get(f"jetrl/local/cpu_time/{key}") for r in rows]
            if wall[0] is None:
                continue
            res[label] = {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}
        res["_meta"] = {
            "tokens": statistics.mean(r["jetrl/local/mean_response_tokens"] for r in rows),
            "tmpe": statistics.mean(r["train/token_mult_prob_error"] for r in rows),
            "elapsed": time.perf_counter() - t0,
        }
        results[recipe] = res
        print(f"{recipe}: done ({res['_meta']['elapsed']:.1f}s)", file=sys.stderr)

    labels = [lab for _, lab in PHASES]
    print(f"median per step over {args.steps} steps, num_ops={args.num_ops} (seconds; CPU | wall)")
    print(f"{'recipe':12s}" + "".join(f"{lab:>17s}" for lab in labels) + f"{'cpu/bf16':>10s}")
    base = results.get("bf16", {}).get("total", {}).get("cpu")
    for recipe, res in results.items():
        cells = []
        for lab in labels:
            v = res.get(lab)
            cells.append(f"{v['cpu']:8.3f}|{v['wall']:7.3f}" if v else f"{'-':>16s}")
        ratio = f"{res['total']['cpu'] / base:10.2f}" if base else f"{'-':>10s}"
        print(f"{recipe:12s}" + "".join(f"{c:>17s}" for c in cells) + ratio)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
