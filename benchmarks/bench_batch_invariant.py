"""Cost of batch invariance in the local backend, measured in one run: for each recipe, two runs
built from the same config differ only in ``jetrl.local.batch_invariant`` (true / false); their
GRPO steps alternate (A, B, A, B, ...) so both see the same machine load. Prints the median
process-CPU seconds per step phase (single-threaded, so CPU time is the unloaded cost), the
ratio invariant / plain, and each side's mismatch (token_mult_prob_error, gen_kl_error).

    .venv/bin/python benchmarks/bench_batch_invariant.py [--steps 4] [--num-ops 1] [--recipes ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PHASES = (
    ("generation", "rollout"),
    ("policy_and_reference_logprobs", "scoring"),
    ("policy_training", "update"),
    ("total_step_time", "total"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,jetrl,jetrl_kv")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--num-ops", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the numbers here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run
    from nemo_jetrl.commands.demo import recipe_config

    def build(recipe: str, invariant: bool) -> LocalRun:
        cfg = recipe_config(
            recipe,
            Path("/tmp/jetrl_bench_invariant") / f"{recipe}-{invariant}",
            [
                f"jetrl.local.task.num_ops={args.num_ops}",
                "checkpointing.enabled=false",
                f"jetrl.local.batch_invariant={str(invariant).lower()}",
                *args.set,
            ],
        )
        return LocalRun(resolve_run(cfg), log=lambda m: print(m, file=sys.stderr))

    results: dict[str, dict] = {}
    for recipe in args.recipes.split(","):
        runs = {True: build(recipe, True), False: build(recipe, False)}
        rows: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for i in range(args.steps + 1):  # the first step of each is a warm-up
            for inv, run in runs.items():
                s, _ = run.train_step(Hooks())
                if i:
                    rows[inv].append(s)
        for run in runs.values():
            if run.kv is not None:
                run.kv.detach()
        res: dict[str, dict] = {}
        for inv, rs in rows.items():
            side = {
                lab: statistics.median(r[f"jetrl/local/cpu_time/{k}"] for r in rs)
                for k, lab in PHASES
            }
            side["tmpe_max"] = max(r["train/token_mult_prob_error"] for r in rs)
            side["gen_kl_max"] = max(abs(r["train/gen_kl_error"]) for r in rs)
            res["invariant" if inv else "plain"] = side
        results[recipe] = res

    print(f"median process-CPU seconds per step over {args.steps} steps, num_ops={args.num_ops}")
    print(
        f"{'recipe':10s} {'side':10s}"
        + "".join(f"{lab:>9s}" for _, lab in PHASES)
        + "   tmpe max     |gen_kl| max"
    )
    for recipe, res in results.items():
        for side in ("plain", "invariant"):
            r = res[side]
            cells = "".join(f"{r[lab]:9.3f}" for _, lab in PHASES)
            print(f"{recipe:10s} {side:10s}{cells}   {r['tmpe_max']:.9f}  {r['gen_kl_max']:.3e}")
        ratio = res["invariant"]["total"] / res["plain"]["total"]
        print(f"{recipe:10s} {'ratio':10s}{'':>27s}{ratio:9.2f}  (invariant / plain, total CPU)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
