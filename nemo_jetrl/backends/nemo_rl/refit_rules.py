"""What NeMo-RL's refit must be for the hook's guarantees, checked before launch.

The hook (`vllm_refit`) quantizes in NeMo-RL's ``fp8.load_weights`` and wraps the two
transports that call it: the IPC refit (colocated) and the collective one (non-colocated).
NeMo-RL main's other transports (``policy.generation.refit_transport``: NCCL reshard, NIXL's
checkpoint engine, the sparse deltas) load weights without it, so the hook refuses them in the
vLLM worker; by then the trainer is already sending, and a refusal mid-protocol leaves it waiting
(NCCL reshard's trainer synchronises on sends nobody receives). So they are refused here, with
the config's other errors, before Ray starts.

The parity check and the rollback vote cover one pipeline stage (`vllm_patch.rank_vote`): vLLM
``pipeline_parallel_size`` > 1 is refused while either is on.
"""

from __future__ import annotations

TRANSPORT_KEY = "policy.generation.refit_transport"
PP_KEY = "policy.generation.vllm_cfg.pipeline_parallel_size"


def refit_problems(
    *, transport: object, pp: object, parity: bool, rollback: bool
) -> list[tuple[str, str]]:
    """(key, why) for each refit setting the hooked refit cannot run with (none: it can).
    ``transport`` is ``policy.generation.refit_transport``, ``pp`` vLLM's
    ``pipeline_parallel_size``, ``parity``/``rollback`` whether ``jetrl.refit_parity_check`` /
    ``jetrl.refit_rollback`` are on."""
    from nemo_jetrl.vllm_patch.rank_vote import checks_on, stage_problem  # torch: only when asked

    problems: list[tuple[str, str]] = []
    if transport is not None:
        problems.append(
            (
                TRANSPORT_KEY,
                f"{transport!r}: this refit loads weights without NeMo-RL's fp8.load_weights, "
                "so the rollout would not get the trainer's FP8 bytes: set it to null (NeMo-RL's "
                "IPC refit when colocated, its collective refit otherwise), or set "
                "jetrl.refit_hook to false",
            )
        )
    if why := stage_problem(pp, checks_on(parity=parity, rollback=rollback)):
        problems.append((PP_KEY, why))
    return problems
