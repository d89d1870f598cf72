"""`tree_rules`' facts against what the NeMo-RL tree this tier imports really does (NeMo-RL tier,
each tree on the vLLM it ships): its own ``init_fp8`` builds the engine's quantization config for
``num_first_layers_in_bf16: 1`` and vLLM's own ``Fp8Config.get_quant_method`` says whether layer
0's linears stay BF16; NeMo-RL's own refit quantizer (``cast_tensor_to_fp8_blockwise``, what its
``load_weights`` runs on every FP8 layer's incoming tensor) is handed TE's FP8 codes, as main's
worker sends them with ``fp8_param``. Each runs in a fresh Python: ``init_fp8`` patches vLLM's
executor for the rest of its process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from nemo_rl_upstream import tree_dir

from nemo_jetrl.backends.nemo_rl.tree_rules import read_tree

pytestmark = pytest.mark.nemo_rl

EDGE_LAYERS = r"""
import inspect, json, sys
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import fp8 as vllm_fp8
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
Real = vllm_fp8.Fp8LinearMethod
class Fp8Method(Real):  # STAND-IN for __init__ only: the real one reads a running engine's
    def __init__(self, quant_config: Fp8Config):  # config; get_quant_method decides whether
        self.quant_config = quant_config           # it is built, as it would build the real one
same_init = inspect.signature(Fp8Method.__init__) == inspect.signature(Real.__init__)
from nemo_rl.models.generation.vllm.quantization import fp8
cfg = {"precision": "fp8", "kv_cache_dtype": "auto", "async_engine": False,
       "num_first_layers_in_bf16": 1}
qc = fp8.init_fp8(cfg, sys.argv[1], 1)["hf_overrides"]["quantization_config"]
config = Fp8Config.from_config(qc)
vllm_fp8.Fp8LinearMethod = Fp8Method  # after init_fp8, which patches the real class
layer = ReplicatedLinear.__new__(ReplicatedLinear)  # get_quant_method asks only its class
out = {}
for prefix in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.down_proj",
               "model.layers.1.self_attn.o_proj"):
    out[prefix] = isinstance(config.get_quant_method(layer, prefix), UnquantizedLinearMethod)
print(json.dumps({"bf16": out, "ignored": qc.get("ignored_layers"), "same_init": same_init}))
"""


def _run(script: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bf16_edge_layers_reach_vllm_exactly_where_the_facts_say(tmp_path):
    from hf_models import tiny_hf_config

    tiny_hf_config("llama", num_hidden_layers=2).save_pretrained(tmp_path)
    facts = read_tree(tree_dir() / "nemo_rl")
    assert facts is not None
    got = _run(EDGE_LAYERS, str(tmp_path))
    layer0 = [
        got["bf16"]["model.layers.0.self_attn.o_proj"],
        got["bf16"]["model.layers.0.mlp.down_proj"],
    ]
    assert got["same_init"]  # the stand-in's __init__ has the real class's signature
    assert not got["bf16"]["model.layers.1.self_attn.o_proj"]  # never asked for
    # v0.7.0: a nested list, layer 0 runs FP8 (the rule refuses); main: it runs BF16
    assert layer0 == [not facts.nested_bf16_edges] * 2, got
    assert isinstance(got["ignored"][0], list) == facts.nested_bf16_edges


REQUANT = r"""
import json, torch
from nemo_rl.models.generation.vllm.quantization import fp8
from nemo_jetrl.fp8 import quantize_blockwise
g = torch.Generator().manual_seed(0)
master = torch.randn(256, 256, generator=g) * 0.004
master[5, 7] = 228 / 4096  # block (0, 0): largest code 224 with power-of-two scales
out = {}
for pow2 in (True, False):  # TE's scale mode and the rollout's (vllm_cfg pow2_weight_...)
    te = quantize_blockwise(master, (128, 128), pow2_scales=pow2)  # TE's fp8_param weight
    fp8.global_fp8_config = fp8.FP8Config(use_weight_pow2_scale=pow2)
    codes, _ = fp8.cast_tensor_to_fp8_blockwise(te.data.to(torch.float), weight_block_size=[128, 128])
    # main's worker sends TE's *_scale_inv after the weight: the engine keeps TE's scales
    loaded = codes.float().reshape(2, 128, 2, 128) * te.scale_inv[:, None, :, None]
    moved = (loaded.reshape(256, 256) != te.dequantize()).reshape(2, 128, 2, 128).any(3).any(1)
    out[str(pow2)] = {"moved": moved.nonzero().tolist(), "ratio": (loaded.reshape(256, 256)[5, 7] / te.dequantize()[5, 7]).item()}
print(json.dumps(out))
"""


def test_nemo_rls_own_loader_doubles_te_fp8_blocks_with_pow2_scales():
    """Why main + fp8_param is refused with the hook off and power-of-two scales: main's worker
    sends TE's codes (`tree_rules` reads that from its source) and its loader quantizes them
    again as values. The loader is the same on both trees, so both run this."""
    got = _run(REQUANT)
    # power-of-two scales: the block whose largest code is 224 comes back doubled
    assert got["True"] == {"moved": [[0, 0]], "ratio": 2.0}, got
    # FP32 scales: every block's largest code is 448, which it keeps (the control)
    assert got["False"]["moved"] == [], got
