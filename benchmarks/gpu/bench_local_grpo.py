"""Short local GRPO runs per recipe on one device: exactly on-policy, mismatch, step time.

For each model (the demo's 2-layer Llama, and a ~0.6B-parameter Qwen3-0.6B-shaped model with
random weights built from a config: no hub access on a GPU node) and each recipe (bf16,
fp8_rollout, jetrl, jetrl_kv) it runs the demo's config (`nemo_jetrl.commands.demo.recipe_config`,
warm start off: random weights, so responses run to ``max_new_tokens``) for ``--steps`` steps on
``--device`` through `run_local`, and prints per recipe:

- tmpe: the largest ``train/token_mult_prob_error`` over the steps; jetrl/jetrl_kv must be
  exactly 1 on every step (MET / NOT MET), and gen_kl (``train/gen_kl_error``) exactly 0;
- fp8_rollout's mismatch (tmpe - 1, its largest);
- step time: median ``timing/train/total_step_time`` of the steps after the first (the first
  compiles and warms up; with one step, that step), and tokens/s = response tokens per step /
  step time;
- the cost of exactness per model: jetrl's step time over ``jetrl@fast``'s (the same recipe
  without the batch-invariant ops), when both ran;
- where a timed step's time goes: its phases (NeMo-RL's names: generation, policy_training,
  ...) in wall seconds, and the process's CPU seconds over the step (close to the step's wall
  time on a GPU when the host, not the device, sets the pace);
- the share of the last step's time spent in `nemo_jetrl.invariant.ops` (outermost calls only,
  timed with a device sync around each: the last step is instrumented and left out of the step
  time when there are 3 or more steps).

The Qwen3-shaped model is Qwen3-0.6B's architecture and sizes (``model_type`` qwen3: q/k RMSNorm
in every attention) with random weights; run 7 (2026-11-30) ran a Llama config of the same sizes,
before the local backend had dense Qwen3. ``--tiny``: the Qwen3-shaped model at
2 layers, hidden 128, and 2x2 samples per step, for a CPU smoke test
(`tests/test_bench_scripts_cpu.py`). Exit 1 when jetrl/jetrl_kv is not exactly on-policy or a
run failed (a failed run is printed and the others still run; ``--json`` is rewritten after every
run, so a lease that times out keeps what finished).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _common
import torch

# "RECIPE@fp32": the preset with TE's exact FP32 block scales on both sides instead of pow2 (the
# keys `jetrl check` reads as "FP8 e4m3 fp32 (te)" / "(jetrl)": on-policy in both scale modes)
# "RECIPE@splitk": both sides' FP8 GEMMs on the triton_splitk backend (`fp8.triton_split`: a
# token's row has the same bits at every batch size by construction), JETRL_FP8_GEMM_BACKEND set
# for the run; "@fp32+splitk" both. "RECIPE@fast": without the batch-invariant ops
# (``jetrl.local.batch_invariant=false``: torch's own GEMMs, attention and reductions), not
# exact by design: the cost of exactness is jetrl's step time over jetrl@fast's (`exactness_cost`).
RECIPES = ("bf16", "fp8_rollout", "jetrl", "jetrl@fp32", "jetrl_kv", "jetrl@splitk", "jetrl@fast")
SUFFIXES = ("fp32", "splitk", "fast")
EXACT = ("jetrl", "jetrl_kv")
PHASE, CPU_KEY = "timing/train/", "jetrl/local/cpu_time/total_step_time"  # the local loop's keys
FP32_SCALE_KEYS = (
    "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
    "policy.generation.vllm_cfg.pow2_weight_scaling_factors=false",
)
# Qwen3-0.6B's architecture and sizes (hidden 1024, 28 layers, 16 q / 8 kv heads of 128, MLP 3072,
# vocab 151936, tied embeddings, rope theta 1e6): ~0.6B parameters.
QWEN3_SHAPED = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"],
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    rope_theta=1_000_000.0, max_position_embeddings=4096,
)  # fmt: skip
TINY = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"],
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=64, vocab_size=256, tie_word_embeddings=True,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run (default: %(default)s)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="default: %(default)s")
    p.add_argument(
        "--models", default="demo,qwen3-0.6b-shaped", help="demo and/or qwen3-0.6b-shaped"
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default: 8)")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt (default: 4)")
    p.add_argument("--tiny", action="store_true", help="small models, 2x2 samples (CPU smoke test)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p


def model_json(name: str, tiny: bool, out: Path) -> str | None:
    """The config.json of ``name`` (None: the demo's own model)."""
    from nemo_jetrl.backends.local.model import MODEL_CONFIG_JSON

    if name == "demo":  # already tiny (2 layers, hidden 256)
        return None
    cfg = json.loads(Path(MODEL_CONFIG_JSON).read_text())  # token ids of the local tokenizer
    cfg.update(TINY if tiny else QWEN3_SHAPED)
    path = out / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


class OpsTimer:
    """Wall time of the outermost `nemo_jetrl.invariant.ops` calls while ``on`` (device synced
    around each call, so the instrumented step is slower: it is not a timed step)."""

    def __init__(self, device: torch.device) -> None:
        from nemo_jetrl.invariant import ops

        self.ops, self.device, self.on, self.depth, self.seconds = ops, device, False, 0, 0.0
        self.saved = {
            n: f for n, f in vars(ops).items()
            if callable(f) and not n.startswith("_") and getattr(f, "__module__", "") == ops.__name__
        }  # fmt: skip

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wrap(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*a, **kw):
            if not self.on or self.depth:
                return fn(*a, **kw)
            self._sync()
            self.depth, t0 = 1, time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._sync()
                self.seconds += time.perf_counter() - t0
                self.depth = 0

        return timed

    def __enter__(self) -> OpsTimer:
        for n, f in self.saved.items():
            setattr(self.ops, n, self._wrap(f))
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self.saved.items():
            setattr(self.ops, n, f)


def run_recipe(recipe: str, model: str | None, args, work: Path) -> dict:
    from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
    from nemo_jetrl.commands.demo import recipe_config

    device = torch.device(args.device)
    n = max(1, args.steps)
    keys = [
        f"++jetrl.local.device={args.device}", "jetrl.local.warmstart.enabled=false",
        "checkpointing.enabled=false", "grpo.val_period=0", "grpo.val_at_start=false",
        f"grpo.max_num_steps={n}", f"grpo.num_prompts_per_step={args.prompts}",
        f"grpo.num_generations_per_prompt={args.generations}",
        f"jetrl.local.cache_dir={work / 'cache'}", "jetrl.local.num_threads=null",
    ]  # fmt: skip
    if model is not None:
        keys.append(f"jetrl.local.model_config={model}")
    preset, _, suffix = recipe.partition("@")
    parts = [p for p in suffix.split("+") if p]
    if any(p not in SUFFIXES for p in parts) or (suffix and not parts):
        raise ValueError(
            f"--recipes: {recipe!r}: the suffixes are @fp32, @splitk, @fast, joined by + "
            "(@fp32+splitk)"
        )
    if "fp32" in parts:
        keys.extend(FP32_SCALE_KEYS)
    if "fast" in parts:
        keys.append("jetrl.local.batch_invariant=false")
    run_dir = work / "runs" / f"{Path(model or 'demo').stem}-{preset}-{suffix or 'preset'}"
    cfg = recipe_config(preset, work, [f"logger.log_dir={run_dir}", *keys])
    timer = OpsTimer(device)
    profiled = n  # the last step is the instrumented one; timed: the steps between
    timed_steps = _timed_steps(n)

    def after_step(step: int, _s: dict) -> None:
        timer.on = step + 1 == profiled  # instrument the next step when it is the last

    timer.on = profiled == 1
    backend = {"JETRL_FP8_GEMM_BACKEND": "triton_splitk" if "splitk" in parts else None}
    with timer, _common.environ(backend):
        res = run_local(
            resolve_run(cfg),
            progress=False,
            log=lambda *_: None,
            hooks=Hooks(after_step=after_step),
        )
    h = {int(r["step"]): r for r in res.history}
    tmpe = max(r["train/token_mult_prob_error"] for r in res.history)
    kl = max(abs(r["train/gen_kl_error"]) for r in res.history)
    times = [h[s]["timing/train/total_step_time"] for s in timed_steps]
    st = statistics.median(times)
    toks = statistics.median(
        h[s]["jetrl/local/mean_response_tokens"] * args.prompts * args.generations
        for s in timed_steps
    )
    # where a timed step's time goes: NeMo-RL's phase names, wall seconds, and the process's
    # CPU seconds over the step (near the wall time on a GPU: the host is what the step waits on)
    phases = {
        key.removeprefix(PHASE): statistics.median(h[s][key] for s in timed_steps)
        for key in h[timed_steps[0]] if key.startswith(PHASE) and key != PHASE + "total_step_time"
    }  # fmt: skip
    cpu = statistics.median(h[s][CPU_KEY] for s in timed_steps)
    last = h[profiled]["timing/train/total_step_time"]
    exact = all(
        r["train/token_mult_prob_error"] == 1.0 and r["train/gen_kl_error"] == 0.0
        for r in res.history
    )
    return {
        "recipe": recipe, "tmpe_max": tmpe, "gen_kl_max": kl, "exact_every_step": exact,
        "mismatch": tmpe - 1.0, "step_s": st, "step_range_s": [min(times), max(times)],
        "tokens_per_s": toks / st,
        "invariant_ops_share": timer.seconds / last if last > 0 else float("nan"), "steps": n,
        "timed_steps": len(times), "phases_s": phases, "cpu_s": cpu,
    }  # fmt: skip


def phase_line(row: dict) -> str:
    """The timed step's phases (wall seconds, largest first) and the host's CPU seconds."""
    parts = sorted(row["phases_s"].items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{name} {sec:.3f}" for name, sec in parts if sec >= 0.0005)
    return f"phases (s): {shown}; host CPU {row['cpu_s']:.3f} s of {row['step_s']:.3f} s"


def _verdict(row: dict) -> str:
    preset, _, suffix = row["recipe"].partition("@")
    if preset not in EXACT or "fast" in suffix.split("+"):
        return "-"
    return "MET" if row["exact_every_step"] else "NOT MET"


MIN_TIMED_STEPS = 3  # the fewest timed steps whose spread can resolve a cost


def exactness_cost(rows: list[dict]) -> list[str]:
    """Per model with both runs: jetrl's step time over jetrl@fast's (the batch-invariant ops'
    cost; the field's anchors: ~1.1x veRL's zero-diff W8A8 preview, ~1.01x Megatron-LM's tuned
    BF16 batch-invariant inference), and whether the timed steps resolve it: each recipe's
    slowest and fastest timed step, "resolved" only when their ranges do not overlap over at
    least `MIN_TIMED_STEPS` steps each (run 8 printed 1.16x from one step a recipe, where two
    exact recipes' single steps differed by 1.6x)."""
    lines = []
    by = {(r["model"], r["recipe"]): r for r in rows if "step_s" in r}
    for (model, recipe), fast in by.items():
        exact = by.get((model, "jetrl"))
        if recipe != "jetrl@fast" or exact is None:
            continue
        ratio = exact["step_s"] / fast["step_s"]
        (e_lo, e_hi), (f_lo, f_hi) = exact["step_range_s"], fast["step_range_s"]
        timed = min(exact["timed_steps"], fast["timed_steps"])
        apart = e_lo > f_hi or e_hi < f_lo
        verdict = (
            "resolved" if apart and timed >= MIN_TIMED_STEPS
            else f"not resolved ({timed} timed steps, ranges {'apart' if apart else 'overlap'})"
        )  # fmt: skip
        lines.append(
            f"cost of exactness ({model}): jetrl step {exact['step_s']:.3f} s, without the "
            f"invariant ops {fast['step_s']:.3f} s: {ratio:.2f}x the step time, tokens/s "
            f"{exact['tokens_per_s']:.1f} vs {fast['tokens_per_s']:.1f}; timed steps "
            f"{e_lo:.3f}-{e_hi:.3f} s vs {f_lo:.3f}-{f_hi:.3f} s: {verdict}"
        )
    return lines


def _timed_steps(n: int) -> list[int]:
    """The steps a run of ``n`` times: after the first (compiles, warms up), before the last
    (instrumented); with fewer than 3 steps, the last."""
    return list(range(2, n)) if n >= 3 else [n]


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        Path(path).write_text(json.dumps({"device": dev, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device.startswith("cuda"):
        _common.require_cuda("bench_local_grpo.py")
    if args.tiny:
        args.prompts, args.generations = min(args.prompts, 2), min(args.generations, 2)
    recipes = [r for r in args.recipes.split(",") if r]
    rows = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench_local_grpo_") as tmp:
        work = Path(tmp)
        for name in [m for m in args.models.split(",") if m]:
            model = model_json(name, args.tiny, work)
            print(f"model {name}{' (tiny)' if args.tiny else ''} on {args.device}:", flush=True)
            for recipe in recipes:
                try:
                    row = {"model": name, **run_recipe(recipe, model, args, work)}
                except Exception as exc:  # one lease: report it, run the rest
                    print(f"  {recipe:12s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                    rows.append({"model": name, "recipe": recipe, "error": repr(exc)})
                    ok = False
                    _write(args.json, rows)
                    continue
                row["exactly_on_policy"] = _verdict(row)
                ok &= row["exactly_on_policy"] != "NOT MET"
                rows.append(row)
                _write(args.json, rows)  # after every row: a timed-out lease keeps what ran
                print(
                    f"  {recipe:12s} tmpe {row['tmpe_max']:.6f}  gen_kl {row['gen_kl_max']:.3e}  "
                    f"exactly on-policy: {row['exactly_on_policy']:7s} "
                    f"mismatch {row['mismatch']:.3e}  step {row['step_s']:.3f} s  "
                    f"{row['tokens_per_s']:.1f} tokens/s  invariant ops "
                    f"{100 * row['invariant_ops_share']:.1f}% of the instrumented step",
                    flush=True,
                )
                print(f"  {'':12s} {phase_line(row)}", flush=True)
    for line in exactness_cost(rows):
        print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
