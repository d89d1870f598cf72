"""The vLLM engine's ``max_model_len``: the longest prompt of every dataset the run generates from
+ ``max_new_tokens`` (`nemo_jetrl.backends.local.seq_len`), up to the model's positions.

Before, it was the first validation prompt + max_new_tokens + 16, capped at
``max_position_embeddings``: here (`test_local_seq_len.seven_tokenizer`, one prompt a step, one
validation problem) 5 + 232 + 16 = 253, so the 24-token training prompt got 229 new tokens of
the 232 configured, without a word, and the 43-token prompts of a longer run would have been
refused by vLLM. Runs in the vLLM environment (one engine start).
"""

from __future__ import annotations

import pytest
import torch
from local_configs import tiny_cfg
from test_local_seq_len import ONE_PROMPT, SEED, TABLE, seven_tokenizer

from nemo_jetrl.backends.local.loop import LocalRun, resolve_run
from nemo_jetrl.backends.local.seq_len import training_problems
from nemo_jetrl.backends.local.task import encode_prompts

pytestmark = pytest.mark.vllm


def test_engine_sized_from_the_longest_training_prompt_up_to_the_table(tmp_path):
    tok = seven_tokenizer(tmp_path / "seven.json")
    new = TABLE - 24  # the longest prompt + max_new_tokens fills the table exactly
    cfg = tiny_cfg("bf16", tmp_path / "run", tmp_path / "cache", *ONE_PROMPT,
                   f"jetrl.local.tokenizer={tok}", "jetrl.local.rollout_engine=vllm",
                   f"policy.generation.max_new_tokens={new}")  # fmt: skip
    resolved = resolve_run(cfg)
    lengths = resolved.lengths
    assert (lengths.train_prompt, lengths.val_prompt, lengths.longest_sequence) == (24, 5, TABLE)
    run = LocalRun(resolved, log=lambda _: None)
    try:
        engine = run.engine._live()
        assert engine.llm.llm_engine.model_config.max_model_len == TABLE
        longest = training_problems(run.task, SEED, 2, 1)[0]
        assert longest.prompt.startswith("7")  # the step-1 prompt, 24 tokens
        ids = encode_prompts([longest], run.tokenizer)
        assert ids.shape[1] == 24
        gens = engine.generate(ids.tolist(), max_tokens=new, temperature=1.0, seed=[0],
                               ignore_eos=True)  # fmt: skip
        assert len(gens[0].token_ids) == new, gens[0].finish_reason  # every token configured
        kw = dict(max_new_tokens=new, temperature=1.0, eos_id=run.tokenizer.eos_token_id,
                  pad_id=run.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0))  # fmt: skip
        assert run.engine.generate(ids, **kw).response_ids.shape[0] == 1  # the run's own call
        # a prompt longer than any the run draws: refused by name, never cut short by vLLM
        with pytest.raises(ValueError, match=r"25 tokens \+ max_new_tokens 232 is past the "):
            run.engine.generate(torch.cat([ids, ids[:, -1:]], dim=1), **kw)
    finally:
        run.close()
