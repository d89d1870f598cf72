"""What do refit quantization and KV calibration cost, as a fraction of a GRPO step?

Measured in one run on one GPU, for an 8B model built from its config (random weights: timing
does not depend on values):

* ``refit_quant``: `nemo_jetrl.vllm_patch.refit.quantize_state_dict` over every weight of the
  model (128x128 FP8 for the FP8 linears, guards included).
* ``refit_snapshot``: `nemo_jetrl.vllm_patch.rollback.take_snapshot` (what an all-or-nothing
  refit saves first) of a module holding exactly the refit's tensors, as the engine's model
  holds them (FP8 weights, scales, BF16 rest); its bytes are printed.
* ``refit_load_parity``: each sent tensor copied into that module (the engine's load) and read
  back and compared byte for byte (the refit's parity check, `parity_views.differ`), one tensor at a
  time as `check_parity` does.
* ``refit_total``: the three above, the refit as the patch runs it with rollback and parity on
  (the transport between processes is not included).
* ``kv_calib``: `nemo_jetrl.kvcache.hf.calibrate` (observer forwards over the step's sequences,
  ``--calib-fraction`` of them, then the scale reduction).
* ``train``: forward + backward of the step's sequences (``--train-seqs`` x ``--seq-len`` tokens)
  with activation checkpointing, extrapolated from ``--measure-micro-batches`` measured
  micro-batches of one sequence each (optimizer step not included: it does not fit beside an 8B
  model's Adam state on one GPU; it adds a few percent).
* ``rollout``: generation of the step's responses, either measured here by running
  ``bench_vllm_generation.py``'s worker (``--measure-rollout``) or given (``--rollout-seconds``).

``step = rollout + train + logprob`` where ``logprob`` (the trainer's scoring forward) is
counted as one third of ``train``. Fractions are each cost divided by ``step``; without a
rollout time they are printed against ``train`` only and labelled so.

Usage: python benchmarks/gpu/bench_refit_calibration.py [--model Qwen/Qwen3-8B-Base]
         [--train-seqs 512] [--seq-len 4608] [--measure-rollout | --rollout-seconds S]
"""

from __future__ import annotations

import argparse
import sys
import time

import _common
import torch


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="Qwen/Qwen3-8B-Base", help="built-in arch name or HF dir")
    ap.add_argument("--recipe", default="jetrl_kv")
    ap.add_argument("--train-seqs", type=int, default=512, help="sequences per GRPO step")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=4608, help="prompt + response tokens")
    ap.add_argument("--calib-fraction", type=float, default=0.25)
    ap.add_argument("--calib-micro-batch", type=int, default=4)
    ap.add_argument("--measure-micro-batches", type=int, default=3)
    ap.add_argument("--rollout-seconds", type=float, default=None)
    ap.add_argument("--measure-rollout", action="store_true")
    ap.add_argument("--num-layers", type=int, default=None, help="override (smaller model)")
    # CPU is for the repository's smoke test of this script only (tiny config, no timing claims).
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return ap


def _arch(args: argparse.Namespace):
    import dataclasses

    from nemo_jetrl.arch import resolve_arch

    arch = resolve_arch(args.model)
    if arch is None:
        raise SystemExit(
            f"unknown model {args.model!r}: give a built-in name or a dir with config.json"
        )
    if args.num_layers:
        arch = dataclasses.replace(arch, num_layers=args.num_layers)
    return arch


