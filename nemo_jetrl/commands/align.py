"""`jetrl align CONFIG [overrides...] -o OUT.yaml`: derive the rollout from training, then check.

Training is the source of truth: the rollout runs FP8 exactly where training does, with the same
scale modes and BF16 layers, through this package's vLLM patch; an FP8 KV cache is kept with
on-policy KV (or dropped with ``--kv bf16``). ``--recipe NAME`` writes a preset's keys instead.
The output is the full merged config (``${...}`` interpolations kept); it is checked like
`jetrl check` and the exit code is the check's.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

NAME = "align"
HELP = "write a config whose rollout settings follow the training settings, then check it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from nemo_jetrl.recipe import PRESET_NAMES

    parser.add_argument("config", help="NeMo-RL-shaped YAML")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="key=value, +key=value, ++key=value, ~key"
    )
    parser.add_argument("-o", "--output", required=True, help="where to write the aligned YAML")
    parser.add_argument(
        "--kv",
        choices=("onpolicy", "bf16"),
        default=None,
        help="keep an FP8 KV cache with on-policy KV (default; where training runs FP8 linears) "
        "or drop it to BF16; not with --recipe, whose preset says",
    )
    parser.add_argument(
        "--recipe", choices=PRESET_NAMES, default=None, help="write this preset's keys instead"
    )
    parser.add_argument(
        "--as-child",
        action="store_true",
        help="write a small file that inherits CONFIG through defaults: and holds only the "
        "overrides and the changed keys",
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")


LAYOUT_NOTE = (
    "go BF16 on both sides: in NeMo-RL's Megatron training, TE's 128x128 FP8 blocks of these "
    "linears are not the rollout's (a fused linear_qkv with a head dim off 128, the gated "
    "delta net's one in_proj GEMM of several HF weights, or tensor-parallel shards cutting "
    "blocks; docs/megatron.md)"
)
LAYOUT_UNSETTLED = (
    "routed or shared experts' Megatron training blocks are not the rollout's and cannot be kept "
    "BF16 by name: choose policy.megatron_cfg.expert_tensor_parallel_size (or "
    "tensor_model_parallel_size) so each rank's rows are a multiple of 128 (the verdict below "
    "names them)"
)


def run(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from nemo_jetrl.arch.linear import VISION_WORD
    from nemo_jetrl.commands._align_moe import load_source, moe_align_updates, router_bf16_words
    from nemo_jetrl.commands._align_unaligned import in_proj_note, unaligned_target_words
    from nemo_jetrl.commands.check import report
    from nemo_jetrl.config import (
        merge_updates,
        minimal_updates,
        nemo_rl_setup_updates,
        recipe_to_config_updates,
    )
    from nemo_jetrl.config.layer_lists import shared_bf16_words
    from nemo_jetrl.config.schema import FP8_PARAM
    from nemo_jetrl.errors import UserError, together
    from nemo_jetrl.flow.megatron_layout import megatron_block_words
    from nemo_jetrl.flow.mxfp8 import align_notes
    from nemo_jetrl.flow.vllm_bf16 import vllm_bf16_words
    from nemo_jetrl.recipe import Recipe, matching_preset

    out = Path(args.output)
    flagged = _flag_problems(args, out)  # before any work; -o is created when written
    overrides, mirrored, untiled, untiled_notes = list(args.overrides), None, [], []
    try:
        before = load_source(args.config, overrides)  # cfg + recipe; checked below
    except UserError as exc:
        # Align keeps the rollout's per-name BF16 list in training too: an input refused only
        # because training runs those linears in FP8 (Qwen3.5's 32-row in_proj_a/b) aligns.
        mirrored = _mirrored_bf16_list(args.config, overrides)
        # Linears no 128x128 block tiles (Moonlight's 576-row kv_a_proj_with_mqa) go BF16 by
        # name on both sides (`_align_unaligned`).
        untiled, untiled_notes = _untiled_list_overrides(args.config, overrides)
        retry = untiled or ([mirrored] if mirrored else [])
        try:
            before = load_source(args.config, [*overrides, *retry]) if retry else None
        except UserError:
            before = None
        if before is None:  # the flags' problems and the config's, together
            raise together([*flagged, str(exc)], "nothing written") if flagged else exc from None
        mirrored = None if untiled else mirrored
        overrides += retry
    if flagged:
        raise together(flagged, "nothing written")
    if args.recipe:
        target = Recipe.preset(args.recipe)
    else:
        try:
            target = before.recipe.aligned_to_training(kv=args.kv or "onpolicy")
        except ValueError as exc:
            raise UserError(f"cannot align {args.config}: {exc}") from None
    # The user's per-name BF16 linears stay BF16, now on both sides; a word keeping part of
    # Megatron's fused in_proj becomes the whole in_proj (the only list training can honour).
    kws = before.recipe.bf16_layer_kws()
    whole = shared_bf16_words(before.arch, before.recipe)  # what the check's list fixes name
    if whole != kws:
        untiled_notes = [*untiled_notes, in_proj_note(kws, whole)]
        kws = whole
    vision = before.arch is not None and before.arch.vision is not None
    if vision and target.rollout.fp8_linears and VISION_WORD not in kws:
        kws = (*kws, VISION_WORD)  # vLLM quantizes the tower unless named; training keeps it BF16
    router_words, router_notes = router_bf16_words(before.arch, target, kws)  # vLLM FP8 router
    tile_words, tile_notes = unaligned_target_words(before.arch, target, kws + router_words)
    tile_notes = untiled_notes or tile_notes  # the words added to the input, said once
    target = target.with_bf16_layer_kws(kws + router_words + tile_words)
    vllm_words, vllm_notes = vllm_bf16_words(before.arch, target)  # MLA decode's kv_b_proj
    if vllm_words:
        target = target.with_bf16_layer_kws(kws + router_words + tile_words + vllm_words)
    layout_words, settled = megatron_block_words(before.arch, before.settings, target)
    layout_words = tuple(w for w in layout_words if w not in target.train.bf16_layer_kws)
    if layout_words:  # Megatron's training blocks of these are not the rollout's
        target = target.with_bf16_layer_kws((*target.train.bf16_layer_kws, *layout_words))
        vllm_notes = [*vllm_notes, f"{list(layout_words)} {LAYOUT_NOTE}"]
    if not settled:
        vllm_notes = [*vllm_notes, LAYOUT_UNSETTLED]
    fp8_param_note = []
    if target.train.fp8_param and target.train.bf16_layer_kws:  # check_layer_lists' rule
        target = target.with_(train=target.train.with_(fp8_param=False))
        target = target.with_(name=matching_preset(target) or "custom")
        fp8_param_note = [
            f"{FP8_PARAM} goes false: training keeps {list(target.train.bf16_layer_kws)} BF16, "
            "which TE cannot do with FP8 primary weights (training stays FP8: TE quantizes the "
            "BF16 weights in every forward, as the rollout does)"
        ]
    if before.recipe.unaligned_layers_bf16 and not target.unaligned_layers_bf16:  # so do these
        target = target.with_(unaligned_layers_bf16=True)
        target = target.with_(name=matching_preset(target) or "custom")
    updates = minimal_updates(before.cfg, recipe_to_config_updates(target))
    updates.update(nemo_rl_setup_updates(before.cfg, target))  # so NeMo-RL's setup accepts it
    moe_updates, moe_notes = moe_align_updates(before.settings)  # MoE: routing replay, dropless
    moe_notes += router_notes + tile_notes + vllm_notes + fp8_param_note
    if before.recipe.kv_fp8 and not target.kv_fp8 and args.kv != "bf16" and not args.recipe:
        moe_notes.append(  # on-policy KV fake-quantizes in the trainer's FP8 forward only
            "the input's FP8 KV cache goes BF16: this config trains in BF16, and an FP8 KV cache "
            "is kept on-policy only beside FP8 training linears; --recipe jetrl_kv writes FP8 "
            "training with on-policy KV instead"
        )
    if target.train.fp8_linears and before.settings.megatron_off:
        moe_notes.append(
            "align writes the recipe's training FP8 keys but cannot change the training policy: "
            "NeMo-RL's DTensor policy (policy.megatron_cfg.enabled=false) ignores fp8_cfg and "
            "trains BF16, so this file is off-policy on NeMo-RL (per backend below)"
            + ("; without --recipe align follows that BF16 training" if args.recipe else "")
        )
    updates.update(moe_updates)
    cfg = merge_updates(before.cfg, updates)
    origin = "preset " + args.recipe if args.recipe else "rollout derived from training"
    header = (
        f"# Written by `jetrl align` from {args.config}"
        + (f" with overrides {' '.join(overrides)}" if overrides else "")
        + f"\n# recipe: {target.name} ({origin})\n"
    )
    if args.as_child:
        text = OmegaConf.to_yaml(_child(Path(args.config), out, overrides, updates))
    else:
        text = OmegaConf.to_yaml(cfg)
    after = _write_checked(out, header + text)
    changed = _changed_keys(before.cfg, cfg)
    print(f"wrote {out} (recipe {target.name})", file=sys.stdout)
    if mirrored:
        print(
            f"  {mirrored}: the input keeps these linears BF16 in the rollout only and is "
            "invalid as given (training would run them in FP8); align keeps them BF16 in "
            "training too",
            file=sys.stdout,
        )
    if untiled:
        print(
            f"  {' '.join(untiled)}: the input's per-name BF16 lists are invalid as given (a part "
            "of a fused GEMM, or linears FP8 cannot run: notes below); align writes lists both "
            "sides honour",
            file=sys.stdout,
        )
    for key, old, new in changed:
        print(f"  {key}: {old!r} -> {new!r}", file=sys.stdout)
    if not changed:
        print("  (no key changed)", file=sys.stdout)
    notes = align_notes(before.recipe, target)
    if notes:
        print("what changes (MXFP8 rollout, off-policy by construction):", file=sys.stdout)
        for line in notes:
            print(f"  - {line}", file=sys.stdout)
    for line in moe_notes:
        print(f"note: {line}", file=sys.stdout)
    print(file=sys.stdout)
    return report(after, str(out), sys.stdout)


def _flag_problems(args: argparse.Namespace, out: Path) -> list[str]:
    """What is wrong with the flags (``-o``, ``--recipe`` with ``--kv``), all of it; the output
    path's first problem only (the later ones follow from it)."""
    from nemo_jetrl.commands._output import check_output_dir
    from nemo_jetrl.errors import UserError

    found = []
    if args.recipe and args.kv:
        found.append(
            f"--kv {args.kv} with --recipe {args.recipe}: the preset says what the KV cache is "
            "(jetrl_kv: FP8 with on-policy KV; the others BF16); drop one of them"
        )

    def output() -> None:
        if out.is_dir():
            raise UserError(f"-o {out} is a directory; give the file to write")
        _refuse_input_file(out, args.config)  # before --force: it would overwrite what it reads
        if out.exists() and not args.force:
            raise UserError(f"{out} exists; pass --force to overwrite it")
        check_output_dir(out.parent, "-o", for_file=out)

    try:
        output()
    except UserError as exc:
        found.append(str(exc))
    return found


