"""Where NeMo-RL's Ray workers get their Python, and how nemo_jetrl stays in it.

NeMo-RL (``nemo_rl/utils/venvs.py``) builds one venv per actor class under ``$NEMO_RL_VENV_DIR``
(default ``<NeMo-RL git root>/venvs``, not the working directory) and reuses an existing one;
``NRL_FORCE_REBUILD_VENVS=true`` makes it ``shutil.rmtree`` each venv and ``uv sync`` it afresh
from NeMo-RL's own project, which drops nemo_jetrl (our worker class, our vLLM plugin).

What the launch does about it (driver process, before Ray starts):

- our policy worker runs on the stock Megatron worker's venv *by its python path* when that venv
  is built (no symlink for NeMo-RL to trip over), else on the venv NeMo-RL built for our class
  name in an earlier launch (bare metal), by path; the vLLM workers' venv is the sync or the
  async worker's, as ``vllm_cfg.async_engine`` picks;
- with the rebuild flag on, or when NeMo-RL will build a venv during the run (bare metal, first
  run), that venv has no nemo_jetrl, so the launch writes
  an overlay (a directory with a link to this nemo_jetrl and its entry-point metadata) next to
  the venvs and puts it on the workers' ``PYTHONPATH`` (Megatron workers and vLLM workers, whose
  engine subprocesses inherit it): rebuilt venvs import nemo_jetrl and load our vLLM plugin.
  A stale link left by an older image at our class's venv name is removed (NeMo-RL's rmtree
  raises OSError on a link).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FORCE_REBUILD_ENV = "NRL_FORCE_REBUILD_VENVS"
# NeMo-RL's vLLM worker classes (vllm_generation.py picks by vllm_cfg.async_engine): each venv
# is named after its class.
VLLM_WORKER = "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker"
VLLM_ASYNC_WORKER = "nemo_rl.models.generation.vllm.vllm_worker_async.VllmAsyncGenerationWorker"
OVERLAY_NAME = "nemo_jetrl_overlay"


def force_rebuild(environ: Mapping[str, str] | None = None) -> bool:
    """NeMo-RL's own test of the flag (``venvs.create_local_venv_on_each_node``)."""
    env = os.environ if environ is None else environ
    return env.get(FORCE_REBUILD_ENV, "false").lower() == "true"


def nemo_rl_git_root() -> Path | None:
    """NeMo-RL's checkout (the directory above the ``nemo_rl`` package), found without importing it."""
    try:
        spec = importlib.util.find_spec("nemo_rl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def venv_dir(environ: Mapping[str, str] | None = None, git_root: Path | None = None) -> Path:
    """``$NEMO_RL_VENV_DIR``, else NeMo-RL's ``DEFAULT_VENV_DIR`` (``<git root>/venvs``)."""
    env = os.environ if environ is None else environ
    if env.get("NEMO_RL_VENV_DIR"):
        return Path(os.path.normpath(env["NEMO_RL_VENV_DIR"]))
    root = git_root or nemo_rl_git_root()
    if root is None:
        raise RuntimeError("NeMo-RL is not importable: cannot place its venvs")
    return root / "venvs"


def venv_python(base: Path, actor_fqn: str) -> Path:
    return base / actor_fqn / "bin" / "python"


def vllm_worker_fqn(cfg: Mapping[str, Any]) -> str:
    """The vLLM worker class NeMo-RL starts for ``cfg`` (whose venv the workers run in)."""
    vllm_cfg = ((cfg.get("policy") or {}).get("generation") or {}).get("vllm_cfg") or {}
    return VLLM_ASYNC_WORKER if vllm_cfg.get("async_engine") else VLLM_WORKER


def policy_worker_entry(
    stock_entry: str, stock_fqn: str, base: Path, rebuild: bool, our_fqn: str
) -> tuple[str, str, Path]:
    """(registry entry for our worker class, log line, the Python the workers will run).

    Without a rebuild: the stock worker's built venv by path, else the venv NeMo-RL built for
    our class name in an earlier launch (bare metal: NeMo-RL names a venv after the class it
    starts), by path. Else the stock entry itself (a ``uv run ...`` line): NeMo-RL builds the
    venv for our class name during this run.
    """
    ours = venv_python(base, our_fqn)
    if not stock_entry.startswith("uv"):
        return stock_entry, f"policy worker python: {stock_entry}", Path(stock_entry)
    py = venv_python(base, stock_fqn)
    if py.is_file() and not rebuild:
        return str(py), f"policy worker python: {py} (NeMo-RL's Megatron worker venv)", py
    if ours.is_file() and not (base / our_fqn).is_symlink() and not rebuild:
        line = f"policy worker python: {ours} (built by NeMo-RL for our worker class earlier)"
        return str(ours), line, ours
    why = f"{FORCE_REBUILD_ENV}=true" if rebuild else f"{py} not built yet"
    line = f"policy worker venv built by NeMo-RL ({why}) as {ours.parent.parent}: {stock_entry}"
    return stock_entry, line, ours


def remove_stale_link(base: Path, our_fqn: str) -> str | None:
    """An older image linked our class's venv name to the stock venv; NeMo-RL's forced rebuild
    rmtree's it and fails on a link. Remove the link (never a real venv)."""
    p = base / our_fqn
    if p.is_symlink():
        p.unlink()
        return f"removed {p} (a link NeMo-RL's {FORCE_REBUILD_ENV} rebuild cannot remove)"
    return None


def write_overlay(target: Path, dist_name: str = "nemo_jetrl", package: str = "nemo_jetrl") -> Path:
    """A directory importable from ``PYTHONPATH`` that holds this nemo_jetrl and its metadata.

    ``<target>/nemo_jetrl`` links to the package the driver imports; ``<target>/<dist>.dist-info``
    copies its METADATA and ``entry_points.txt`` so ``importlib.metadata`` (vLLM's plugin loader)
    finds our ``vllm.general_plugins`` entry. Rewritten on every launch (idempotent).
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"{dist_name} is importable but not installed (no metadata): install it "
            "(pip install --no-deps -e .) so its vLLM plugin entry point can be carried to the "
            "workers"
        ) from None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not importable")
    pkg_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    target.mkdir(parents=True, exist_ok=True)
    link = target / package
    if link.is_symlink() or link.exists():
        if link.is_symlink() and Path(os.readlink(link)) == pkg_dir:
            pass
        else:
            link.unlink()
            link.symlink_to(pkg_dir, target_is_directory=True)
    else:
        link.symlink_to(pkg_dir, target_is_directory=True)
    info = target / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.dist-info"
    for old in target.glob("*.dist-info"):
        if old != info:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist.metadata['Name']}\nVersion: {dist.version}\n"
    )
    (info / "entry_points.txt").write_text(dist.read_text("entry_points.txt") or "")
    return target


def has_nemo_jetrl(python: Path) -> bool:
    """Whether the venv whose interpreter is ``python`` has nemo_jetrl installed (its
    ``dist-info`` in site-packages, as pip writes for a plain or an editable install)."""
    return any(python.parent.parent.glob("lib/python*/site-packages/nemo_jetrl-*.dist-info"))


def with_pythonpath(env_vars: Mapping[str, str], entry: Path) -> dict[str, str]:
    """``env_vars`` with ``entry`` first on ``PYTHONPATH`` (the config's value, else the driver's)."""
    out = dict(env_vars)
    rest = out.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [str(entry)] + [p for p in rest.split(os.pathsep) if p and p != str(entry)]
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out
