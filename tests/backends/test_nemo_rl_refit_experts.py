"""MoE expert weights through the NeMo-RL refit hook (issue 28): per expert through our quantizer,
in the names vLLM's expert loader takes, in the parity check and the rollback.

The engine is the labelled stand-in of ``moe_standin.py`` (no vLLM CPU build starts a block-FP8
MoE model here); the NeMo-RL half runs the trees' real code: v0.7.0's ``fp8.load_weights`` and
the installed hook (NeMo-RL tier), main's ``_expand_grouped_moe_expert_to_fp8`` compiled from its
source (it imports vLLM 0.25 at the top).
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch
from moe_standin import MoeModel, trainer_weights, worker

from nemo_jetrl.backends.nemo_rl.refit_batches import (
    SentTensors,
    check_refit_parity,
    quantize_batch,
)
from nemo_jetrl.fp8 import quantize_blockwise
from nemo_jetrl.vllm_patch.refit import ParityError, RefitError
from nemo_jetrl.vllm_patch.settings import PatchSettings

FP32 = PatchSettings(pow2_weight_scales=False, pow2_activation_scales=False)
POW2 = PatchSettings()


def _refit(model, weights, settings, batches=3):
    """NeMo-RL's streamed refit into the stand-in: batches through `quantize_batch`, then parity."""
    sent = SentTensors()
    items = list(weights.items())
    for b in range(batches):
        model.load_weights(quantize_batch(items[b::batches], model, settings, sent))
    return sent, check_refit_parity(worker(model), sent)


@pytest.mark.parametrize("settings", [POW2, FP32], ids=["pow2", "fp32"])
@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_every_expert_is_ours_bit_for_bit_and_in_the_parity_check(settings, grouped):
    model = MoeModel()
    w = trainer_weights(model, 0, grouped=grouped)
    sent, report = _refit(model, w, settings)
    per_expert = trainer_weights(model, 0)  # the same values, per expert
    experts = [k for k in per_expert if ".experts." in k]
    assert len(experts) == 2 * 4 * 3
    for k in experts:  # what the engine computes with == quantize_blockwise of that expert
        q = quantize_blockwise(per_expert[k], (128, 128), pow2_scales=settings.pow2_weight_scales)
        layer, e, proj = int(k.split(".")[2]), int(k.split(".")[5]), k.split(".")[6]
        ex = model.model.layers[layer].mlp.experts
        group = "w2" if proj == "down_proj" else "w13"
        rows = slice(128, 256) if proj == "up_proj" else slice(0, None if group == "w2" else 128)
        srows = slice(1, 2) if proj == "up_proj" else slice(0, None if group == "w2" else 1)
        got = getattr(ex, f"{group}_weight")[e, rows]
        scale = getattr(ex, f"{group}_weight_scale_inv")[e, srows]
        assert torch.equal(got.view(torch.uint8), q.data.view(torch.uint8)), k
        assert torch.equal(scale.view(torch.int32), q.scale_inv.view(torch.int32)), k
        assert sent.fp8[k].dtype == torch.float8_e4m3fn
    # every expert weight and scale compared, plus embeddings and routers
    assert report.fp8 == 2 * len(experts) and report.compared == 2 * len(experts) + 3
    names = {n for batch in model.loaded for n in batch}  # loader layout: per expert, vLLM's names
    assert {f"{k}_scale_inv" for k in experts} <= names and set(experts) <= names
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)


@pytest.mark.parametrize("where", ["w2_weight", "w13_weight_scale_inv"])
def test_one_flipped_expert_byte_or_scale_is_named(where):
    model = MoeModel()
    sent, _ = _refit(model, trainer_weights(model, 1), FP32)
    p = getattr(model.model.layers[1].mlp.experts, where)
    with torch.no_grad():
        flat = p.data.view(torch.uint8).view(-1)
        flat[p.data[:3].numel() * p.element_size() + 5] ^= 1  # expert 3, first rows
    name = (
        "model.layers.1.mlp.experts.3.down_proj.weight"
        if where == "w2_weight"
        else "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"
    )
    with pytest.raises(ParityError, match=re.escape(name) + r" \(1 of \d+ bytes differ"):
        check_refit_parity(worker(model), sent)


def test_a_grouped_slab_that_would_straddle_a_boundary_is_refused_by_name():
    model = MoeModel()
    bad = torch.zeros(4, 2 * 192, 256, dtype=torch.bfloat16)  # 192 rows per shard: not 128-tiled
    with pytest.raises(RefitError, match=r"mlp\.experts\.gate_up_proj: \(4, 384, 256\).*straddle"):
        quantize_batch([("model.layers.0.mlp.experts.gate_up_proj", bad)], model, FP32, None)
    per = [("model.layers.0.mlp.experts.2.gate_proj.weight", torch.zeros(192, 256))]
    with pytest.raises(RefitError, match=r"experts\.2\.gate_proj\.weight: shape \(192, 256\)"):
        quantize_batch(per, model, FP32, None)


