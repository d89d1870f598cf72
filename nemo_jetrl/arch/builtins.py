"""Built-in model descriptions (numbers of public config.json files) and model resolution.

The dense models the package started with are written field by field; the MoE, hybrid and
larger dense models of NeMo-RL's GRPO configs are read from `catalog`'s config.json keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from nemo_jetrl.arch.catalog import CATALOG
from nemo_jetrl.arch.model import ModelArch


def _builtins() -> Mapping[str, ModelArch]:
    # Numbers from each model's public config.json on the HuggingFace hub.
    llama31_8b = dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=False,
        qkv_bias=False,
    )
    archs = [
        ModelArch(name="meta-llama/Llama-3.1-8B", **llama31_8b),
        ModelArch(name="meta-llama/Llama-3.1-8B-Instruct", **llama31_8b),
        ModelArch(
            name="Qwen/Qwen2.5-7B",
            model_type="qwen2",
            hidden_size=3584,
            intermediate_size=18944,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=152064,
            tie_word_embeddings=False,
            qkv_bias=True,
        ),
        ModelArch(
            name="Qwen/Qwen3-8B-Base",
            model_type="qwen3",
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=False,
            qkv_bias=False,
            qk_norm=True,
        ),
    ]
    # Qwen3-1.7B(-Base): the smoke config's model (tied embeddings, 16/8 heads of 128).
    qwen3_17b = dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=True,
    )
    archs += [ModelArch(name=f"Qwen/Qwen3-1.7B{s}", **qwen3_17b) for s in ("", "-Base")]
    archs += [ModelArch.from_hf_config(cfg, name=name) for name, cfg in CATALOG.items()]
    return MappingProxyType({a.name: a for a in archs})


BUILTIN_ARCHS: Mapping[str, ModelArch] = _builtins()

# NeMo-RL's DeepSeek-V3 configs (both trees) ship this text as policy.model_name: its
# docs/guides/deepseek.md has the user cast deepseek-ai/DeepSeek-V3 to BF16 (config.json copied
# without quantization_config) and point model_name at that directory. The exact text stands for
# that model; anything else, such as the path filled in later, resolves as itself.
PLACEHOLDER_MODELS: Mapping[str, str] = MappingProxyType(
    {
        "Follow instructions in https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/"
        "deepseek.md": "deepseek-ai/DeepSeek-V3",
    }
)


def placeholder_note(model_name: object) -> str | None:
    """What `check` says when ``model_name`` is a NeMo-RL placeholder it reads as a built-in."""
    builtin = PLACEHOLDER_MODELS.get(model_name) if isinstance(model_name, str) else None
    if builtin is None:
        return None
    return (
        f"NeMo-RL's placeholder (convert {builtin} to BF16 as its guide says): checked as the "
        f"built-in {builtin}; set jetrl.model_config to the converted checkpoint's config.json "
        "(or policy.model_name to its directory) to check that file instead"
    )


def builtin_arch(name: str) -> ModelArch | None:
    """The built-in description for a HF repo id (case-insensitive), or None."""
    for key, arch in BUILTIN_ARCHS.items():
        if key.lower() == str(name).lower():
            return arch
    return None


def resolve_arch(model_name: str | None, model_config: str | None = None) -> ModelArch | None:
    """The architecture from an explicit config.json path, else a built-in for `model_name` (or
    the one a `PLACEHOLDER_MODELS` text stands for), else None (unknown model). An existing local
    directory as model_name is read too."""
    if model_config:
        return ModelArch.from_json(model_config)
    if not model_name:
        return None
    arch = builtin_arch(PLACEHOLDER_MODELS.get(model_name, model_name))
    if arch is not None:
        return arch
    path = model_dir_config(model_name)
    return ModelArch.from_json(path.parent) if path is not None else None


def model_dir_config(model_name: object) -> Path | None:
    """The config.json of a local checkpoint directory named by ``model_name`` (NeMo-RL's
    policy.model_name may be a path), or None when it names none."""
    if not isinstance(model_name, str) or not model_name:
        return None
    path = Path(model_name, "config.json")
    return path if path.is_file() else None


def generic_arch(num_layers: int) -> ModelArch:
    """A stand-in with 128-aligned shapes, for checking recipes of models we cannot describe."""
    return ModelArch(
        name="<generic aligned model>",
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
    )
