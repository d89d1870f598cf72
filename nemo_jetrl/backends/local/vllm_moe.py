"""A local MoE policy on the vLLM rollout engine: its weights as vLLM loads them, and the
engine's routing as the local routing controller compares and replays it.

* **Weights**: transformers 5 stores a Qwen3-MoE block's experts fused (``mlp.experts.gate_up_proj``
  ``[E, 2I, H]``, gate rows first; ``mlp.experts.down_proj`` ``[E, H, I]``); a Qwen3-MoE
  checkpoint, which vLLM's loader reads, names them per expert
  (``mlp.experts.{e}.{gate,up,down}_proj.weight``). `engine_weights` splits the trainer's fused
  tensors into those names (views, no copy); the vLLM refit then quantizes each expert's
  projections 128x128 with the trainer's quantizer (jetrl) or sends them BF16 (bf16), and its
  parity check reads every expert tensor back.
* **Routing**: `routing_tensors` turns what `nemo_jetrl.vllm_patch.routing_capture` recorded in
  the engine (per request: positions and ``[n, moe_layers, k]`` experts) into the layout of the
  HF rollout's record, per MoE layer ``[B, P + W - 1, k]`` int32 over the rollout batch (``W``:
  the batch's response width), plus a ``[B, P + W - 1]`` mask of the positions the engine
  computed for that request (a response shorter than ``W`` has none past its last fed token).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def engine_weights(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trainer's weights under the checkpoint names vLLM loads: fused expert tensors split
    per expert (gate = the first half of ``gate_up_proj``'s rows); everything else unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _FUSED.match(name)
        if m is None:
            out[name] = t
            continue
        base, which = m.groups()
        if t.dim() != 3:
            raise ValueError(f"{name}: fused experts must be [E, N, K], got {tuple(t.shape)}")
        for e in range(t.shape[0]):
            if which == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = t[e]
                continue
            if t.shape[1] % 2:
                raise ValueError(f"{name}: odd gate_up rows {t.shape[1]}")
            gate, up = t[e].chunk(2, dim=0)
            out[f"{base}.{e}.gate_proj.weight"] = gate
            out[f"{base}.{e}.up_proj.weight"] = up
    return out


def routing_tensors(
    captured: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    request_ids: Sequence[str],
    response_lens: Sequence[int],
    *,
    prompt_len: int,
    width: int,
    layers: int,
    top_k: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per MoE layer ``[B, P + W - 1, k]`` int32, ``[B, P + W - 1]`` captured mask) of a batch
    (module docstring); positions from ``P + len - 1`` on are dropped (no logprob of the response
    came from them). Raises when a request has no capture or another shape."""
    from nemo_jetrl.vllm_patch.routing_capture import for_request

    b, s = len(request_ids), prompt_len + width - 1
    ids = torch.zeros(layers, b, s, top_k, dtype=torch.int32)
    valid = torch.zeros(b, s, dtype=torch.bool)
    for i, (rid, n) in enumerate(zip(request_ids, response_lens, strict=True)):
        got = for_request(captured, rid)
        if got is None:
            raise RuntimeError(f"vLLM routing capture: nothing recorded for request {rid!r}")
        pos, experts = got
        if experts.shape[1:] != (layers, top_k):
            raise RuntimeError(
                f"vLLM routing capture: request {rid!r} has experts {tuple(experts.shape[1:])} "
                f"(layers, top_k), the trainer ({layers}, {top_k})"
            )
        # positions whose outputs gave this response's logprobs: the prompt and every fed-back
        # token; a forward past them (a step scheduled before the stop was seen) is not its policy
        keep = pos < prompt_len + n - 1
        pos, experts = pos[keep], experts[keep]
        ids[:, i, pos] = experts.permute(1, 0, 2).to(torch.int32)
        valid[i, pos] = True
    return list(ids.unbind(0)), valid