def test_bf16_experts_pass_through_and_are_still_compared():
    model = MoeModel(fp8=False)
    settings = dataclasses.replace(FP32, bf16_layer_kws=("mlp.experts",))
    w = trainer_weights(model, 2, grouped=True)
    sent, report = _refit(model, w, settings)
    assert report.fp8 == 0 and report.compared == len(w)  # the slabs themselves, byte for byte
    slab = w["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(model.model.layers[0].mlp.experts.w13_weight, slab)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.w2_weight[0, 0, 0] += 1
    with pytest.raises(ParityError, match=r"layers\.1\.mlp\.experts\.down_proj \(2 of \d+ bytes"):
        check_refit_parity(worker(model), sent)


@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_recipe_and_engine_disagreeing_on_expert_precision_is_refused(grouped):
    w = trainer_weights(MoeModel(), 3, grouped=grouped)
    batch = [(k, v) for k, v in w.items() if "layers.0" in k]
    bf16_recipe = dataclasses.replace(FP32, bf16_layer_kws=("mlp.experts",))
    with pytest.raises(RefitError, match=r"layers\.0\.mlp\.experts.*the recipe runs it in BF16"):
        quantize_batch(batch, MoeModel(fp8=True), bf16_recipe, None)
    with pytest.raises(RefitError, match=r"layers\.0\.mlp\.experts.*the recipe runs it in FP8"):
        quantize_batch(batch, MoeModel(fp8=False), FP32, None)


def test_an_expert_the_engine_does_not_hold_is_refused_by_name():
    """An engine with 2 experts per layer and no expert map (no rank holds experts 2 and 3)
    gets 4: experts 2 and 3 are named, nothing is loaded. (An expert-parallel rank's experts
    held elsewhere are left to vLLM's loader: tests/vllm_patch/test_expert_shards_unit.py.)"""
    model = MoeModel(e=2)
    w = trainer_weights(MoeModel(), 8)
    batch = [(k, v) for k, v in w.items() if "layers.0" in k]
    with pytest.raises(RefitError, match=r"experts\.3\.down_proj\.weight: .*engine holds None"):
        quantize_batch(batch, model, FP32, None)
    assert model.loaded == []


# --- NeMo-RL's real code -------------------------------------------------------------------


def _main_grouped_expander(pow2: bool):
    """main 7ea279a's ``_expand_grouped_moe_expert_to_fp8`` and what it calls, compiled unchanged
    from its source (the module imports vLLM 0.25 at the top)."""
    from conftest import NEMO_RL_UPSTREAM

    path = NEMO_RL_UPSTREAM / "main-7ea279a/nemo_rl/models/generation/vllm/quantization/fp8.py"
    if not path.is_file():
        pytest.skip(f"no NeMo-RL main source at {path}")
    tree = ast.parse(path.read_text())
    want = {"FP8_BLOCK_QUANT_KWARGS", "FP8Config", "cast_tensor_to_fp8_blockwise",
            "_quantize_grouped_experts_blockwise", "_expand_grouped_moe_expert_to_fp8"}  # fmt: skip
    nodes = [
        n
        for n in tree.body
        if getattr(n, "name", None) in want
        or (isinstance(n, ast.Assign) and n.targets[0].id in want)  # type: ignore[attr-defined]
    ]
    ns: dict = {"torch": torch, "dataclass": dataclasses.dataclass}
    exec(compile(ast.Module(nodes, []), str(path), "exec"), ns)
    ns["global_fp8_config"] = ns["FP8Config"](use_weight_pow2_scale=pow2)
    return ns["_expand_grouped_moe_expert_to_fp8"]


@pytest.mark.parametrize("settings", [POW2, FP32], ids=["pow2", "fp32"])
def test_same_names_and_layout_as_main_grouped_expansion(settings):
    """Our hook emits exactly the (name, shape, dtype) list main's expansion emits; the bits are
    the same with pow2 scales and differ with FP32 scales (why the hook exists)."""
    expand = _main_grouped_expander(settings.pow2_weight_scales)
    model = MoeModel()
    w = trainer_weights(model, 4, grouped=True)
    theirs, ours = [], quantize_batch(list(w.items()), model, settings, None)
    for k, v in w.items():
        theirs += expand(k, v) if k.endswith(("gate_up_proj", "experts.down_proj")) else [(k, v)]
    assert [(k, tuple(t.shape), t.dtype) for k, t in theirs] == [
        (k, tuple(t.shape), t.dtype) for k, t in ours
    ]
    differ = sum(
        not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        for (k, a), (_, b) in zip(theirs, ours, strict=True)
        if ".experts." in k
    )
    print(f"\n{differ} of 48 expert FP8 weights and scales differ from NeMo-RL main's quantizer")
    assert (differ == 0) == settings.pow2_weight_scales


def _as_vllm_fused_moe(model: MoeModel) -> None:
    """The stand-in's experts become instances of the installed vLLM's ``FusedMoE`` (its
    constructor needs a running engine's config; the parameters are the stand-in's), so that
    NeMo-RL's own ``_is_fp8_weight`` treats them as vLLM's experts."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    for layer in model.model.layers:
        fm = FusedMoE.__new__(FusedMoE)
        torch.nn.Module.__init__(fm)
        for n, p in layer.mlp.experts.named_parameters(recurse=False):
            fm.register_parameter(n, p)
        layer.mlp.experts = fm


@pytest.mark.nemo_rl
@pytest.mark.vllm
@pytest.mark.parametrize("settings", [POW2, FP32], ids=["pow2", "fp32"])
def test_same_names_as_nemo_rls_own_per_expert_refit(settings, monkeypatch):
    """v0.7.0's real ``fp8.load_weights`` (unhooked) on per-expert names hands vLLM's loader the
    same (name, shape, dtype) list our hook does; bits equal with pow2 scales only."""
    from nemo_rl_upstream import nemo_rl_vllm_modules

    _, fp8, _ = nemo_rl_vllm_modules()
    if not hasattr(fp8, "FusedMoE"):
        pytest.skip("this tree's fp8 module is main's (RoutedExperts): covered from its source")
    monkeypatch.setattr(fp8, "fp8_state", fp8.FP8State())
    cfg = fp8.FP8Config(use_weight_pow2_scale=settings.pow2_weight_scales)
    monkeypatch.setattr(fp8, "global_fp8_config", cfg)
    theirs_model, ours_model = MoeModel(), MoeModel()
    _as_vllm_fused_moe(theirs_model)
    _as_vllm_fused_moe(ours_model)
    batch = list(trainer_weights(theirs_model, 5).items())
    fp8.load_weights(batch, worker(theirs_model).model_runner)
    ours = quantize_batch(batch, ours_model, settings, None)
    ours_model.load_weights(ours)
    assert theirs_model.loaded == ours_model.loaded and len(ours) == len(batch) + 24
    differ = [
        n
        for n, p in theirs_model.named_parameters()
        if not torch.equal(
            p.view(torch.uint8), dict(ours_model.named_parameters())[n].view(torch.uint8)
        )
    ]
    print(f"\nparameters differing from NeMo-RL v0.7.0's own quantizer: {differ}")
    assert (differ == []) == settings.pow2_weight_scales
    assert all(".experts.w" in n for n in differ)


@pytest.mark.nemo_rl
@pytest.mark.vllm
@pytest.mark.parametrize("grouped", [False, True], ids=["per_expert", "grouped"])
def test_installed_hook_refits_experts_and_rolls_a_refused_stream_back(grouped):
    """The hook installed on the tree's real modules: a refit streamed through the hooked
    ``fp8.load_weights`` lands our expert bits and passes parity inside the transport; a non-
    finite expert in the last batch is refused and the engine is bit-identical to before."""
    from nemo_rl_upstream import nemo_rl_vllm_modules

    from nemo_jetrl.backends.nemo_rl import vllm_refit as vr

    _, fp8, _ = nemo_rl_vllm_modules()
    model = MoeModel()
    w = worker(model)

    def receive(self, batches):  # stand-in for NeMo-RL's ZMQ/IPC receive loop (no GPU here)
        for b in batches:
            fp8.load_weights(b, self.model_runner)
        return True

    h = vr.install_refit_hook(FP32, parity=True, rollback=True)
    try:
        state = getattr(fp8.load_weights, vr.MARK)
        transport = vr._make_transport("update_weights_via_ipc_zmq", receive, state)
        items = list(trainer_weights(model, 6, grouped=grouped).items())
        assert transport(w, [items[: len(items) // 2], items[len(items) // 2 :]]) is True
        report = w.model_runner._jetrl_last_parity
        assert report.fp8 == 48 and report.compared == 48 + 3
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        bad = trainer_weights(model, 7, grouped=grouped)
        if grouped:
            bad["model.layers.1.mlp.experts.down_proj"][2, 0, 0] = float("nan")
        else:
            bad["model.layers.1.mlp.experts.2.down_proj.weight"][0, 0] = float("nan")
        items = list(bad.items())
        name = re.escape("model.layers.1.mlp.experts.2.down_proj.weight")
        loads = len(model.loaded)
        with pytest.raises(RefitError, match=rf"(?s){name}.*non-finite.*rolled back"):
            transport(w, [items[: len(items) // 2], items[len(items) // 2 :]])
        assert len(model.loaded) == loads + 1  # batch 1 had landed before batch 2 was refused
        changed = [
            n
            for n, p in model.named_parameters()
            if not torch.equal(p.view(torch.uint8), before[n].view(torch.uint8))
        ]
        assert changed == []
    finally:
        h.revert()


@pytest.mark.parametrize("split", ["tp2_rank1", "ep2_rank1"])
def test_bf16_slabs_on_an_engine_whose_experts_are_split_compare_this_ranks_part(split):
    """vLLM's fused loader writes a rank's part of a grouped BF16 slab into its ``w13_weight``
    / ``w2_weight``: the local experts (expert parallel), this rank's slice of I, gate rows then
    up rows (tensor parallel). The parity check keeps exactly that part: before, it kept the
    whole slab and every refit of such an engine failed parity (4 x 256 rows against 4 x 128)."""
    from types import SimpleNamespace

    model = MoeModel(fp8=False, inter=256)
    settings = dataclasses.replace(FP32, bf16_layer_kws=("mlp.experts",))
    w = trainer_weights(model, 3, grouped=True)
    tp, ep = (2, 1) if split == "tp2_rank1" else (1, 2)
    par = SimpleNamespace(tp_size=tp, tp_rank=tp - 1, ep_size=ep, ep_rank=ep - 1, dp_size=1)
    emap = torch.tensor([-1, 0, -1, 1]) if ep > 1 else None  # rank 1 holds experts 1 and 3
    sent = SentTensors()
    for layer in model.model.layers:
        ex = layer.mlp.experts
        ex.moe_config = SimpleNamespace(moe_parallel_config=par)
        ex._expert_map = emap
    batch = quantize_batch(list(w.items()), model, settings, sent)
    model.load_weights([(k, v) for k, v in batch if not k.endswith("_proj")])  # the dense rest
    for i, layer in enumerate(model.model.layers):  # what vLLM's loader leaves on this rank
        gu, down = (
            w[f"model.layers.{i}.mlp.experts.gate_up_proj"],
            w[f"model.layers.{i}.mlp.experts.down_proj"],
        )
        if ep > 1:
            gu, down = gu[[1, 3]], down[[1, 3]]
        if tp > 1:
            gu = torch.cat([gu[:, 128:256], gu[:, 384:512]], dim=1)
            down = down[:, :, 128:256]
        ex = layer.mlp.experts
        ex.w13_weight = torch.nn.Parameter(gu.clone(), requires_grad=False)
        ex.w2_weight = torch.nn.Parameter(down.clone(), requires_grad=False)
    assert {k for k, _ in batch} >= {"model.layers.0.mlp.experts.gate_up_proj"}
    report = check_refit_parity(worker(model), sent)
    assert report.compared == len(w)
    with torch.no_grad():  # the control: one element of this rank's part moved is named
        model.model.layers[0].mlp.experts.w13_weight[1, 5, 7] += 1
    with pytest.raises(ParityError, match=r"layers\.0\.mlp\.experts\.gate_up_proj \("):
        check_refit_parity(worker(model), sent)


def test_a_transposed_grouped_slab_is_refused_by_name():
    """A slab laid out [E, H, 2I] (Llama 4's) would be split along the wrong dim into wrongly
    shaped per-expert views; refused naming it (the [E, 2I, H] control goes through)."""
    model = MoeModel(inter=128)
    w = trainer_weights(model, 4, grouped=True)
    good = w["model.layers.0.mlp.experts.gate_up_proj"]  # [4, 256, 256]: 2I == H here
    wide = MoeModel(inter=256)
    slab = torch.zeros(4, 256, 512, dtype=torch.bfloat16)  # [E, H, 2I] for H=256, I=256
    with pytest.raises(
        RefitError,
        match=r"gate_up_proj: \(4, 256, 512\) does not have the engine's hidden size 256",
    ):
        quantize_batch([("model.layers.0.mlp.experts.gate_up_proj", slab)], wide, FP32, None)
    out = quantize_batch([("model.layers.0.mlp.experts.gate_up_proj", good)], model, FP32, None)
    assert len(out) == 2 * 2 * 4  # per expert: gate and up, each weight + scale
