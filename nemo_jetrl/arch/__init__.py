"""Model architectures: every linear layer of a model, with its shape and group.

- `linear`: `Linear` (one linear, with its group) and `ArchError`;
- `model`: `ModelArch`, read from a HuggingFace config.json;
- `builtins`: descriptions of the models NeMo-RL's configs name, `resolve_arch`;
- `mamba`: Nemotron-H, one mixer per layer (Mamba-2, attention, MLP or experts);
- `state_space`: the other models with Mamba layers, recognised and refused (`StateSpaceArch`).
"""

from nemo_jetrl.arch.builtins import BUILTIN_ARCHS, builtin_arch, generic_arch, resolve_arch
from nemo_jetrl.arch.linear import ArchError, Linear
from nemo_jetrl.arch.model import ModelArch
from nemo_jetrl.arch.state_space import StateSpaceArch

__all__ = [
    "BUILTIN_ARCHS",
    "ArchError",
    "Linear",
    "ModelArch",
    "StateSpaceArch",
    "builtin_arch",
    "generic_arch",
    "resolve_arch",
]
