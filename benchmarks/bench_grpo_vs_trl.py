"""Does the local backend's GRPO learn as fast as TRL's `GRPOTrainer` on the same problem?

Both sides start from the same cached warm start and get the same model config, tokenizer,
task, reward function, prompts per step (the same problems, in the same order), group size,
batch, learning rate, AdamW settings, gradient clipping, temperature, answer budget and number
of steps; both are validated the same way (greedy decoding of the same held-out problems, scored
by `nemo_jetrl.backends.local.task.score`) every ``--val-period`` steps. The script prints the
two validation-accuracy curves side by side for every seed, then the seed means and a verdict
(ours must gain at least as much accuracy as TRL, within ``--tolerance``).

What differs is what each library does by design: TRL runs its own generation
(``model.generate``), advantages (group mean / std, no leave-one-out) and loss (``dapo``: token
mean over the batch, as ``token_level_loss: true``), in fp32; ours runs the recipe given with
``--recipe`` (default bf16: BF16 compute weights, fp32 masters) and the config's advantages.

TRL is a benchmark-only dependency (never imported by the package): create its environment with
``bash scripts/setup_trl_env.sh`` (``.venv-trl``) and run

    .venv-trl/bin/python benchmarks/bench_grpo_vs_trl.py [--seeds 0,1,2] [--steps 20]

Pass ``--side ours`` to run only the local backend (any environment with the ``local`` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,43,44", help="GRPO seeds (default: %(default)s)")
    p.add_argument(
        "--warmstart-seed", type=int, default=42, help="one warm start for every seed and side"
    )
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    p.add_argument("--val-period", type=int, default=None, help="default: the config's")
    p.add_argument("--lr", type=float, default=None, help="default: the config's")
    p.add_argument("--num-ops", type=int, default=None, help="default: the config's")
    p.add_argument("--recipe", default="bf16", help="our side's recipe (default: %(default)s)")
    p.add_argument("--side", choices=("both", "ours", "trl"), default="both")
    p.add_argument("--tolerance", type=float, default=0.05, help="accuracy slack of the verdict")
    p.add_argument("--json", default=None, help="also write the curves here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    return p.parse_args(argv)


def our_config(args: argparse.Namespace, seed: int, out: Path):
    """The local run's config: demo base + recipe + the benchmark's overrides."""
    from nemo_jetrl.commands.demo import recipe_config

    ov = [
        f"grpo.seed={seed}",
        f"jetrl.local.warmstart.seed={args.warmstart_seed}",
        "checkpointing.enabled=false",
        f"logger.log_dir={out}",
        *args.set,
    ]
    for key, val in (
        ("grpo.max_num_steps", args.steps),
        ("grpo.val_period", args.val_period),
        ("policy.optimizer.kwargs.lr", args.lr),
        ("jetrl.local.task.num_ops", args.num_ops),
    ):
        if val is not None:
            ov.append(f"{key}={val}")
    return recipe_config(args.recipe, out, ov)


def run_ours(cfg) -> dict[int, float]:
    """{step: validation accuracy} of the local backend (step 0 = before any update)."""
    from nemo_jetrl.backends.local.loop import Hooks, LocalRun, resolve_run

    run = LocalRun(resolve_run(cfg), log=lambda _m: None)
    try:
        rs = run.run
        curve = {0: run.validate()["validation/accuracy"]}
        while run.step < rs.max_num_steps:
            run.train_step(Hooks())
            if run.step % rs.val_period == 0 or run.step == rs.max_num_steps:
                curve[run.step] = run.validate()["validation/accuracy"]
                log(f"  ours  step {run.step}: val acc {curve[run.step]:.3f}")
    finally:
        run.close()
    return curve


def greedy_accuracy(model, run_like) -> float:
    """Validation accuracy of ``model`` decoded greedily, exactly as `RunStep.validate` does."""
    import torch

    from nemo_jetrl.backends.local.rollout import generate
    from nemo_jetrl.backends.local.task import decode_responses, encode_prompts, score

    tok, problems = run_like["tokenizer"], run_like["val_problems"]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        rb = generate(
            model,
            encode_prompts(problems, tok),
            max_new_tokens=run_like["max_new_tokens"],
            temperature=run_like["temperature"],
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            greedy=True,
        )
    model.train(was_training)
    texts, finished, _ = decode_responses(rb.response_ids, tok)
    task = run_like["task"]
    hits = [score(p, t, f, task)[1] for p, t, f in zip(problems, texts, finished, strict=True)]
    return sum(hits) / len(hits)


def run_trl(cfg, seed: int, workdir: Path) -> dict[int, float]:
    """{step: validation accuracy} of TRL's GRPOTrainer on the same problem as `run_ours`."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_jetrl.backends.local.setup import resolve_run
    from nemo_jetrl.backends.local.task import sample_problems, score, validation_problems
    from nemo_jetrl.backends.local.tokenizer import TOKENIZER_JSON, load_tokenizer
    from nemo_jetrl.backends.local.warmstart import load_or_train

    resolved = resolve_run(cfg)
    rs, local, loss_cfg = resolved.run, resolved.local, resolved.loss
    from nemo_jetrl.backends.local.model import build_model, load_model_config

    torch.set_num_threads(local.num_threads or torch.get_num_threads())
    tok = load_tokenizer(local.tokenizer)
    mcfg = load_model_config(local.model_config)
    task = local.task
    weights, _, _ = load_or_train(
        mcfg, tok, Path(local.tokenizer or TOKENIZER_JSON).read_text(), task, local.warmstart,
        rs.seed, local.resolved_cache_dir(), log=log,
    )  # fmt: skip
    model = build_model(mcfg, dtype=torch.float32, seed=rs.seed)
    model.load_state_dict(weights)
    # the same problems, in the same order, as the local run draws (data generator seed + 2)
    g = torch.Generator().manual_seed(rs.seed + 2)
    rows = []
    for _ in range(rs.max_num_steps):
        for p in sample_problems(rs.num_prompts_per_step, task, g):
            rows.append({"prompt": tok.bos_token + p.prompt, "answer": p.answer})
    max_new = rs.max_new_tokens or task.response_len() + 4
    by_prompt = {r["prompt"]: r["answer"] for r in rows}

    def reward(prompts, completions, completion_ids, **_kw):
        out = []
        for prompt, text, ids in zip(prompts, completions, completion_ids, strict=True):
            finished = tok.eos_token_id in list(ids)
            prob = type("P", (), {"answer": by_prompt[prompt]})
            out.append(score(prob, text, finished, task)[0])
        return out

    ev = {
        "tokenizer": tok,
        "val_problems": validation_problems(task, rs.seed),
        "max_new_tokens": max_new,
        "temperature": rs.temperature,
        "task": task,
    }
    curve = {0: greedy_accuracy(model, ev)}

    class Validate(TrainerCallback):
        def on_step_end(self, _args, state, _control, model=None, **_kw):
            s = state.global_step
            if s % rs.val_period == 0 or s == rs.max_num_steps:
                curve[s] = greedy_accuracy(model, ev)
                log(f"  trl   step {s}: val acc {curve[s]:.3f}")

    targs = GRPOConfig(
        output_dir=str(workdir),
        per_device_train_batch_size=rs.batch_size,
        num_generations=rs.num_generations_per_prompt,
        max_completion_length=max_new,
        learning_rate=rs.lr,
        adam_beta1=rs.betas[0],
        adam_beta2=rs.betas[1],
        adam_epsilon=rs.eps,
        weight_decay=rs.weight_decay,
        max_grad_norm=rs.max_grad_norm or 0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=rs.max_num_steps,
        temperature=rs.temperature,
        top_k=0,
        top_p=1.0,
        beta=float(loss_cfg.reference_policy_kl_penalty),
        epsilon=loss_cfg.ratio_clip_min,
        epsilon_high=loss_cfg.ratio_clip_max,
        scale_rewards="group" if rs.normalize_rewards else "none",
        loss_type="dapo" if loss_cfg.token_level_loss else "grpo",
        shuffle_dataset=False,
        seed=rs.seed,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=targs,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[Validate()],
    )
    trainer.train()
    return curve


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt(v: float | None) -> str:
    return "  -  " if v is None else f"{v:.3f}"


