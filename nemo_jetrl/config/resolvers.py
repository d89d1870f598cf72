"""NeMo-RL's OmegaConf resolvers (``${mul:a,b}``, ``${div:a,b}``, ``${max:a,b}``, ``${add:a,b}``).

NeMo-RL's configs use them (e.g. ``${mul:${policy.train_global_batch_size}, 2}``), and its
launchers register them before reading a config (``nemo_rl.utils.config.
register_omegaconf_resolvers``). `register_resolvers` is the same step for our commands: it calls
NeMo-RL's own function when NeMo-RL is importable (so its definitions apply), else registers our
own equivalents. An explicit call (from `load_config`), idempotent: a resolver already
registered, by anyone, is left as it is.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable
from typing import Any


def _max(a: Any, b: Any) -> Any:
    return max(a, b)


# Our equivalents of NeMo-RL's resolvers (v0.7.0: mul, div, max; main adds add).
_OWN: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "mul": operator.mul,
    "div": operator.truediv,
    "max": _max,
}


def register_resolvers() -> str:
    """Register NeMo-RL's resolvers; returns who defined them: "nemo_rl" or "nemo_jetrl"."""
    from omegaconf import OmegaConf

    source = "nemo_jetrl"
    try:
        nrl_config = importlib.import_module("nemo_rl.utils.config")
    except ImportError:
        nrl_config = None  # NeMo-RL absent (or the empty PyPI placeholder)
    register = getattr(nrl_config, "register_omegaconf_resolvers", None)
    if callable(register):
        register()
        source = "nemo_rl"
    # omegaconf 2.4 renamed register_new_resolver (2.3, which NeMo-RL pins) to register_resolver.
    add = getattr(OmegaConf, "register_resolver", None) or OmegaConf.register_new_resolver
    for name, fn in _OWN.items():
        if not OmegaConf.has_resolver(name):
            add(name, fn)
    return source
