"""The local rollout's decode steps read no device value on the host (`rollout.generate`).

Every host read of a tensor's value is a device sync on a GPU: the host waits for every queued
kernel, so it cannot launch the next step while the device works. Counted here on CPU tensors,
at the dispatcher (``_local_scalar_dense`` is what ``int()``/``bool()``/``.item()`` of a tensor
run; ``nonzero``, ``equal``, boolean-mask indexing and ``repeat_interleave`` without
``output_size`` read values to size their output) and at the Python level (``.tolist()``,
``.numpy()`` and ``.cpu()`` of a CPU tensor dispatch no op).

The rollout model runs its CUDA code path where that differs: the FP8 layers defer their
non-finite check to a device flag (`finite_flags.sync_free`), and the CPU reference GEMM
(`fp8.gemm.blockwise_matmul`, which reads the scales to pick its exact path; a GPU runs the
planned GEMM kernels instead, checked by the ``gpu`` tests) is not counted.

Bound: one read per ``stop_check_every`` decode steps (the "every row finished" check) and
none elsewhere, so with ``stop_check_every`` >= ``max_new_tokens`` one read per call whatever
the number of steps. Before this change each decode step read twice (``done.all()`` and the
rotary table's largest position): 8 reads at 4 tokens, 24 at 12.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from local_configs import tiny_cfg

from nemo_jetrl.backends.local.loop import LocalRun, resolve_run
from nemo_jetrl.backends.local.refit import export_weights, refit
from nemo_jetrl.backends.local.rollout import RolloutBatch, generate
from nemo_jetrl.fp8 import finite_flags

RECIPES = ("bf16", "jetrl", "jetrl_kv")
_READ_OPS = frozenset(
    {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}
    | {"aten::nonzero", "aten::masked_select"}
)
_INDEX_OPS = frozenset({"aten::index", "aten::index_put_", "aten::_index_put_impl_"})
_HOST_METHODS = frozenset({"tolist", "numpy", "cpu"})


class _ReadCounter(TorchDispatchMode):
    """Counts the dispatched ops that read tensor values on the host (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = func._schema.name
        if not self.paused:
            masked = name in _INDEX_OPS and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in args[1]
            )
            sized = (
                name == "aten::repeat_interleave"
                and func._overloadname in ("Tensor", "self_Tensor")
                and kwargs.get("output_size") is None
            )
            if name in _READ_OPS or masked or sized:
                self.reads.append(name)
        return func(*args, **kwargs)


class _MethodCounter(TorchFunctionMode):
    """Counts ``.tolist()``/``.numpy()``/``.cpu()``: on CPU tensors they dispatch nothing."""

    def __init__(self, dispatch: _ReadCounter) -> None:
        super().__init__()
        self.dispatch = dispatch

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in _HOST_METHODS and not self.dispatch.paused:
            self.dispatch.reads.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module", params=RECIPES)
def run(request, tmp_path_factory) -> LocalRun:
    tmp = tmp_path_factory.mktemp(f"syncs_{request.param}")
    cfg = tiny_cfg(request.param, tmp / "log", tmp / "cache", "jetrl.local.warmstart.steps=0")
    r = LocalRun(resolve_run(cfg))
    refit(r.rollout_model, export_weights(r.trainer.model))
    return r


@pytest.fixture
def cuda_path(monkeypatch) -> Iterator[None]:
    """The FP8 layers' CUDA path where it differs from CPU (see the module docstring)."""
    monkeypatch.setattr(finite_flags, "sync_free", lambda t: True)
    yield
    finite_flags.check_non_finite()  # read (and clear) the deferred flags: all finite


@contextmanager
def _counting(monkeypatch) -> Iterator[_ReadCounter]:
    import nemo_jetrl.fp8.linear as fp8_linear

    counter = _ReadCounter()
    reference = fp8_linear.blockwise_matmul

    def uncounted_reference(*args, **kwargs):  # CPU only: a GPU runs the planned GEMM
        counter.paused = True
        try:
            return reference(*args, **kwargs)
        finally:
            counter.paused = False

    monkeypatch.setattr(fp8_linear, "blockwise_matmul", uncounted_reference)
    with _MethodCounter(counter), counter:
        yield counter


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(3, 19, (rows, 6), generator=torch.Generator().manual_seed(0))


def _generate(run: LocalRun, prompts: torch.Tensor, n: int, seed: int, **kw) -> RolloutBatch:
    kw.setdefault("eos_id", run.tokenizer.eos_token_id)
    return generate(
        run.rollout_model, prompts, max_new_tokens=n, temperature=1.0,
        pad_id=run.tokenizer.pad_token_id, generator=torch.Generator().manual_seed(seed),
        cache_factory=run._cache_factory(), **kw,
    )  # fmt: skip


def test_decode_steps_read_nothing_on_the_host(run, cuda_path, monkeypatch):
    counts = {}
    for n in (4, 12):
        with _counting(monkeypatch) as counter:
            rb = _generate(run, _prompts(4), n, seed=5, stop_check_every=16)
        assert rb.response_ids.shape[1] <= n
        counts[n] = counter.reads
    # one read per call (the final "every row finished" check), whatever the step count
    assert counts[4] == counts[12] == ["aten::_local_scalar_dense"], counts


def test_stop_checks_read_once_per_stop_check_every_steps(run, cuda_path, monkeypatch):
    # random weights: no row emits <eos> in 12 steps, so every check runs (steps 4, 8, 12)
    with _counting(monkeypatch) as counter:
        rb = _generate(run, _prompts(4), 12, seed=5, stop_check_every=4)
    assert rb.response_ids.shape[1] == 12
    assert counter.reads == ["aten::_local_scalar_dense"] * 3


def test_check_cadence_changes_no_bit_and_no_later_draw(run):
    """Steps run past the last row's <eos> (between two checks) are trimmed and their draws
    undone: the batch and the generator's state after it are those of a check every step."""
    stopped_early = 0
    for eos in range(run.rollout_model.config.vocab_size):
        outs = []
        for every in (1, 3, 16):
            g = torch.Generator().manual_seed(eos)
            rb = generate(
                run.rollout_model, _prompts(1), max_new_tokens=12, temperature=1.0, eos_id=eos,
                pad_id=run.tokenizer.pad_token_id, generator=g,
                cache_factory=run._cache_factory(), stop_check_every=every,
            )  # fmt: skip
            outs.append((rb, g.get_state()))
        (ref, ref_state), *rest = outs
        for rb, state in rest:
            assert torch.equal(rb.response_ids, ref.response_ids), eos
            assert torch.equal(rb.response_mask, ref.response_mask), eos
            assert torch.equal(rb.finished, ref.finished), eos
            assert torch.equal(
                rb.generation_logprobs.view(torch.int32), ref.generation_logprobs.view(torch.int32)
            ), eos
            assert torch.equal(state, ref_state), eos
        stopped_early += ref.response_ids.shape[1] < 12
        if stopped_early == 3:
            break
    assert stopped_early > 0  # the trimming and the undone draws were exercised


def test_positions_past_the_rotary_table_are_refused_once_up_front(run):
    size = run.rollout_model.config.max_position_embeddings
    if not any(type(m).__name__ == "RotaryTable" for m in run.rollout_model.modules()):
        pytest.skip("not a batch-invariant rollout model")
    with pytest.raises(ValueError, match=f"position {size} is past the rotary table"):
        _generate(run, _prompts(2), size - 4, seed=0)  # 6 prompt positions + size - 5 more
    # a forward outside generate still checks its own positions
    ids = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="past the rotary table"):
        run.rollout_model(input_ids=ids, position_ids=torch.tensor([[0, size]]))