def print_table(curves: dict[str, dict[int, dict[int, float]]], seeds: list[int]) -> None:
    """Per step: each side's accuracy per seed and the mean over seeds."""
    sides = [s for s in ("ours", "trl") if s in curves]
    steps = sorted({st for side in sides for c in curves[side].values() for st in c})
    head = ["step"]
    for side in sides:
        head += [f"{side}:s{s}" for s in seeds] + [f"{side}:mean"]
    print("  ".join(f"{h:>9}" for h in head))
    for st in steps:
        row = [f"{st:>9}"]
        for side in sides:
            vals = [curves[side][s].get(st) for s in seeds]
            row += [f"{_fmt(v):>9}" for v in vals]
            got = [v for v in vals if v is not None]
            row.append(f"{_fmt(statistics.mean(got) if got else None):>9}")
        print("  ".join(row))


def gain(curve_by_seed: dict[int, dict[int, float]]) -> float:
    """Mean over seeds of (last - first) validation accuracy."""
    return statistics.mean(c[max(c)] - c[min(c)] for c in curve_by_seed.values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    curves: dict[str, dict[int, dict[int, float]]] = {}
    sides = ("ours", "trl") if args.side == "both" else (args.side,)
    with tempfile.TemporaryDirectory(prefix="jetrl_vs_trl_") as tmp:
        for side in sides:
            curves[side] = {}
            for seed in seeds:
                t0 = time.perf_counter()
                cfg = our_config(args, seed, Path(tmp) / f"{side}{seed}")
                log(f"{side} seed {seed}")
                fn = run_ours if side == "ours" else (lambda c, s=seed: run_trl(c, s, Path(tmp)))
                curves[side][seed] = fn(cfg)
                log(f"  {side} seed {seed}: {time.perf_counter() - t0:.0f}s")
    print_table(curves, seeds)
    gains = {side: gain(c) for side, c in curves.items()}
    for side, g in gains.items():
        print(f"{side}: mean validation-accuracy gain first->last {g:+.3f}")
    ok = True
    if len(gains) == 2:
        ok = gains["ours"] >= gains["trl"] - args.tolerance
        print(f"verdict: ours {'learns at least as fast as' if ok else 'LEARNS SLOWER THAN'} TRL")
    if args.json:
        Path(args.json).write_text(json.dumps({"curves": curves, "gains": gains}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
