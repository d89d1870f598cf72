"""Time FP8 KV scale calibration against a trainer step on the local backend's model (CPU).

Builds the local backend's model from its config (2-layer Llama, hidden 256) or any Llama/Qwen2
config.json, makes a right-padded batch of prompt+response sequences, and measures (median of
``--repeats``):

- calibration: `nemo_jetrl.kvcache.hf.calibrate` (observer forwards + reduction),
- a trainer step proxy: one full-sequence forward + backward of the same batch,
- an FP8-KV rollout proxy: `generate` of the responses with the FP8 KV cache.

Usage: .venv/bin/python benchmarks/kvcache_calibration.py [--batch 16] [--prompt 32]
       [--response 64] [--micro-batch 4] [--config path/to/config.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default=None)
    args = ap.parse_args()

    from nemo_jetrl.backends.local.model import build_model, load_model_config
    from nemo_jetrl.kvcache import CalibrationSettings
    from nemo_jetrl.kvcache.hf import KVCacheController

    torch.manual_seed(0)
    cfg = load_model_config(args.config)
    train, rollout = build_model(cfg, seed=0), build_model(cfg, seed=0)
    b, total = args.batch, args.prompt + args.response
    ids = torch.randint(3, cfg.vocab_size, (b, total))
    lengths = torch.randint(args.prompt + 1, total + 1, (b,))
    am = (torch.arange(total)[None] < lengths[:, None]).long()
    rm = am.clone()
    rm[:, : args.prompt] = 0
    ids = ids * am  # pad id 0

    ctl = KVCacheController(CalibrationSettings(micro_batch_size=args.micro_batch))
    ctl.attach(rollout, role="rollout")
    ctl.attach(train, role="train", onpolicy=True)

    def timed(fn) -> float:
        ts = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t_cal = timed(lambda: ctl.calibrate(train, ids, am, rm))

    def step() -> None:
        train.zero_grad(set_to_none=True)
        logits = train(input_ids=ids, attention_mask=am).logits
        torch.nn.functional.cross_entropy(
            logits[:, :-1][am[:, 1:].bool()], ids[:, 1:][am[:, 1:].bool()]
        ).backward()

    t_step = timed(step)

    def roll() -> None:
        with torch.no_grad():
            rollout.generate(
                ids[:, : args.prompt],
                attention_mask=am[:, : args.prompt],
                max_new_tokens=args.response,
                min_new_tokens=args.response,
                do_sample=False,
                past_key_values=ctl.rollout_cache(),
                pad_token_id=0,
            )

    t_roll = timed(roll)
    res = ctl.last
    print(
        f"model: {cfg.model_type} layers={cfg.num_hidden_layers} hidden={cfg.hidden_size}; "
        f"batch {b} x {total} tokens (prompt {args.prompt}, response <= {args.response}), "
        f"micro-batch {args.micro_batch}, torch threads {torch.get_num_threads()}"
    )
    print(f"calibration            {t_cal * 1e3:9.1f} ms  ({res.micro_batches} forwards)")
    print(f"trainer fwd+bwd        {t_step * 1e3:9.1f} ms")
    print(f"FP8-KV rollout         {t_roll * 1e3:9.1f} ms")
    print(
        f"calibration / (rollout + fwd+bwd + calibration) = {t_cal / (t_roll + t_step + t_cal):.1%}"
    )
    print("scales:", {k: round(v, 6) for k, v in res.scales.to_vllm().items()})


if __name__ == "__main__":
    main()