def _refuse_input_file(out: Path, config: str) -> None:
    """``-o`` must not name CONFIG or a file of its ``defaults:`` chain (paths resolved,
    symlinks followed): overwriting a parent breaks every config inheriting it."""
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.config.load import config_files  # the loader's own walk of defaults:
    from nemo_jetrl.errors import UserError

    try:
        chain = config_files(config)
    except ConfigError:  # the config's own errors are what the user sees (nothing is written)
        chain = [Path(config).resolve()]
    target = out.resolve()
    if target == Path(config).resolve():
        raise UserError(f"-o {out} is the input file; write the aligned config elsewhere")
    if target in chain:
        raise UserError(
            f"-o {out} is {target}, a file of {config}'s defaults: chain; writing it would change "
            "every config inheriting it: write the aligned config elsewhere"
        )


def _write_checked(out: Path, text: str):
    """Write ``text`` to a temporary file beside ``out`` (its ``defaults:`` resolve the same),
    check it as `jetrl check`, then rename it to ``out``: an invalid result (exit 2) replaces
    nothing and leaves nothing, not even the directories made for it. Returns the check."""
    import os
    import tempfile

    from nemo_jetrl.commands._output import make_output_dir
    from nemo_jetrl.commands.check import load_and_check
    from nemo_jetrl.errors import UserError

    made = out.parent
    while not made.parent.exists():
        made = made.parent  # the top directory this call creates (when one is missing)
    made = None if made.exists() else made
    make_output_dir(out.parent, "-o", for_file=out)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".yaml", dir=out.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            after = load_and_check(str(tmp), [])
        except UserError as exc:  # said of OUT, which is what the user named
            msg = str(exc).replace(str(tmp.resolve()), str(out)).replace(str(tmp), str(out))
            raise UserError(f"{msg}\n(nothing written to {out})") from None
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
        if made is not None and not out.exists():
            for d in [out.parent, *out.parent.parents]:
                if d == made.parent:
                    break
                with contextlib.suppress(OSError):
                    d.rmdir()  # only empty ones: what this call made
    return after


