"""The NeMo-RL tier, MoE half (issue 28): `jetrl align --recipe jetrl` on every mixture-of-experts
FP8 GRPO config the tree ships, and the written file through NeMo-RL's REAL code: its loader,
``MasterConfig`` + ``grpo.setup`` up to the vLLM workers (GPU pieces stood in, see
``nemo_rl_upstream.drive_setup``), then ``validate_router_replay_config`` on the policy setup
produced (``megatron/setup.py`` calls it in the Megatron worker, which needs GPUs).

Done when (issue 28): align refuses none of them and writes each as the user would run it, with
nothing added on the command line. Exit 0 is ON-POLICY; exit 1 is allowed only for what align
must not change and names: ``grpo.async_grpo`` policy lag (precision on-policy), FP8 experts
whose routing NeMo-RL's vLLM cannot give our experts kernel (DeepSeek's), or a DTensor
(automodel) policy, which never trains in FP8 (then plain ``align``, a BF16 rollout, is
on-policy: exit 0). Align turns routing replay on where NeMo-RL can replay (Megatron policy +
vLLM; grpo.setup then asks vLLM for the routed experts), keeps the router in fp32/fp64, keeps
the user's per-name BF16 list and adds the words it needs (the Qwen3-MoE router ``mlp.gate``;
linears that do not tile 128, covered by an existing word or added by name).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from nemo_rl_upstream import drive_setup, fp8_grpo_configs, nemo_rl_load, tree_dir, tree_name
from omegaconf import OmegaConf

pytestmark = [pytest.mark.nemo_rl]

IGNORED_KWS = "policy.generation.vllm_cfg.quantization_ignored_layer_kws"


def _moe_configs() -> list[Path]:
    from nemo_jetrl.config import settings_of
    from nemo_jetrl.flow.support import moe_evidence

    return [
        p
        for p in fp8_grpo_configs(tree_dir())
        if moe_evidence(settings_of(OmegaConf.create(nemo_rl_load(p))))
    ]


def _align(jetrl, capsys, path: Path, out: Path, *recipe: str) -> tuple[int, str]:
    code = jetrl(["align", str(path), *recipe, "-o", str(out)])
    got = capsys.readouterr()
    assert "Traceback" not in got.out + got.err, path.stem
    return code, got.out + got.err


def test_every_moe_fp8_config_aligns_with_router_replay_and_nemo_rl_accepts_it(
    tmp_path, monkeypatch, capsys
):
    from nemo_rl.models.megatron.router_replay import validate_router_replay_config

    from nemo_jetrl.cli import main as jetrl

    configs = _moe_configs()
    assert configs, f"no MoE FP8 GRPO config found in {tree_dir()}"
    lines, replayed, on_policy, routed_off = [], 0, 0, 0
    for path in configs:
        name = path.stem
        out = tmp_path / f"{name}.aligned.yaml"
        code, text = _align(jetrl, capsys, path, out, "--recipe", "jetrl")
        assert out.is_file() and code in (0, 1), (name, code, text[-2000:])  # never refused
        source = nemo_rl_load(path)
        aligned = nemo_rl_load(out)  # NeMo-RL's own loader
        pol = aligned["policy"]
        megatron = (pol.get("megatron_cfg") or {}).get("enabled") is True
        verdict = next(ln for ln in text.splitlines() if ln.startswith("verdict:"))
        if code == 0:
            assert "ON-POLICY" in verdict, (name, verdict)
            on_policy += 1
        elif megatron:  # only what align must not change is left, named (precision on-policy):
            # the async lag, or FP8 experts whose routing NeMo-RL's vLLM 0.20 / 0.25 cannot
            # give our experts kernel (DeepSeek's grouped top-k: flow/backend.py)
            lag = "by policy lag (precision flow: on-policy)" in verdict
            routing = text.count("routing on NeMo-RL") == 2 and "OFF-POLICY" in verdict
            assert lag or routing, (name, verdict, text[-1500:])
            routed_off += routing
        else:  # a DTensor policy trains BF16: named, and plain align (BF16 rollout) is on-policy
            assert "policy.megatron_cfg.enabled=false" in text, (name, text[-2000:])
            plain = tmp_path / f"{name}.bf16.yaml"
            assert _align(jetrl, capsys, path, plain)[0] == 0, name
        kws = source["policy"]["generation"]["vllm_cfg"].get("quantization_ignored_layer_kws")
        got_kws = OmegaConf.select(OmegaConf.create(aligned), IGNORED_KWS) or []
        # The user's words kept, or widened to a word they contain (Qwen3.5: in_proj_a/b become
        # the whole fused in_proj, Megatron's one GEMM): nothing the user kept BF16 turns FP8.
        assert all(any(g in w for g in got_kws) for w in kws or []), (name, kws, got_kws)
        qwen3_moe = re.search(r"Qwen3-\d+B-A\d+B", pol["model_name"]) is not None
        assert ("mlp.gate" in got_kws) == qwen3_moe, name  # vLLM quantizes only its router
        if megatron:
            assert pol["router_replay"]["enabled"] is True, name
            assert pol["megatron_cfg"]["moe_router_dtype"] in ("fp32", "fp64"), name
            assert pol["megatron_cfg"].get("moe_expert_capacity_factor") is None, name
        else:
            assert not (pol.get("router_replay") or {}).get("enabled"), name
            assert "routing is not replayed" in text, name
        with monkeypatch.context() as mp:
            master = drive_setup(aligned, tmp_path / name, mp)  # loader -> MasterConfig -> setup
        if megatron:
            validate_router_replay_config(master.policy)  # raises on what NeMo-RL refuses
            kwargs = master.policy["generation"]["vllm_kwargs"]
            assert kwargs["enable_return_routed_experts"] is True, name  # set by grpo.setup
            replayed += 1
        lines.append(
            f"{name}: align exit {code} ({verdict.removeprefix('verdict: ')[:70]}), written,"
            " accepted by NeMo-RL's loader + setup"
            + (", router replay validated" if megatron else ", no Megatron policy: not replayed")
        )
    print(
        f"\nNeMo-RL {tree_name()}: {len(configs)} MoE FP8 GRPO configs, {on_policy} on-policy, "
        f"{routed_off} off for their routing, {replayed} replayed"
    )
    print("\n".join(lines))
    # v0.7.0 ships only DeepSeek-routed MoE FP8 configs (Moonlight, DeepSeek-V3): none on-policy
    assert replayed > 0 and on_policy + routed_off > 0
