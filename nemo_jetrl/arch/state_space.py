"""Models with state-space (Mamba) layers: recognised by name or config.json, never read as a
transformer.

Nemotron-H (``model_type`` ``nemotron_h``: Nemotron-H 8B/47B/56B, Nemotron Nano 9B/12B v2,
Nemotron 3 Nano/Super) stacks one mixer per layer, chosen by a pattern: Mamba-2, attention, a
squared-ReLU MLP or experts. `arch.mamba` describes it, compared weight for weight with
transformers' NemotronH. The other families (Jamba, Falcon-H1, Zamba, Bamba, Granite 4.0-H,
plain Mamba) are not described: read as a dense decoder, the flow would judge linears the model
does not have, miss those it has, and give Mamba layers a KV cache. So:

- `ModelArch.from_hf_config` refuses their config.json (`StateSpaceArch`), naming the evidence;
- with FP8 on some side, `jetrl check` refuses any state-space model by name, exit 2
  (`flow.support`): nemo_jetrl has not matched vLLM's Mamba-2 mixer with Megatron's, described
  or not;
- in BF16 on both sides the check runs on Nemotron-H's own layers when its config.json is
  read, else on a generic stand-in, and says why (nothing to align).

One more fact for NeMo-RL: Megatron-Bridge's Nemotron-H providers set ``first_last_layers_bf16``
(Megatron's default counts: one layer at each end), which NeMo-RL's ``fp8_cfg`` cannot reset, so
its FP8 training keeps layers 0 and N-1 BF16 (`nemo_jetrl.megatron.config.built_bf16_edges_problem`
refuses that model at the worker too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nemo_jetrl.arch.linear import ArchError

# transformers' model types whose layers include a state-space mixer (Mamba, Mamba-2).
STATE_SPACE_TYPES = frozenset(
    {
        "nemotron_h",
        "mamba",
        "mamba2",
        "falcon_mamba",
        "falcon_h1",
        "jamba",
        "bamba",
        "zamba",
        "zamba2",
        "granitemoehybrid",
    }
)
# config.json keys only a state-space model has (Nemotron-H's pattern and Mamba sizes; Jamba's
# and Bamba's mamba_* spellings).
STATE_SPACE_KEYS = (
    "hybrid_override_pattern",
    "layers_block_type",
    "mamba_num_heads",
    "mamba_d_state",
    "ssm_state_size",
)
# Names of state-space families on the hub: Nemotron-H, Nemotron Nano v2 (9B, 12B), Nemotron 3
# and 3.5 (Nano, Super, Omni, Lightning), Mamba, Jamba, Falcon-H1, Zamba, Bamba, Granite 4.0-H.
# Not the Llama-based Nemotrons (Llama-3.1-Nemotron-Nano-8B-v1, Llama-3.3-Nemotron-Super-49B).
STATE_SPACE_NAME = re.compile(
    r"nemotron-h(?![a-z])|nemotron-3(\.\d+)?-|nemotron-nano-\d+b-v2|mamba|jamba|falcon-h1|"
    r"zamba|bamba|granite-4\.0-h",
    re.IGNORECASE,
)
MAMBA_LAYERS = "Mamba mixers (in_proj, conv1d, out_proj) in a per-layer pattern"
MAMBA_MIXER = (
    "Mamba-2 mixers (vLLM's MambaMixer2 and Megatron's MambaMixer: in_proj's tensor-parallel "
    "split, the scan)"
)


class StateSpaceArch(ArchError):
    """A config.json of a state-space model `ModelArch` does not describe (not Nemotron-H)."""


def state_space_evidence(config: Mapping[str, Any]) -> str | None:
    """Why a config.json (or its ``text_config``) describes a model with state-space layers, as
    "key=value"; None when it does not."""
    parts = [config]
    if isinstance(config.get("text_config"), Mapping):
        parts.insert(0, config["text_config"])
    for part in parts:
        mt = part.get("model_type")
        if isinstance(mt, str) and mt in STATE_SPACE_TYPES:
            return f"model_type={mt!r}"
        for key in STATE_SPACE_KEYS:
            if part.get(key) is not None:
                value = part[key]
                if isinstance(value, list):
                    shown = f"[{len(value)} layer types]"
                elif isinstance(value, str) and len(value) > 24:
                    shown = f"{value[:24]!r}..."
                else:
                    shown = repr(value)
                return f"{key}={shown}"
    return None


def name_is_state_space(name: Any) -> bool:
    """A model name (HF repo id) of a state-space family."""
    return isinstance(name, str) and STATE_SPACE_NAME.search(name) is not None


def refuse_state_space(config: Mapping[str, Any], label: str) -> None:
    """Raise `StateSpaceArch` when ``config`` describes a model with state-space layers."""
    evidence = state_space_evidence(config)
    if evidence is not None:
        raise StateSpaceArch(
            f"config of {label!r} ({evidence}) has state-space layers ({MAMBA_LAYERS}), which "
            "nemo_jetrl does not describe: read as a transformer its layers would be wrong. Run "
            "it in BF16 on both sides, or use a model with attention layers only"
        )
