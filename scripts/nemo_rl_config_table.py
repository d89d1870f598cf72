"""Write docs/nemo_rl_configs.md: every FP8 GRPO config NeMo-RL ships, with what `jetrl check` and
`jetrl align --recipe jetrl` say about it (issue 26).

    .venv/bin/python scripts/nemo_rl_config_table.py            # both trees, rewrite the doc
    .venv/bin/python scripts/nemo_rl_config_table.py --stdout   # print instead

A GRPO config is a YAML file under a tree's ``examples/`` whose config, resolved with our loader
(``defaults:`` inheritance, NeMo-RL's resolvers), has a ``grpo`` section and a ``policy``
section; it is FP8 when vLLM runs ``precision: fp8`` or an FP8 KV cache, or Megatron's
``fp8_cfg.enabled`` is true. ``${oc.env:...}`` paths that only locate data or venvs
(``HF_HOME``, ``PERSISTENT_CACHE``) get placeholders when unset. The NeMo-RL tier
(tests/backends/test_nemo_rl_config_table.py) regenerates each tree's section with NeMo-RL on
the path and fails when the committed doc differs: rerun this script then.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "nemo_rl_configs.md"
UPSTREAM = Path(os.environ.get("JETRL_NEMO_RL_UPSTREAM") or REPO.parent / "shared/upstream/nemo-rl")
TREES = ("v0.7.0", "main-7ea279a")
ENV_PLACEHOLDERS = {"HF_HOME": "/tmp/hf_home", "PERSISTENT_CACHE": "/tmp/persistent_cache"}
SECTION = re.compile(r"^## NeMo-RL (\S+)\n", re.MULTILINE)


@dataclass(frozen=True)
class Row:
    config: str
    """Path inside the tree."""
    fp8: str
    """What is FP8 in the config (resolved)."""
    check: str
    """`jetrl check`: exit code and verdict (or the refusal)."""
    align: str
    """`jetrl align --recipe jetrl`: exit code and the aligned config's verdict (or refusal)."""


def set_env_placeholders() -> None:
    for k, v in ENV_PLACEHOLDERS.items():
        os.environ.setdefault(k, v)


def _sel(cfg, key: str):
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, default=None)
    except Exception:  # an unresolvable node on the way: not what we classify
        return None