def _mirrored_bf16_list(config: str, overrides: list[str]) -> str | None:
    """``+jetrl.train_bf16_layer_kws=[...]`` copying the rollout's per-name BF16 list when the
    training side has none, else None."""
    from omegaconf import OmegaConf

    from nemo_jetrl.config import load_config
    from nemo_jetrl.config.layer_lists import ROLLOUT_KEY, TRAIN_KEY

    try:
        cfg = load_config(config, overrides)
        kws = OmegaConf.select(cfg, ROLLOUT_KEY, default=None)
        has_train = OmegaConf.select(cfg, TRAIN_KEY, default=None) is not None
    except Exception:  # the config's own errors are what the user sees
        return None
    if has_train or not kws or not all(isinstance(k, str) for k in kws):
        return None
    return f"+{TRAIN_KEY}=[{','.join(kws)}]"


def _untiled_list_overrides(config: str, overrides: list[str]) -> tuple[list[str], list[str]]:
    """`_align_unaligned.unaligned_list_overrides` of the input as loaded; nothing when it
    cannot be read (its own errors are what the user sees)."""
    from nemo_jetrl.commands._align_unaligned import unaligned_list_overrides
    from nemo_jetrl.config import load_config, settings_of
    from nemo_jetrl.config.reader import arch_from_config

    try:
        cfg = load_config(config, overrides)
        return unaligned_list_overrides(settings_of(cfg), arch_from_config(cfg))
    except Exception:  # the config's own errors are what the user sees
        return [], []


