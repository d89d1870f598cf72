"""Make a HuggingFace Llama/Qwen2/Qwen3-style causal LM (dense or MoE) batch-invariant, reversibly.

`make_batch_invariant(model)` swaps, in place and sharing every parameter (state-dict keys and
optimizer state are untouched):

- each ``*RMSNorm`` (Qwen3's per-head q/k norms too) for `InvariantRMSNorm` (`ops.rms_norm`);
- the rotary embedding for `RotaryTable`: cos/sin computed once, by the model's own rotary
  module, for every position, then gathered (torch's ``cos``/``sin`` kernels round a tensor's
  SIMD body and its tail differently, so per-call values depend on how many positions a call has);
- each MLP's SiLU for `InvariantSiLU` (`ops.silu`);
- the linears ``linear_filter`` accepts (default: those outside the decoder layers, i.e.
  ``lm_head``) for `InvariantLinear` (`ops.linear`); decoder linears are left alone: under an FP8
  recipe they are FP8 linears whose exact GEMM is already order-free
  (`nemo_jetrl.fp8.gemm.blockwise_matmul(exact=True)`), under BF16 they keep torch's GEMM, the
  one batch-variant op left (a broadcast-product GEMM would cost ~rows*N*K memory on CPU; on
  CUDA `ops.linear` is a Triton GEMM, so ``linear_filter`` may accept them there);
- MoE blocks that offer ``set_batch_invariant`` (`moe` routing and combine) are switched on;
  an HF sparse MoE block without it is refused;
- the attention function for `ops.attention`, registered with transformers' AttentionInterface
  under a name of this handle's, on a private copy of the model's config.

`InvariantHandle.restore` puts the original modules, config and attention back (idempotent).
Nothing happens at import; transformers is imported lazily.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nemo_jetrl.invariant import ops

_HANDLE_ATTR = "_jetrl_invariant_handle"
ATTENTION_PREFIX = "jetrl_invariant_"


class InvariantRMSNorm(nn.Module):
    """RMSNorm over the last dim sharing ``weight`` with the module it replaces."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.variance_epsilon)


class InvariantSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu(x)


class InvariantLinear(nn.Module):
    """``nn.Linear`` sharing the replaced layer's ``weight``/``bias``, computed by `ops.linear`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class RotaryTable(nn.Module):
    """Rotary cos/sin for positions ``0 .. max_positions-1``, made once by ``rotary`` itself."""

    def __init__(self, rotary: nn.Module, max_positions: int) -> None:
        super().__init__()
        rope_type = str(getattr(rotary, "rope_type", "default"))
        if "dynamic" in rope_type:
            raise ValueError(
                f"rope_type {rope_type!r} changes its frequencies with the sequence length; a "
                "batch-invariant model needs a fixed rotary table (set jetrl.local.batch_invariant"
                " to false for this model)"
            )
        # on the rotary's own device (its inv_freq buffer): a model moved to CUDA first
        dev = next((b.device for b in rotary.buffers()), torch.device("cpu"))
        pos = torch.arange(max_positions, device=dev)[None]
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, dtype=torch.float32, device=dev), pos)
        self.register_buffer("cos", cos[0].float(), persistent=False)
        self.register_buffer("sin", sin[0].float(), persistent=False)
        self.bound: int | None = None
        """Set by `positions_bounded`: the caller checked its positions on the host."""

    @property
    def size(self) -> int:
        """Positions the table holds (``config.max_position_embeddings``)."""
        return int(self.cos.shape[0])

    def check(self, n_positions: int) -> None:
        """Refuse positions ``0 .. n_positions-1`` when the table does not hold them all."""
        if n_positions > self.size:
            raise ValueError(
                f"position {n_positions - 1} is past the rotary table "
                f"({self.size} positions = config.max_position_embeddings)"
            )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.bound is None:
            # reading the largest position is a device sync: callers that know their positions
            # (a rollout's decode steps) check once on the host instead (`positions_bounded`)
            self.check(int(position_ids.max()) + 1)
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)


@contextmanager
def positions_bounded(model: nn.Module, n_positions: int) -> Iterator[None]:
    """Inside the block ``model``'s forwards use positions below ``n_positions`` only, as the
    caller promises: each `RotaryTable` is checked against it once, here (ValueError naming the
    first position past the table), and skips its per-forward read of the largest position."""
    tables = [m for m in model.modules() if isinstance(m, RotaryTable)]
    for t in tables:
        t.check(n_positions)
    saved = [t.bound for t in tables]
    for t in tables:
        t.bound = n_positions
    try:
        yield
    finally:
        for t, b in zip(tables, saved, strict=True):
            t.bound = b


def _attention_fn(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers attention-interface signature over `ops.attention` (no dropout: RL forwards)."""
    if dropout and module.training:
        raise ValueError("batch-invariant attention has no dropout; set attention_dropout to 0")
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]]
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, -torch.inf)
    return ops.attention(query, key, value, mask, scaling)


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    """Modules that switch their own ops (``set_batch_invariant``: MoE blocks whose routing and
    combine use `moe`); an HF sparse MoE block without it is refused (torch.topk's ties, index_add
    in expert order and per-expert GEMMs are not batch-invariant)."""
    found = []
    for name, m in model.named_modules():
        if callable(getattr(m, "set_batch_invariant", None)):
            found.append(m)
        elif type(m).__name__.endswith("SparseMoeBlock"):
            raise ValueError(
                f"{name} ({type(m).__name__}): swap MoE blocks for a block with batch-invariant "
                "routing first (nemo_jetrl.backends.local.moe.convert_moe_blocks)"
            )
    return found


