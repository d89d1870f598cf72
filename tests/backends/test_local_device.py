"""``jetrl.local.device`` / ``--device``: where a local run computes (issue 37).

On CPU: a CUDA device this machine lacks is refused with exit 2 before any work, beside the
config's other errors; a malformed name is a config error at the key; a short run with the
device passed explicitly through the same code path keeps every model tensor and every step
tensor on it and stays exactly on-policy (jetrl). The ``gpu``-marked test runs the same on CUDA
(jetrl and jetrl_kv); it is the only proof of the GPU path and skips without CUDA.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from local_configs import EXAMPLES, tiny_cfg

from nemo_jetrl.backends.local.config import LocalSettings, is_device_name
from nemo_jetrl.backends.local.device import device_issues
from nemo_jetrl.backends.local.loop import Hooks, resolve_run, run_local
from nemo_jetrl.config import ConfigError

# A GPU index no machine has: refused on a CPU box and on a GPU box alike.
ABSENT = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("jetrl_cache")


REPO = Path(__file__).resolve().parents[2]
_FACTORIES = {"zeros", "ones", "full", "empty", "arange", "eye", "linspace", "tensor", "as_tensor",
              "rand", "randn", "randint"}  # fmt: skip
# Tensors the local backend makes on the host on purpose, by (module, function): why.
HOST_SIDE = {
    ("backends/local/task.py", "sample_problems"): "problems are drawn on the CPU generator",
    ("backends/local/rollout.py", "device_draw"): "the device generator's seed: a host draw",
    ("backends/local/task.py", "encode_prompts"): "token ids; LocalRun moves prompts to the device",
    ("backends/local/task.py", "encode_targets"): "warm-start targets (the warm start is CPU)",
    ("backends/local/warmstart.py", "warmstart_targets"): "the warm start runs on the CPU",
    ("backends/local/step.py", "_rewards"): "rewards of host-scored texts; advantages are moved",
    ("backends/local/vllm_rollout.py", "generate"): "vLLM's answer on the host; step moves it",
    ("backends/local/vllm_moe.py", "routing_tensors"): "vLLM's routing on the host; step moves it",
}


def _host_factories() -> set[tuple[str, str]]:
    """(module, function) of every ``torch.<factory>(...)`` without ``device=`` in the local
    backend and the invariant ops (``*_like`` follow their input and are not listed)."""
    found = set()
    for sub in ("backends/local", "invariant"):
        for path in sorted((REPO / "nemo_jetrl" / sub).glob("*.py")):
            rel = path.relative_to(REPO / "nemo_jetrl").as_posix()
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, ast.FunctionDef):
                    continue
                for n in ast.walk(fn):
                    f = getattr(n, "func", None)
                    if (
                        isinstance(n, ast.Call)
                        and isinstance(f, ast.Attribute)
                        and f.attr in _FACTORIES
                        and isinstance(f.value, ast.Name)
                        and f.value.id == "torch"
                        and not any(k.arg == "device" for k in n.keywords)
                    ):
                        found.add((rel, fn.name))
    return found


def test_every_tensor_the_run_makes_takes_the_device():
    """Static: a factory call without ``device=`` on the run's path would put a host tensor
    beside CUDA ones (what a CPU run cannot show); only the listed host-side ones may."""
    found = _host_factories()
    assert found - set(HOST_SIDE) == set(), "make these on the run's device (or list why not)"
    assert set(HOST_SIDE) <= found  # the list stays current


def test_device_names_are_validated_at_the_key():
    for ok in ("cpu", "cuda", "cuda:0", "cuda:7", "cuda:12"):
        assert is_device_name(ok), ok
    for bad in ("gpu", "CUDA", "cuda:", "cuda:-1", "cuda:01", "cuda:x", "mps", " cpu", "cuda0"):
        assert not is_device_name(bad), bad
    assert LocalSettings.from_cfg({}).device == "cpu"
    with pytest.raises(ConfigError) as e:
        LocalSettings.from_cfg({"device": "gpu", "dtype": "fp16"})
    msg = str(e.value)  # both problems, one error
    assert "jetrl.local.device" in msg and "cuda:N" in msg and "jetrl.local.dtype" in msg


def test_absent_gpu_is_named_with_what_to_change():
    assert device_issues("cpu") == []
    (issue,) = device_issues(ABSENT)
    assert issue.path == "jetrl.local.device"
    assert ABSENT in issue.message and "--device cpu" in issue.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="plain 'cuda' exists on this machine")
def test_plain_cuda_refused_without_a_gpu():
    (issue,) = device_issues("cuda")
    assert "none visible" in issue.message and "jetrl.local.device: cpu" in issue.message


def _train_args(tmp_path: Path, cache_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        str(EXAMPLES / "jetrl.yaml"),
        "grpo.max_num_steps=1",
        "grpo.val_at_start=false",
        "jetrl.local.warmstart.steps=3",
        f"jetrl.local.cache_dir={cache_dir}",
        f"logger.log_dir={tmp_path / 'run'}",
        *extra,
        "--backend",
        "local",
        "--no-progress",
    ]


def test_train_refuses_absent_gpu_before_any_work(tmp_path, capsys):
    from nemo_jetrl.cli import main

    cache_dir = tmp_path / "cache"  # its own: empty unless a warm start ran
    cache_dir.mkdir()

    for how in (["--device", ABSENT], [f"jetrl.local.device={ABSENT}"]):
        assert main(_train_args(tmp_path, cache_dir, *how)) == 2
        err = capsys.readouterr().err
        assert "jetrl.local.device" in err and ABSENT in err and "--device cpu" in err, err
        assert "Traceback" not in err
        assert not (tmp_path / "run").exists()  # no log dir, no warm start: before any work
        assert not any(cache_dir.iterdir())
    # reported together with the config's other errors (flag and key alike)
    for how in (["--device", ABSENT], [f"jetrl.local.device={ABSENT}"]):
        bad = _train_args(tmp_path, cache_dir, "policy.generation.temperature=-1", *how)
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert "policy.generation.temperature" in err and "jetrl.local.device" in err, err
    assert main(_train_args(tmp_path, cache_dir, "--device", "gpu")) == 2
    assert "jetrl.local.device" in capsys.readouterr().err


def test_demo_refuses_absent_gpu_before_any_run(tmp_path, capsys):
    from nemo_jetrl.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--device", ABSENT, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and ABSENT in err and "jetrl.local.device" in err, err
    assert not (out / "runs").exists()
    assert main(["demo", "--out", str(out), "--device", "tpu", "--no-progress"]) == 2
    assert "cuda:N" in capsys.readouterr().err


def _run_on(device: str, recipe: str, tmp_path: Path, cache_dir: Path, *extra: str) -> list[dict]:
    """A 2-step run with ``jetrl.local.device`` set; asserts where its tensors live."""
    seen: dict = {}
    want = torch.device(device)

    def on_run(run) -> None:
        seen["run"] = run
        score = run.trainer.score

        def spy(ids, P):  # the scored batch: prompts + the rollout's responses
            seen.setdefault("ids", ids.device)
            out = score(ids, P)
            seen.setdefault("prev", out.device)
            return out

        run.trainer.score = spy

    cfg = tiny_cfg(recipe, tmp_path / recipe, cache_dir, f"jetrl.local.device={device}", *extra)
    res = run_local(resolve_run(cfg), progress=False, log=print, hooks=Hooks(on_run=on_run))
    run = seen["run"]
    assert run.device.type == want.type
    for model in (run.trainer.model, run.rollout_model):
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            assert t.device.type == want.type, (name, t.device)
    assert all(m.device.type == want.type for m in run.trainer.master)
    assert seen["ids"].type == want.type and seen["prev"].type == want.type
    return res.history


def _assert_on_policy(history: list[dict]) -> None:
    assert len(history) == 2
    for h in history:
        assert h["train/token_mult_prob_error"] == 1.0 and h["train/gen_kl_error"] == 0.0, h
        assert math.isfinite(h["train/loss"]) and h["jetrl/local/refit_refused"] == 0.0


def test_explicit_cpu_device_runs_the_same_path_exactly_on_policy(tmp_path, cache_dir):
    _assert_on_policy(_run_on("cpu", "jetrl", tmp_path, cache_dir))


# layer 0 kept BF16 on both sides: on CUDA its linears take the invariant matmul, not cuBLAS
BF16_LAYER0 = ("+jetrl.train_bf16_layer_kws=[layers.0.]",
               "+policy.generation.vllm_cfg.quantization_ignored_layer_kws=[layers.0.]")  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("recipe", "extra"), [("jetrl", ()), ("jetrl_kv", ()), ("jetrl", BF16_LAYER0), ("bf16", ())]
)
def test_cuda_run_exactly_on_policy(recipe, extra, tmp_path, cache_dir):
    _assert_on_policy(_run_on("cuda", recipe, tmp_path, cache_dir, *extra))


def test_a_run_makes_its_gpu_the_current_device(tmp_path, cache_dir, monkeypatch):
    """Our Triton kernels (and Triton's own launcher) launch on the *current* CUDA device and
    its stream: a run on ``cuda:1`` must make GPU 1 current, or every kernel launches on GPU 0
    with pointers into GPU 1's memory. FAKE of the CUDA runtime (no GPU here): set_device
    recorded, not called."""
    import nemo_jetrl.backends.local.setup as setup_mod
    from nemo_jetrl.backends.local.device import make_current

    make_current(torch.device("cuda"))  # the real set_device: "cuda" has no index to set
    made: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", made.append)
    make_current(torch.device("cuda:1"))
    make_current(torch.device("cuda"))
    make_current(torch.device("cpu"))
    assert made == [torch.device("cuda:1")]
    asked: list[torch.device] = []
    monkeypatch.setattr(setup_mod, "make_current", asked.append)
    run = setup_mod.LocalRun(resolve_run(tiny_cfg("jetrl", tmp_path, cache_dir)))
    run.close()
    assert asked == [torch.device("cpu")]  # LocalRun passes its device, whatever it is
