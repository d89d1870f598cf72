"""The longest prompt + ``max_new_tokens`` against the model's ``max_position_embeddings``
(`nemo_jetrl.backends.local.seq_len`), refused before any work for both rollout engines.

Before: ``policy.generation.max_new_tokens=300`` on the repo's 2-layer Llama (256 positions) ran
the warm start, built both models, wrote ``config.yaml`` and TensorBoard events into
``logger.log_dir`` and then died at its first generate (a traceback from the rotary table, exit
1; the half-written directory then refused the corrected rerun), while the vLLM engine capped its
``max_model_len`` at 256 and cut the responses at 251 tokens without a word; a
prompt + max_new_tokens one past the table passed the HF rollout and failed in the trainer.
The vLLM engine's sizing from the longest prompt of every dataset runs in
test_local_vllm_seq_len.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from local_configs import EXAMPLES, tiny_cfg

from nemo_jetrl.backends.local.loop import LocalRun, resolve_run, run_local
from nemo_jetrl.backends.local.seq_len import training_problems
from nemo_jetrl.backends.local.task import encode_prompts, validation_problems
from nemo_jetrl.backends.local.tokenizer import TOKENIZER_JSON, load_tokenizer
from nemo_jetrl.cli import main
from nemo_jetrl.config import ConfigError

TABLE = 256  # the repo model's max_position_embeddings
# Seed 26, 1-operation problems, one prompt a step, one validation problem: validation "3-3=",
# training "7-9=" then "8+8=" (under `seven_tokenizer`: 5, 24 and 5 tokens).
SEED, SEVEN_FACTOR = 26, 20
ONE_PROMPT = (
    f"grpo.seed={SEED}",
    "grpo.num_prompts_per_step=1",
    "jetrl.local.task.val_size=1",
    "jetrl.local.warmstart.enabled=false",
)


def seven_tokenizer(path: Path) -> Path:
    """The repo's tokenizer with every '7' normalised to twenty: prompts of one task then have
    different lengths (5 tokens for ``3-3=``, 24 for ``7-9=``, 43 for ``7-7=``)."""
    from tokenizers import Tokenizer, normalizers

    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    tok.normalizer = normalizers.Replace("7", "7" * SEVEN_FACTOR)
    tok.save(str(path))
    return path


def _refusal(tmp_path: Path, *extra: str) -> str:
    with pytest.raises(ConfigError) as exc:
        resolve_run(tiny_cfg("jetrl", tmp_path / "run", tmp_path / "cache", *extra))
    assert not (tmp_path / "run").exists()
    return str(exc.value)


def test_too_long_for_the_model_exits_2_before_any_work(capsys, tmp_path):
    """The reported case, through the console script, with another error of the same config."""
    log_dir = tmp_path / "run"
    code = main(
        ["train", str(EXAMPLES / "jetrl.yaml"), "--backend", "local", "--no-progress",
         f"logger.log_dir={log_dir}", f"jetrl.local.cache_dir={tmp_path / 'cache'}",
         "policy.generation.max_new_tokens=300", "jetrl.local.device=cuda:99"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err, err
    assert not log_dir.exists(), "no run directory: nothing to clean up before the rerun"
    assert "2 problems" in err and "jetrl.local.device" in err  # reported together
    assert (
        "policy.generation.max_new_tokens: the longest prompt (5 tokens: training 5, validation "
        "5) + max_new_tokens 300 = 305 positions, past the model's max_position_embeddings 256"
    ) in err, err
    assert "set policy.generation.max_new_tokens <= 251" in err
    assert "jetrl.local.task.num_ops" in err and "max_position_embeddings >= 305" in err


# ids other than "vllm": that keyword would skip the case where vLLM is absent (tests/conftest.py)
@pytest.mark.parametrize("engine", ["hf", "vllm"], ids=["hf_engine", "vllm_engine"])
def test_both_engines_get_the_same_refusal(tmp_path, engine):
    """The rule is the trainer's, not an engine's: vLLM used to cap instead of refusing."""
    msg = _refusal(tmp_path, "policy.generation.max_new_tokens=300",
                   f"jetrl.local.rollout_engine={engine}")  # fmt: skip
    assert "+ max_new_tokens 300 = 305 positions" in msg


def test_the_default_max_new_tokens_counts_too(tmp_path):
    """null max_new_tokens is the answer length + 4: 31 operations need 65 + 193 positions."""
    msg = _refusal(tmp_path, "jetrl.local.task.num_ops=31")
    assert "(65 tokens: training 65, validation 65) + max_new_tokens 193 (null: the task's " in msg
    assert "answer length 189 + 4) = 258 positions" in msg and "now 31" in msg
    lengths = resolve_run(
        tiny_cfg("jetrl", tmp_path / "ok", tmp_path / "cache", "jetrl.local.task.num_ops=30")
    ).lengths
    assert (lengths.longest_prompt, lengths.max_new_tokens, lengths.max_positions) == (63, 187, 256)


def test_the_bound_is_the_trainers_whole_sequence(tmp_path):
    """Prompt + max_new_tokens = the table runs to its last position on both sides; one more,
    which the HF rollout's own check (it never feeds its last token) let through to fail in the
    trainer's scoring, is refused."""
    msg = _refusal(tmp_path, f"policy.generation.max_new_tokens={TABLE - 4}")
    assert f"= {TABLE + 1} positions" in msg and f"<= {TABLE - 5}" in msg
    cfg = tiny_cfg("jetrl", tmp_path / "ok", tmp_path / "cache",
                   f"policy.generation.max_new_tokens={TABLE - 5}",
                   "jetrl.local.warmstart.enabled=false")  # fmt: skip
    run = LocalRun(resolve_run(cfg))
    assert run.max_new_tokens == TABLE - 5 and run.resolved.lengths.longest_sequence == TABLE
    from nemo_jetrl.backends.local.rollout import generate
    from nemo_jetrl.backends.local.trainer import sequence_logprobs

    prompts = encode_prompts(run.val_problems[:1], run.tokenizer)
    rb = generate(run.rollout_model, prompts, max_new_tokens=run.max_new_tokens, temperature=1.0,
                  eos_id=-1, pad_id=0, generator=torch.Generator().manual_seed(0))  # fmt: skip
    seq = torch.cat([prompts, rb.response_ids], dim=1)
    assert seq.shape[1] == TABLE  # no <eos> ever: every new token generated
    lp = sequence_logprobs(run.trainer.model, seq, prompts.shape[1], 1.0)
    assert lp.shape == (1, TABLE - 5) and bool(torch.isfinite(lp).all())