def lm_head_only(name: str, _module: nn.Linear) -> bool:
    """Default ``linear_filter``: linears outside the decoder layers (``lm_head``)."""
    return ".layers." not in f".{name}."


class InvariantHandle:
    """The swaps made on one model; `restore` undoes them."""

    def __init__(self, model: nn.Module, linear_filter: Callable[[str, nn.Linear], bool]) -> None:
        from transformers import masking_utils, modeling_utils

        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(
                f"hidden_act {cfg.hidden_act!r}: batch-invariant models support silu MLPs only"
            )
        self.model = model
        self._swaps: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attr, original)
        self._switched = _moe_blocks(model)
        for m in self._switched:
            m.set_batch_invariant(True)
        for name, mod in list(model.named_modules()):
            for attr, child in list(mod.named_children()):
                full = f"{name}.{attr}" if name else attr
                new = self._replacement(full, attr, child, cfg, linear_filter)
                if new is not None:
                    self._swaps.append((mod, attr, child))
                    setattr(mod, attr, new)
        self.name = f"{ATTENTION_PREFIX}{id(self):x}"
        self._config = cfg
        private = copy.deepcopy(cfg)
        self._repointed = [m for m in model.modules() if getattr(m, "config", None) is cfg]
        for m in self._repointed:
            m.config = private
        modeling_utils.AttentionInterface.register(self.name, _attention_fn)
        eager_mask = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"]
        masking_utils.AttentionMaskInterface.register(self.name, eager_mask)
        model.set_attn_implementation(self.name)
        setattr(model, _HANDLE_ATTR, self)
        self.active = True

    @staticmethod
    def _replacement(
        full: str, attr: str, child: nn.Module, cfg: Any, linear_filter: Callable[..., bool]
    ) -> nn.Module | None:
        kind = type(child).__name__
        if kind.endswith("RMSNorm"):
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            return InvariantRMSNorm(child.weight, float(eps))
        if attr == "rotary_emb":
            return RotaryTable(child, int(cfg.max_position_embeddings))
        if attr == "act_fn":
            return InvariantSiLU()
        if type(child) is nn.Linear and linear_filter(full, child):
            return InvariantLinear(child)
        return None

    @property
    def swapped(self) -> list[str]:
        """Qualified names of the swapped modules."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return [f"{names[id(p)]}.{a}".lstrip(".") for p, a, _ in self._swaps]

    def restore(self) -> None:
        """Put the original modules, config and attention implementation back (idempotent)."""
        if not self.active:
            return
        from transformers import masking_utils, modeling_utils

        for parent, attr, original in reversed(self._swaps):
            setattr(parent, attr, original)
        for m in self._switched:
            m.set_batch_invariant(False)
        for m in self._repointed:
            m.config = self._config
        modeling_utils.AttentionInterface._global_mapping.pop(self.name, None)
        masking_utils.AttentionMaskInterface._global_mapping.pop(self.name, None)
        if getattr(self.model, _HANDLE_ATTR, None) is self:
            delattr(self.model, _HANDLE_ATTR)
        self.active = False

    def __enter__(self) -> InvariantHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def make_batch_invariant(
    model: nn.Module, *, linear_filter: Callable[[str, nn.Linear], bool] = lm_head_only
) -> InvariantHandle:
    """Swap ``model``'s non-GEMM ops (and the linears ``linear_filter`` accepts) for their
    batch-invariant versions; returns the handle that reverts it. Idempotent: a model that
    already has a live handle returns it. Call it before attaching FP8 KV (which wraps the
    attention implementation the model has at that moment)."""
    existing = getattr(model, _HANDLE_ATTR, None)
    if isinstance(existing, InvariantHandle) and existing.active:
        return existing
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl != "eager":
        raise ValueError(
            f"attn_implementation {impl!r}: make the model batch-invariant before attaching "
            "anything else to its attention (it must run 'eager' here)"
        )
    return InvariantHandle(model, linear_filter)


def is_batch_invariant(model: nn.Module) -> bool:
    handle = getattr(model, _HANDLE_ATTR, None)
    return isinstance(handle, InvariantHandle) and handle.active
