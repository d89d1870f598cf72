"""Train/rollout mismatch from an FP8 KV cache, with and without on-policy KV (CPU, real parts).

Setup: the local backend's model (2-layer Llama, hidden 256, built from its config) gets a short
supervised warm start on the synthetic arithmetic task so its distributions are not flat. Then,
for three recipes sharing that policy and the same sampling seed:

- ``jetrl``: FP8 linears on both sides (trainer `Fp8BlockLinear`, rollout `Fp8InferenceLinear`,
  same quantizer), BF16 KV cache;
- ``jetrl_kv (off-policy KV)``: plus an FP8 KV cache in rollout, trainer attention unquantized;
- ``jetrl_kv (on-policy KV)``: plus the rollout's KV quantization in the trainer's attention,

the rollout samples responses (temperature 1, incremental decoding with the FP8 KV cache), the
trainer scores the same tokens with a full-sequence forward, and `nemo_jetrl.rl.metrics` computes
``token_mult_prob_error`` etc. over response tokens. KV scales come from trainer calibration on
a batch of warm-start data (99.9th percentile, margin 1.05, real tokens).

Usage: .venv/bin/python benchmarks/kvcache_mismatch.py [--num-ops 3 6] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def warm_start(model, tok, task_cfg, steps: int, batch: int, seed: int) -> None:
    from nemo_jetrl.backends.local.task import encode_prompts, encode_targets, sample_problems

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        probs = sample_problems(batch, task_cfg, g)
        p, t = encode_prompts(probs, tok), encode_targets(probs, tok)
        ids = torch.cat([p, t], dim=1)
        logits = model(input_ids=ids).logits[:, p.shape[1] - 1 : -1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), t.reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    print(f"warm start: {steps} steps, final loss {loss.item():.3f}")


def run(args, num_ops: int) -> None:
    from nemo_jetrl.backends.local.model import build_model, is_fp8_linear_name, load_model_config
    from nemo_jetrl.backends.local.task import (
        TaskConfig,
        decode_responses,
        encode_prompts,
        encode_targets,
        sample_problems,
    )
    from nemo_jetrl.backends.local.tokenizer import load_tokenizer
    from nemo_jetrl.fp8.convert import convert_to_fp8_inference, convert_to_fp8_training
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.kvcache.hf import KVCacheController
    from nemo_jetrl.rl.metrics import mismatch_metrics

    dtype = getattr(torch, args.dtype)
    tok = load_tokenizer()
    task_cfg = TaskConfig(num_ops=num_ops)
    cfg = load_model_config()
    policy = build_model(cfg, dtype=torch.float32, seed=args.seed)
    t0 = time.perf_counter()
    warm_start(policy, tok, task_cfg, args.sft_steps, 32, args.seed)
    print(f"  ({time.perf_counter() - t0:.0f} s)")
    policy = policy.to(dtype)

    def fp8_filter(mod, name):
        return is_fp8_linear_name(name)

    g = torch.Generator().manual_seed(args.seed + 1)
    calib_probs = sample_problems(args.samples, task_cfg, g)
    calib_ids = torch.cat([encode_prompts(calib_probs, tok), encode_targets(calib_probs, tok)], 1)
    probs = sample_problems(args.samples, task_cfg, g)
    prompts = encode_prompts(probs, tok)

    rows = []
    for label, kv, onpolicy in (
        ("jetrl", False, False),
        ("jetrl_kv (off-policy KV)", True, False),
        ("jetrl_kv (on-policy KV)", True, True),
    ):
        train, rollout = copy.deepcopy(policy), copy.deepcopy(policy)
        convert_to_fp8_training(train, module_filter_fn=fp8_filter)
        convert_to_fp8_inference(rollout, module_filter_fn=fp8_filter)
        ctl = KVCacheController(CalibrationSettings())
        hr = ctl.attach(rollout, role="rollout")
        ctl.attach(train, role="train", onpolicy=onpolicy)
        t0 = time.perf_counter()
        ctl.calibrate(train, calib_ids, torch.ones_like(calib_ids), mask="prompt_and_response")
        t_cal = time.perf_counter() - t0
        hr.set_mode(quantize=kv)
        torch.manual_seed(args.seed + 2)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = rollout.generate(
                prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=task_cfg.response_len() + 2,
                past_key_values=ctl.rollout_cache(), output_scores=True,
                return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )  # fmt: skip
        t_roll = time.perf_counter() - t0
        resp = out.sequences[:, prompts.shape[1] :]
        scores = torch.stack(out.scores, dim=1).float()
        gen_lp = torch.log_softmax(scores, -1).gather(-1, resp[..., None])[..., 0]
        _, _, rmask = decode_responses(resp, tok)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = train(input_ids=out.sequences).logits.float()
        t_score = time.perf_counter() - t0
        lp = torch.log_softmax(logits[:, prompts.shape[1] - 1 : -1], -1)
        prev_lp = lp.gather(-1, resp[..., None])[..., 0]
        m = mismatch_metrics(gen_lp, prev_lp, rmask.long())
        rows.append((label, m["train/token_mult_prob_error"], m["train/gen_kl_error"],
                     t_cal, t_roll, t_score, int(rmask.sum())))  # fmt: skip
        ctl.detach()
    print(
        f"num_ops={num_ops} (responses up to {task_cfg.response_len()} tokens), "
        f"{args.samples} samples, dtype {args.dtype}"
    )
    print(
        f"{'recipe':28s} {'token_mult_prob_error':>22s} {'gen_kl_error':>13s} "
        f"{'calib s':>8s} {'rollout s':>9s} {'score s':>8s} {'tokens':>7s}"
    )
    for r in rows:
        print(f"{r[0]:28s} {r[1]:22.6f} {r[2]:13.3e} {r[3]:8.2f} {r[4]:9.2f} {r[5]:8.2f} {r[6]:7d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-ops", type=int, nargs="+", default=[3])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for n in args.num_ops:
        run(args, n)


if __name__ == "__main__":
    main()