def _child(parent: Path, out: Path, overrides: list[str], updates: dict):
    """`defaults: <parent relative to out>` + the overrides + the updates."""
    import os

    from omegaconf import OmegaConf

    from nemo_jetrl.config import merge_updates, parse_override
    from nemo_jetrl.errors import UserError

    rel = os.path.relpath(parent.resolve(), out.resolve().parent)
    if rel.startswith(os.path.join("..", "..", "..")):
        rel = str(parent.resolve())  # far apart: an absolute path reads better
    flat: dict = {}
    for text in overrides:
        op, key, value = parse_override(text)
        if op == "delete":
            raise UserError(f"--as-child cannot express the deletion {text!r}; drop --as-child")
        flat[key] = value
    flat.update(updates)
    return merge_updates(OmegaConf.create({"defaults": rel}), flat)


def _changed_keys(a, b, prefix: str = "") -> list[tuple[str, object, object]]:
    """Leaf keys whose resolved value differs between two configs."""
    from omegaconf import DictConfig, OmegaConf

    da = OmegaConf.to_container(a, resolve=True) if isinstance(a, DictConfig) else a
    db = OmegaConf.to_container(b, resolve=True) if isinstance(b, DictConfig) else b
    out: list[tuple[str, object, object]] = []

    def walk(x, y, p):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in dict.fromkeys([*x, *y]):
                walk(x.get(k, "<unset>"), y.get(k, "<unset>"), f"{p}{k}.")
        elif x != y:
            out.append((p[:-1], x, y))

    walk(da, db, prefix)
    return out