def fp8_summary(cfg, sel=None) -> str:
    """What is FP8 in a resolved config ("" when nothing is); ``sel(cfg, key)`` reads a key
    (default: OmegaConf's select on a DictConfig)."""
    sel = sel or _sel
    parts = []
    if sel(cfg, "policy.generation.vllm_cfg.precision") == "fp8":
        mx = sel(cfg, "policy.generation.vllm_cfg.is_mx") is True
        parts.append("rollout MXFP8" if mx else "rollout FP8")
    if str(sel(cfg, "policy.generation.vllm_cfg.kv_cache_dtype")).startswith("fp8"):
        parts.append("KV FP8")
    if sel(cfg, "policy.megatron_cfg.fp8_cfg.enabled") is True:
        scales = sel(cfg, "policy.megatron_cfg.env_vars.NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
        recipe = sel(cfg, "policy.megatron_cfg.fp8_cfg.fp8_recipe") or "blockwise"
        parts.append(f"train {recipe}" + (" FP32 scales" if str(scales) == "1" else ""))
    return ", ".join(parts)


class _Interpolated(Exception):
    """A key whose value only the resolved config gives."""


# A value that is one absolute reference to another key and nothing else, "${policy.precision}"
# (220 of main's 339 GRPO configs set vllm_cfg.precision so): followed in the container. Any
# other interpolation (a resolver, a relative key, text around it) needs OmegaConf.
_REFERENCE = re.compile(r"\$\{([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\}")


def _plain_sel(raw: dict, key: str, depth: int = 0):
    """``key`` of a merged, unresolved container (None where absent); `_Interpolated` where an
    interpolation on the way or in the value needs OmegaConf to resolve it."""
    node = raw
    for part in key.split("."):
        node = _followed(raw, node, key, depth)
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return _followed(raw, node, key, depth)


def _followed(raw: dict, node, key: str, depth: int):
    """``node``, or the value it names when it is a plain reference to a key that is set."""
    if not (isinstance(node, str) and "${" in node):
        return node
    ref = _REFERENCE.fullmatch(node)
    if ref is None or depth >= 8:  # a resolver, relative or embedded; or a long chain
        raise _Interpolated(key)
    parent, _, leaf = ref[1].rpartition(".")
    holder = _plain_sel(raw, parent, depth + 1) if parent else raw
    if not isinstance(holder, dict) or leaf not in holder:
        raise _Interpolated(key)  # OmegaConf says what a dangling reference is
    return _followed(raw, holder[leaf], key, depth + 1)


def fp8_grpo_configs(tree_dir: Path) -> list[tuple[Path, object, str]]:
    """(path, resolved config, `fp8_summary`) of every FP8 GRPO config under the tree's
    examples/. A config whose FP8 keys are plain values in its merged YAML is classified there;
    only an FP8 one, or one whose keys need resolving, is loaded into a DictConfig (most of a
    tree walk's time: docs/ci_times.md)."""
    from nemo_jetrl.config import load_config
    from nemo_jetrl.config.load import merged_container

    out = []
    for p in sorted((tree_dir / "examples").rglob("*.yaml")):
        try:
            raw = merged_container(p)  # no section: not a GRPO config, no DictConfig built
            if raw.get("grpo") is None or raw.get("policy") is None:
                continue
            try:
                if not fp8_summary(raw, _plain_sel):
                    continue
            except _Interpolated:
                pass
            cfg = load_config(p)
        except Exception:  # not a config (quant recipes, launcher settings) or not ours to read
            continue
        if _sel(cfg, "grpo") is not None and _sel(cfg, "policy") is not None:
            fp8 = fp8_summary(cfg)
            if fp8:
                out.append((p, cfg, fp8))
    return out


def _run(argv: list[str]) -> tuple[int, str, str]:
    from nemo_jetrl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _outcome(code: int, out: str, err: str) -> str:
    """ "exit N: <verdict line>" or "exit 2: <first problem, up to its detail>"."""
    if code == 2:
        problems = [ln.strip()[2:] for ln in err.splitlines() if ln.strip().startswith("- ")]
        first = problems[0] if problems else err.strip().splitlines()[-1]
        first = re.split(r" \(|; |\. |: its | of <", first)[0]  # the key and its first clause
        return f"exit 2, refused: {first}"  # the first problem only: the rest churn with arch
    verdicts = [ln for ln in out.splitlines() if ln.startswith("verdict: ")]
    return f"exit {code}: {verdicts[-1][len('verdict: ') :] if verdicts else '(no verdict)'}"


def tree_rows(tree_dir: Path) -> list[Row]:
    """The table's rows for one tree (every FP8 GRPO config, in path order)."""
    set_env_placeholders()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for path, _cfg, fp8 in fp8_grpo_configs(tree_dir):
            check = _outcome(*_run(["check", str(path)]))
            out = Path(tmp) / f"{path.stem}.aligned.yaml"
            argv = ["align", str(path), "--recipe", "jetrl", "-o", str(out), "--force"]
            align = _outcome(*_run(argv))
            rows.append(Row(str(path.relative_to(tree_dir)), fp8, check, align))
    return rows


def render_tree(tree: str, rows: list[Row]) -> str:
    """One tree's section of the doc."""
    aligned = sum(r.align.startswith("exit 0") for r in rows)
    lag = sum("policy lag (precision flow: on-policy)" in r.align for r in rows)
    refused = sum(r.align.startswith("exit 2") for r in rows)
    named_off = len(rows) - aligned - lag - refused
    lines = [
        f"## NeMo-RL {tree}",
        "",
        f"{len(rows)} FP8 GRPO configs: {aligned} aligned on-policy (exit 0), {lag} aligned "
        f"on-policy in precision with their policy lag named (exit 1), {named_off} aligned with "
        f"what is still off named (exit 1), {refused} refused by name (exit 2).",
        "",
        "| config | FP8 in the config | `jetrl check` | `jetrl align --recipe jetrl` |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r.config}` | {r.fp8} | {r.check} | {r.align} |" for r in rows]
    return "\n".join(lines) + "\n"


HEADER = """# NeMo-RL's FP8 GRPO configs: `jetrl check` and `jetrl align --recipe jetrl`

Generated by `scripts/nemo_rl_config_table.py`; do not edit by hand (the NeMo-RL tier's
`tests/backends/test_nemo_rl_config_table.py` fails when a row no longer matches what the
commands say: rerun the script). Every GRPO config under each tree's `examples/` (recipes
included) whose resolved config has FP8 on some side: vLLM `precision: fp8` (MXFP8 with
`is_mx: true`), an FP8 KV cache, or Megatron `fp8_cfg.enabled`. The `check` column is the
config as shipped; the `align` column is the verdict `jetrl align --recipe jetrl` prints for the
file it writes. Every config aligned with exit 0 or 1 also passes NeMo-RL's own loader,
`MasterConfig` and `grpo.setup` checks (GPU pieces stood in) in the NeMo-RL tier
(`test_every_fp8_grpo_config_of_the_tree_checks_aligns_and_is_accepted`, which allows no
refusal from `align`). A `check` refusal (exit 2) names the key and its first problem. An exit 1
after `align` is a run that is on-policy in precision but lags by `grpo.async_grpo` (named), or
one whose verdict names what align must not change (a DTensor policy, which never trains FP8:
plain `jetrl align`, a BF16 rollout, is on-policy for it; FP8 experts whose routing NeMo-RL's
vLLM cannot give our experts kernel, DeepSeek's and Moonlight's: docs/moe_cluster.md). MXFP8
rows: see "`jetrl align`" in docs/configs.md for what changes. Every GRPO config, FP8 or not,
gets a verdict checked against an independent classification in
`tests/backends/test_nemo_rl_every_grpo_config.py`.
"""


def sections(text: str) -> dict[str, str]:
    """tree -> its section text, from a rendered doc."""
    marks = list(SECTION.finditer(text))
    return {
        m.group(1): text[m.start() : marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        for i, m in enumerate(marks)
    }


def render(upstream: Path = UPSTREAM, trees: tuple[str, ...] = TREES) -> str:
    return HEADER + "".join("\n" + render_tree(t, tree_rows(upstream / t)) for t in trees)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stdout", action="store_true", help="print instead of writing the doc")
    ap.add_argument("--upstream", type=Path, default=UPSTREAM, help="folder of NeMo-RL trees")
    args = ap.parse_args(argv)
    missing = [t for t in TREES if not (args.upstream / t / "examples").is_dir()]
    if missing:
        print(f"no NeMo-RL tree {', '.join(missing)} under {args.upstream}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    text = render(args.upstream)
    if args.stdout:
        print(text, end="")
    else:
        DOC.write_text(text)
        print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