def test_the_longest_prompt_of_every_dataset_and_the_stream_a_run_draws(tmp_path):
    """A tokenizer giving prompts of one task different lengths: the longest prompt is the
    longest the run's training steps draw (24 tokens), not the first validation prompt's (5, what
    the vLLM engine was sized from); and the replayed stream is the one a real run draws."""
    tok = seven_tokenizer(tmp_path / "seven.json")
    cfg = tiny_cfg("bf16", tmp_path / "run", tmp_path / "cache", *ONE_PROMPT,
                   f"jetrl.local.tokenizer={tok}")  # fmt: skip
    resolved = resolve_run(cfg)
    assert (resolved.lengths.train_prompt, resolved.lengths.val_prompt) == (24, 5)
    result = run_local(resolved, progress=False, log=lambda _: None)
    assert result.last_step == 2
    drawn = []
    for step in (1, 2):
        lines = (tmp_path / "run" / f"train_data_step{step}.jsonl").read_text().splitlines()
        rec = json.loads(lines[0])
        first_new = rec["token_loss_mask"][0].index(1)  # the prompt's tokens are not trained
        drawn.append(rec["token_ids"][0][:first_new])
    tokenizer, task = load_tokenizer(tok), resolved.local.task
    replayed = training_problems(task, SEED, 2, 1)
    assert [encode_prompts([p], tokenizer)[0].tolist() for p in replayed] == drawn
    assert [len(d) for d in drawn] == [24, 5]
    assert encode_prompts(validation_problems(task, SEED), tokenizer).shape[1] == 5
    # a longer run may draw a longer prompt still: all of its steps are measured
    longer = resolve_run(tiny_cfg("bf16", tmp_path / "r2", tmp_path / "cache", *ONE_PROMPT,
                                  f"jetrl.local.tokenizer={tok}", "grpo.max_num_steps=200"))  # fmt: skip
    assert longer.lengths.train_prompt == 5 + 2 * (SEVEN_FACTOR - 1)  # some "7+7=" or "7-7="