def _sync_time(fn) -> tuple[float, object]:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def _engine_stand_in(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose buffers are copies of the refit's tensors (what the engine holds)."""
    m = torch.nn.Module()
    for i, t in enumerate(tensors.values()):
        m.register_buffer(f"t{i}", t.detach().clone())
    return m


def _load_and_compare(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy each tensor in, read it back, compare bytes (the refit's load + parity check)."""
    from nemo_jetrl.vllm_patch.parity_views import differ as _differ

    bad = 0
    for (_, dst), src in zip(model.named_buffers(), tensors.values(), strict=True):
        dst.copy_(src)
        bad += _differ(dst.clone(), src, bytewise=True) is not None
    if bad:
        raise SystemExit(f"parity stand-in: {bad} tensors differ after a plain copy")
    return bad


def _refit_costs(state: dict[str, torch.Tensor], recipe) -> dict:
    from nemo_jetrl.vllm_patch.refit import quantize_state_dict
    from nemo_jetrl.vllm_patch.rollback import take_snapshot

    quant_s, qsd = _sync_time(lambda: quantize_state_dict(state, recipe))
    engine_model = _engine_stand_in(qsd.tensors)
    snap_s, snap = _sync_time(lambda: take_snapshot(engine_model))
    parity_s, _ = _sync_time(lambda: _load_and_compare(engine_model, qsd.tensors))
    return {
        "refit_quant_s": quant_s,
        "refit_snapshot_s": snap_s,
        "refit_load_parity_s": parity_s,
        "refit_total_s": quant_s + snap_s + parity_s,
        "snapshot_GB": snap.nbytes / 1e9,
        "fp8_layers": len(qsd.fp8_layers),
    }


def measure(args: argparse.Namespace) -> dict:
    from nemo_jetrl._optional import require

    transformers = require("transformers", feature="bench_refit_calibration")
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.kvcache.hf import calibrate
    from nemo_jetrl.recipe import Recipe

    arch = _arch(args)
    recipe = Recipe.preset(args.recipe)
    cfg = transformers.AutoConfig.for_model(**arch.to_hf_config())
    torch.manual_seed(0)
    dev = torch.device(args.device)
    with dev:
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    _refit_costs(state, recipe)  # warm-up (Triton compile, first allocations)
    refit = _refit_costs(state, recipe)  # its tensors are freed before training is measured

    n, t, p = args.train_seqs, args.seq_len, args.prompt_len
    ids = torch.randint(1000, arch.vocab_size - 1000, (n, t), device=dev)
    attn = torch.ones(n, t, dtype=torch.long, device=dev)
    resp = torch.zeros(n, t, dtype=torch.long, device=dev)
    resp[:, p:] = 1
    settings = CalibrationSettings(
        data_fraction=args.calib_fraction, micro_batch_size=args.calib_micro_batch
    )
    calibrate(model, ids[:2], attn[:2], resp[:2], settings=settings)  # warm-up
    calib_s, _ = _sync_time(lambda: calibrate(model, ids, attn, resp, settings=settings))

    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    model.config.use_cache = False

    def micro(i: int) -> None:
        out = model(input_ids=ids[i : i + 1], labels=ids[i : i + 1])
        out.loss.backward()

    micro(0)  # warm-up
    k = max(1, args.measure_micro_batches)
    mb_s, _ = _sync_time(lambda: [micro(i) for i in range(1, k + 1)])
    train_s = mb_s / k * n
    return {
        **refit,
        "kv_calib_s": calib_s,
        "train_s": train_s,
        "params_B": sum(v.numel() for v in state.values()) / 1e9,
    }


def measure_rollout(args: argparse.Namespace) -> float:
    """Rollout seconds of the step's responses via bench_vllm_generation's worker."""
    import bench_vllm_generation as gen

    gargs = gen.build_parser().parse_args(
        [
            "--model",
            args.model,
            "--num-prompts",
            str(args.train_seqs),
            "--input-len",
            str(args.prompt_len),
        ]
    )
    r = gen.run_one(gargs, args.recipe, args.seq_len - args.prompt_len)
    if "error" in r:
        raise SystemExit(f"rollout measurement failed: {r['error']}")
    return float(r["seconds"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda":
        _common.require_cuda("bench_refit_calibration")
        print(f"# {_common.gpu_name()}; model {args.model}, recipe {args.recipe}")
    m = measure(args)
    rollout = measure_rollout(args) if args.measure_rollout else args.rollout_seconds
    logprob = m["train_s"] / 3
    step = m["train_s"] + logprob + (rollout or 0.0)
    base = "step" if rollout else "train+logprob only (no rollout time given)"
    rows = []
    for name in ("refit_quant_s", "refit_snapshot_s", "refit_load_parity_s", "refit_total_s",
                 "kv_calib_s"):  # fmt: skip
        rows.append(
            {
                "cost": name[:-2],
                "seconds": m[name],
                "step_s": step,
                "fraction": m[name] / step,
                "of": base,
            }
        )
    print(
        f"# {m['params_B']:.2f}B params, {m['fp8_layers']} FP8 linears, rollback snapshot "
        f"{m['snapshot_GB']:.2f} GB; train {m['train_s']:.1f}s "
        f"(extrapolated), logprob {logprob:.1f}s, rollout "
        f"{f'{rollout:.1f}s' if rollout else 'n/a'}"
    )
    _common.print_table(rows, ("cost", "seconds", "step_s", "fraction", "of"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
