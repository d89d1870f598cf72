"""`jetrl train CONFIG [overrides...] [--backend auto|local|nemo-rl] [--resume]`.

Runs a GRPO config. ``--backend local`` runs the embedded CPU backend in this process
(`nemo_jetrl.backends.local`); ``nemo-rl`` hands the same config to NeMo-RL on a GPU cluster
(`nemo_jetrl.backends.nemo_rl.launch`); ``auto`` (default) picks nemo-rl when NeMo-RL's GRPO imports
and local otherwise. Overrides are NeMo-RL/Hydra style ``key=value`` (``+key=value`` adds a key).
"""

from __future__ import annotations

import argparse

NAME = "train"
HELP = "Run GRPO from a NeMo-RL-shaped config (local CPU backend or NeMo-RL)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="NeMo-RL-shaped YAML config")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # optional: without a default argparse lists it as required
        metavar="KEY=VALUE",
        help="config overrides (Hydra style)",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "local", "nemo-rl"),
        default="auto",
        help="where to run: auto (nemo-rl if NeMo-RL is importable, else local), local, nemo-rl",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="local backend: continue from the latest checkpoint in checkpointing.checkpoint_dir",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--device",
        metavar="DEV",
        default=None,
        help="local backend: cpu, cuda or cuda:N (sets jetrl.local.device; default: the config's, "
        "else cpu)",
    )


def device_overrides(args: argparse.Namespace) -> list[str]:
    """The config overrides with ``--device`` as ``jetrl.local.device`` (last, so it wins)."""
    extra = [_device_override(args.device)] if args.device else []
    return [*args.overrides, *extra]


def _device_override(device: str) -> str:
    return f"++jetrl.local.device={device}"


def name_device_flag(issues: list, device: str | None) -> list:
    """``issues`` with the flag the user typed named where the validator names the override
    ``--device`` became (``(set by override '++jetrl.local.device=gpu')``: no such override was
    typed): ``(set by --device gpu)``."""
    from dataclasses import replace

    if not device:
        return list(issues)
    said = f" (set by override {_device_override(device)!r})"  # config's `_name_overrides`
    return [
        replace(i, message=i.message.removesuffix(said) + f" (set by --device {device})")
        if i.message.endswith(said)
        else i
        for i in issues
    ]


def requested_device_issues(args: argparse.Namespace, issues: list) -> list:
    """The problem this machine has with the requested device (``--device``, else the config's
    ``jetrl.local.device``), to report beside the config's other errors (``issues``) when the
    validator failed (`resolve_run` reports it when the config is otherwise valid). A malformed
    ``--device`` the validator did not reach (the file is missing) is named here."""
    from nemo_jetrl.backends.local.config import is_device_name
    from nemo_jetrl.backends.local.device import KEY, device_issues, malformed_flag
    from nemo_jetrl.config import ConfigIssue, load_config, settings_of

    device = args.device
    if device is not None and not is_device_name(device):
        return (
            [] if any(i.path == KEY for i in issues) else [ConfigIssue(KEY, malformed_flag(device))]
        )
    if device is None:
        try:  # the config as given; an unreadable one has no device to add
            device = settings_of(load_config(args.config, list(args.overrides))).local.device
        except Exception:  # unreadable YAML, a bad override: the validator names them
            return []
    ok = isinstance(device, str) and is_device_name(device)
    return device_issues(device) if ok else []


def requested_engine_issues(args: argparse.Namespace) -> list:
    """The problem this environment has with the config's ``jetrl.local.rollout_engine`` (vLLM
    not importable), to report beside the config's other errors when the validator failed
    (`resolve_run` reports it when the config is otherwise valid)."""
    from nemo_jetrl.config.load import value_as_given

    engine = value_as_given(args.config, list(args.overrides), "jetrl.local.rollout_engine")
    if engine != "vllm":  # an unreadable config has no engine to add: the validator names it
        return []
    from nemo_jetrl.backends.local.vllm_rollout import vllm_importable

    return vllm_importable()


