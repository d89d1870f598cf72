"""What NeMo-RL's Megatron policy workers receive from our driver, through their environment.

The translation (`translate.py`) puts these into ``policy.megatron_cfg.env_vars``, which NeMo-RL
passes to every policy worker's ``runtime_env``, so they are set before the worker process
starts; our worker class (`worker.py`) reads them back:

- ``NEMO_JETRL_RECIPE``: the recipe (JSON), checked against TE's scale variable;
- ``NEMO_JETRL_ALLOW_OFF_POLICY``: "1" where ``jetrl.allow_off_policy`` is true; the worker then
  warns about, rather than stops, a built model whose training forward is not the rollout's (as
  `jetrl check`'s gate lets such a run start).
- ``NEMO_JETRL_HF_IN_PROJ_SPLIT``: "1" for Qwen3.5's gated delta net in_proj (HF's in_proj_qkv/z/b/a),
  "0" for Qwen3-Next's (in_proj_qkvz/ba), unset for a model without one or not read: Megatron's
  ``TransformerConfig`` does not say which, and where the two differ the worker's block check
  (`megatron.blocks`) can judge in_proj only with it.

Plain Python (no NeMo-RL import).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from nemo_jetrl.megatron.config import FP32_SCALES_ENV
from nemo_jetrl.recipe import Recipe

RECIPE_ENV = "NEMO_JETRL_RECIPE"
ALLOW_OFF_POLICY_ENV = "NEMO_JETRL_ALLOW_OFF_POLICY"
HF_IN_PROJ_SPLIT_ENV = "NEMO_JETRL_HF_IN_PROJ_SPLIT"


def recipe_to_json(recipe: Recipe) -> str:
    return json.dumps(recipe.to_dict(), sort_keys=True)


def recipe_from_json(text: str) -> Recipe:
    try:
        return Recipe.from_dict(json.loads(text))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{RECIPE_ENV} does not hold a valid recipe ({exc}): {text[:200]!r}"
        ) from exc


def off_policy_allowed(env: Mapping[str, str]) -> bool:
    """Inside a policy worker: whether the run was launched with ``jetrl.allow_off_policy``."""
    return env.get(ALLOW_OFF_POLICY_ENV) == "1"


def hf_in_proj_split(env: Mapping[str, str]) -> bool | None:
    """Inside a policy worker: which HF weights the gated delta net's in_proj is (True: Qwen3.5's
    split, False: Qwen3-Next's, None: not said)."""
    text = env.get(HF_IN_PROJ_SPLIT_ENV)
    if text is None:
        return None
    if text not in ("0", "1"):
        raise RuntimeError(
            f"{HF_IN_PROJ_SPLIT_ENV}={text!r} in this worker: the translation sets '1' (Qwen3.5) "
            f"or '0' (Qwen3-Next); remove it from policy.megatron_cfg.env_vars"
        )
    return text == "1"


def check_policy_env(env: Mapping[str, str]) -> Recipe:
    """Inside a policy worker: the recipe from the env, with the TE variable consistent with it."""
    text = env.get(RECIPE_ENV)
    if not text:
        raise RuntimeError(
            f"{RECIPE_ENV} is not set in this worker: it must be started through "
            "nemo_jetrl.backends.nemo_rl.launch (policy.megatron_cfg.env_vars carries it)"
        )
    recipe = recipe_from_json(text)
    if recipe.train.fp8_linears and recipe.train.scaling == "blockwise":
        want = "0" if recipe.train.pow2_weight_scales else "1"
        have = env.get(FP32_SCALES_ENV, "0")
        if have != want:
            raise RuntimeError(
                f"{FP32_SCALES_ENV}={have!r} in this worker but the recipe needs {want!r}: set "
                f"policy.megatron_cfg.env_vars.{FP32_SCALES_ENV}={want!r}"
            )
    return recipe
