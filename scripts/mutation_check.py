"""Mutation check of the RL loss/metrics code: does tests/rl catch each deliberate bug?

Applies one mutation at a time to a copy-free working tree (edit, run, restore the exact
original bytes, even on Ctrl-C), runs ``pytest tests/rl`` and prints which tests failed.
A mutation that no test fails "survives". Usage (from the repository root):

    PYTHONPATH=. python scripts/mutation_check.py [--root DIR] [--only NAME ...] [--json OUT]

Each mutation lists (file, original text, mutated text) alternatives; the first whose original
text occurs exactly once is applied, so the script also runs on older layouts of the code.
Exit status: 0 when every mutation is killed, 1 when some survive, 2 when one cannot be applied.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

RL = "nemo_jetrl/rl/"
MUTATIONS: dict[str, list[tuple[str, str, str]]] = {
    "k1_kl sign flipped": [
        (RL + "metrics.py", 'out[_ours("k1_kl")] = _mean(-dv)', 'out[_ours("k1_kl")] = _mean(dv)')
    ],
    "seq-mask-tis arithmetic mean": [
        (
            f,
            "geo = torch.exp(log_r.sum(-1) / cnt.clamp(min=1))",
            "geo = torch.where(mask, torch.exp(log_r), torch.zeros_like(log_r)).sum(-1)"
            " / cnt.clamp(min=1)",
        )
        for f in (RL + "weights.py", RL + "correction.py")
    ],
    "ratio clip min/max swapped": [
        (
            RL + "loss.py",
            "ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)",
            "ratios.clamp(1.0 - cfg.ratio_clip_max, 1.0 + cfg.ratio_clip_min)",
        )
    ],
    "KL input-clamp detach removed": [
        (RL + "loss.py", "kl_w = torch.where(x == xc, kl_w, kl_w.detach())", "pass")
    ],
    "on-policy KL ignored": [(RL + "loss.py", "if cfg.use_on_policy_kl_approximation", "if False")],
    "k2 missing its 1/2": [
        (RL + "metrics.py", "return 0.5 * log_ratio * log_ratio", "return log_ratio * log_ratio"),
        (RL + "loss.py", "return 0.5 * x * x", "return x * x"),
    ],
    "KL output clamp ignored": [
        (
            RL + "loss.py",
            "kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)",
            "kl = kl",
        )
    ],
    "global_valid_seqs ignored": [
        (
            RL + "loss.py",
            "seq_den = float(global_valid_seqs) if global_valid_seqs is not None else",
            "seq_den =",
        )
    ],
    "approx_entropy sign": [
        (
            RL + "loss.py",
            "float(-(torch.exp(c64 - g64) * c64)",
            "float((torch.exp(c64 - g64) * c64)",
        )
    ],
    "chi2_seq clamp removed": [
        (RL + "metrics.py", ".clamp(-SEQ_LOG_RATIO_CLAMP, SEQ_LOG_RATIO_CLAMP)", "")
    ],
    "PPO max -> min": [
        (
            RL + "loss.py",
            "clip_loss = torch.maximum(-adv * ratios, -adv * ratios_clamped)",
            "clip_loss = torch.minimum(-adv * ratios, -adv * ratios_clamped)",
        )
    ],
    "IS weights not applied": [
        (
            RL + "loss.py",
            "actor_loss = aggregate(w * clip_loss)",
            "actor_loss = aggregate(clip_loss)",
        )
    ],
    "token_mult_prob_error without abs": [
        (
            RL + "metrics.py",
            'out[_name("token_mult_prob_error")] = _mean(torch.exp(dv.abs()))',
            'out[_name("token_mult_prob_error")] = _mean(torch.exp(dv))',
        )
    ],
    "tis ratio_min ignored": [
        (f, "lo_t = 0.0 if lo is None else lo", "lo_t = 0.0")
        for f in (RL + "weights.py", RL + "correction.py")
    ],
}


def _apply(root: Path, alternatives: list[tuple[str, str, str]]) -> tuple[Path, bytes] | None:
    for rel, old, new in alternatives:
        path = root / rel
        if not path.exists():
            continue
        text = path.read_text()
        if text.count(old) == 1:
            original = path.read_bytes()
            path.write_text(text.replace(old, new))
            return path, original
    return None


def _run_tests(root: Path, pytest_args: list[str]) -> tuple[int, list[str]]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "tests/rl"]
    out = subprocess.run(cmd + pytest_args, cwd=root, capture_output=True, text=True)
    failed = sorted(set(re.findall(r"^FAILED (\S+)", out.stdout, flags=re.M)))
    return out.returncode, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    ap.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    ap.add_argument("--json", type=Path, help="write {mutation: [failing tests]} here")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    rc, failed = _run_tests(args.root, args.pytest_args)
    if rc != 0:
        print(f"the unmutated suite fails ({failed}); fix it first", file=sys.stderr)
        return 2
    table: dict[str, list[str]] = {}
    status = 0
    for name, alternatives in MUTATIONS.items():
        if args.only and name not in args.only:
            continue
        applied = _apply(args.root, alternatives)
        if applied is None:
            print(f"{name}: cannot apply (code changed?)", file=sys.stderr)
            return 2
        path, original = applied
        try:
            _, failed = _run_tests(args.root, args.pytest_args)
        finally:
            path.write_bytes(original)
        table[name] = failed
        print(f"{name:38s} {'KILLED' if failed else 'SURVIVED'}  {' '.join(failed)}", flush=True)
        status = status or (0 if failed else 1)
    survived = [n for n, f in table.items() if not f]
    print(f"{len(table) - len(survived)}/{len(table)} killed; survivors: {survived or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