def _not_a_local_config(checked) -> str:
    """Why ``checked`` is not a local-backend config ("" when it is): its ``policy.model_name``
    is not the local configs' and no ``jetrl.local.model_config`` says what to build (the local
    backend trains that model, by default its 2-layer Llama, whatever the name says)."""
    from nemo_jetrl.config.jetrl_model import LOCAL_MODEL_NAME

    model = checked.settings.model
    if model.local_config or model.name in (None, LOCAL_MODEL_NAME):
        return ""
    return f"the config names policy.model_name={model.name} and no jetrl.local.model_config"


def pick_backend(requested: str) -> str:
    """``auto`` -> ``nemo-rl`` when NeMo-RL's GRPO entry point imports, else ``local``."""
    if requested != "auto":
        return requested
    from nemo_jetrl._optional import available

    return "nemo-rl" if available("nemo_rl.algorithms.grpo") else "local"


def _run_nemo_rl(args: argparse.Namespace) -> int:
    from nemo_jetrl.errors import UserError

    try:
        from nemo_jetrl.backends.nemo_rl.launch import run_nemo_rl
    except ImportError as exc:
        raise UserError(
            f"the nemo-rl backend is not available in this install ({exc}); "
            "use --backend local, or run inside the Docker image (docs/cluster.md)"
        ) from None
    if args.device:
        raise UserError(
            "--device is the local backend's (jetrl.local.device); NeMo-RL places its workers "
            "itself (cluster.gpus_per_node): drop --device or use --backend local"
        )
    if args.resume:
        print("note: --resume is handled by NeMo-RL's own checkpointing (checkpointing.*)")
    return int(run_nemo_rl(args.config, list(args.overrides)) or 0)


def _run_local(args: argparse.Namespace) -> int:
    from nemo_jetrl.backends.local.loop import run_local
    from nemo_jetrl.backends.local.setup import resolve_run
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import MissingDependencyError, UserError
    from nemo_jetrl.flow.pipeline import check_config, off_policy_refusal, run_notes

    try:
        # The one validation (every key, every problem at once), before any work starts.
        try:
            checked = check_config(args.config, device_overrides(args), run=True)
        except ConfigError as exc:  # a missing GPU or vLLM is named with the other errors
            more = [*requested_device_issues(args, exc.issues), *requested_engine_issues(args)]
            issues = [*name_device_flag(exc.issues, args.device), *more]
            raise ConfigError(issues, exc.source) from None
        not_local = _not_a_local_config(checked)
        if not_local and args.backend == "auto":  # a cluster config on a machine without NeMo-RL
            raise UserError(
                f"--backend auto picked the local backend (NeMo-RL's GRPO does not import "
                f"here), but {not_local}: it would train its own small model on this machine. "
                "Install NeMo-RL for --backend nemo-rl (docs/cluster.md), or pass --backend "
                "local to run the local backend anyway"
            )
        if not_local:
            print(f"note: {not_local}: the local backend trains its own small model")
        local = next(b for b in checked.backends if b.backend == "local")
        if not local.runs:  # an MoE family it does not run: refused before any work
            raise UserError(
                f"{checked.settings.model.chosen_by}: the local backend does not run this model: "
                f"{local.reason}. Set jetrl.local.model_config to a Qwen3-MoE, Mixtral or dense "
                "config.json, or run it with --backend nemo-rl"
            )
        # What only a local run needs (e.g. the vLLM engine), read once: the run gets it.
        resolved = resolve_run(checked.cfg, recipe=checked.recipe)
        refusal = off_policy_refusal(checked, backend="local")
        if refusal:
            raise UserError(refusal)
        for note in run_notes(checked):
            print(f"note: {note}")
        result = run_local(resolved, resume=args.resume, progress=not args.no_progress)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    except (MissingDependencyError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from None
    last = result.history[-1] if result.history else {}
    print(
        f"{result.recipe}: steps {result.first_step}..{result.last_step} in "
        f"{result.seconds:.1f}s; logs in {result.log_dir}"
        + (
            f"; last reward {last['train/reward']:.3f}, token_mult_prob_error "
            f"{last['train/token_mult_prob_error']:.6f}"
            if last
            else ""
        )
    )
    return 0


def run(args: argparse.Namespace) -> int:
    backend = pick_backend(args.backend)
    if backend == "nemo-rl":
        return _run_nemo_rl(args)
    return _run_local(args)
