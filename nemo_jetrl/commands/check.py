"""`jetrl check CONFIG [overrides...]`: is this config's rollout on-policy?

Prints the recipe of each side, the precision flow per layer group (training forward vs rollout),
the verdict and every mismatch with the YAML keys that fix it; for an on-policy recipe, what
``jetrl train --backend nemo-rl`` would still refuse on each NeMo-RL tree before Ray starts
(`launch_refusals`: the exit code stays the verdict's). Exit code 0: on-policy; 1: off-policy; 2:
the config is invalid (every problem listed, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from nemo_jetrl.config.settings import CorrectionKeys
from nemo_jetrl.flow.pipeline import Checked

NAME = "check"
HELP = "check that a NeMo-RL config's FP8 rollout is on-policy (exit 0 on, 1 off, 2 invalid)"

EXIT_ON_POLICY = 0
EXIT_OFF_POLICY = 1
EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="NeMo-RL-shaped YAML (defaults: inheritance supported)")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],  # optional: without a default argparse lists it as required
        help="key=value, +key=value (add), ++key=value, ~key (delete)",
    )
    parser.add_argument(
        "--backward", action="store_true", help="also print the training backward precisions"
    )
    parser.add_argument(
        "--edges", action="store_true", help="list every mismatched edge, not just a summary"
    )
    parser.add_argument(
        "--json", action="store_true", help="print a JSON summary instead of the text report"
    )


def load_and_check(path: str, overrides: list[str], *, keep_refused: bool = False) -> Checked:
    """The pipeline (`nemo_jetrl.flow.pipeline`); UserError listing every problem when invalid.
    ``keep_refused``: what no backend supports yet comes back in `Checked.refused`."""
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import UserError
    from nemo_jetrl.flow.pipeline import check_config

    try:
        return check_config(path, overrides, keep_refused=keep_refused)
    except ConfigError as exc:
        raise UserError(f"invalid config\n{exc}") from None


def _table(rows: list[tuple[str, ...]], out: TextIO, indent: str = "  ") -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print(
            indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(),
            file=out,
        )
        if j == 0:
            print(indent + "  ".join("-" * w for w in widths), file=out)


def report(
    c: Checked, source: str, out: TextIO, *, backward: bool = False, edges: bool = False
) -> int:
    """Print the check and return the exit code (0 on-policy, 1 off-policy)."""
    from nemo_jetrl.flow.table import flow_table

    check = c.check
    _print_header(c, source, out)
    print("\nprecision flow (training forward vs rollout):", file=out)
    _table([("layers", "group", "training forward", "rollout", "status"), *flow_table(check)], out)
    _print_groups(c, out)
    if backward:
        _print_backward(c, out)
    print(file=out)
    if check.on_policy:
        refusals = launch_refusals(c)
        print("per backend (precision):", file=out)
        for b in c.backends:
            state = "not run" if not b.runs else f"{'on' if b.on_policy else 'OFF'}-policy"
            refused = _launch_refused(b, refusals)
            but = " (but jetrl train refuses this config there: see below)" if refused else ""
            print(f"  {b.backend}: {state}{but}: {b.reason}", file=out)
        _print_launch(refusals, out)
    if c.limits:
        return _print_limits(c, out)
    if c.on_policy:
        print(
            "verdict: ON-POLICY: every rollout tensor equals its training-forward tensor", file=out
        )
        return EXIT_ON_POLICY
    if check.on_policy:
        off = [b.backend for b in c.backends if b.runs and not b.on_policy]
        print(f"verdict: OFF-POLICY on {', '.join(off)} (see per backend)", file=out)
        return EXIT_OFF_POLICY
    n = len(check.mismatches)
    print(f"verdict: OFF-POLICY ({n} mismatch{'es' if n != 1 else ''})", file=out)
    _print_mismatches(c, out, edges=edges)
    print(
        f"\n`jetrl align {source} -o OUT.yaml` writes a config whose rollout follows training.",
        file=out,
    )
    return EXIT_OFF_POLICY


def launch_refusals(c: Checked) -> dict[str, list[tuple[str, str]]]:
    """Per NeMo-RL tree (``v0.7.0``, ``main``): (key, why) for each reason ``jetrl train
    --backend nemo-rl`` would refuse this config before Ray starts (empty: it would launch)."""
    from nemo_jetrl.backends.nemo_rl.launch import launch_problems
    from nemo_jetrl.backends.nemo_rl.tree_rules import KNOWN_TREES

    return {tree: launch_problems(c, facts) for tree, facts in KNOWN_TREES.items()}


def _launch_refused(b: Any, refusals: dict[str, list[tuple[str, str]]]) -> bool:
    """Whether ``b`` (a backend verdict) is on-policy but its launch would be refused."""
    tree = b.backend.removeprefix("nemo-rl ")
    return b.runs and b.on_policy and bool(refusals.get(tree))


def _print_launch(refusals: dict[str, list[tuple[str, str]]], out: TextIO) -> None:
    refused = {t: p for t, p in refusals.items() if p}
    if not refused:
        return
    print("jetrl train --backend nemo-rl would refuse it (exit 2, before Ray starts):", file=out)
    trees = list(refused)
    if len(trees) == len(refusals) and all(p == refused[trees[0]] for p in refused.values()):
        refused = {" and ".join(trees): refused[trees[0]]}  # the same on every tree
    for tree, problems in refused.items():
        print(f"  on NeMo-RL {tree}:", file=out)
        for key, why in problems:
            print(f"    - {key}: " + why.replace("\n", "\n      "), file=out)


def _print_limits(c: Checked, out: TextIO) -> int:
    """The verdict when the flow is not the whole story (`flow.limits`): never ON-POLICY."""
    flow = "on-policy" if c.precision_on_policy else "OFF-POLICY"
    unmodelled, lag = c.limits_of("unmodelled"), c.limits_of("policy_lag")
    if unmodelled:
        head = "NOT PROVEN ON-POLICY: precision keys this checker does not model"
    else:
        head = f"OFF-POLICY by policy lag (precision flow: {flow})"
    print(f"verdict: {head}", file=out)
    for x in (*unmodelled, *lag):
        print(f"  - {x.message}", file=out)
        print(f"    keys: {', '.join(x.keys)}", file=out)
    if unmodelled:
        print(f"  precision flow of the modelled tensors: {flow}", file=out)
    if not c.precision_on_policy and c.check.mismatches:
        _print_mismatches(c, out, edges=False)
    return EXIT_OFF_POLICY


def _print_groups(c: Checked, out: TextIO) -> None:
    """The verdict per group of linears, and (MoE) whether routing is replayed."""
    from nemo_jetrl.flow.groups import group_verdicts, routing_note

    print("\nverdict per group:", file=out)
    rows = [
        (g.label, g.layers, "same" if g.same else "DIFFERS", g.train, g.rollout)
        for g in group_verdicts(c.check)
    ]
    _table([("group", "layers", "status", "training forward", "rollout"), *rows], out)
    note = routing_note(c.settings, c.arch)
    if note:
        print(f"  {note}", file=out)


def _print_header(c: Checked, source: str, out: TextIO) -> None:
    """The config, the model, config issues, the recipe and the IS correction."""
    arch = c.arch
    print(f"config: {source}", file=out)
    print(
        f"model:  {arch.name} ({arch.num_layers} layers, hidden {arch.hidden_size}, "
        f"intermediate {arch.intermediate_size}, heads {arch.num_heads}/{arch.num_kv_heads}; "
        f"{arch.family})",
        file=out,
    )
    if c.arch_note:
        print(f"note:   {c.arch_note}", file=out)
    for i in c.issues:
        if c.arch_note and i.path == "policy.model_name" and i.level == "note":
            continue  # said above
        print(f"{i.level}: {i}", file=out)
    print(c.recipe.describe(), file=out)
    print(f"  importance-sampling correction: {_is_correction(c.settings.correction)}", file=out)


def _print_backward(c: Checked, out: TextIO) -> None:
    """The training backward's precisions per layer range (``--backward``)."""
    from nemo_jetrl.flow.check import format_ranges

    print("\ntraining backward (does not decide on-policyness):", file=out)
    rows = {}
    for e in c.check.train_bwd.edges:
        if e.layer is None:
            continue
        rows.setdefault((e.group, e.role, e.precision.short()), []).append(e.layer)
    _table(
        [("layers", "group", "operand", "precision")]
        + [(format_ranges(sorted(set(v))), g, r, p) for (g, r, p), v in rows.items()],
        out,
    )


def _print_mismatches(c: Checked, out: TextIO, *, edges: bool) -> None:
    """Each mismatch: where, the precision pairs, why, keys and fix (and its edges with
    ``--edges``). A fix line holds overrides to paste after ``jetrl check CONFIG`` as they are
    (`flow.fixes`: ``+key=`` where the config lacks the key); ``or:`` the alternative."""
    from nemo_jetrl.config.overrides import key_presence
    from nemo_jetrl.flow.fixes import fix_options, shell_line

    for k, m in enumerate(c.check.mismatches, 1):
        sev = " [differs only on blocks with tiny amax]" if m.severity == "rare" else ""
        print(f"\n{k}. {m.summary()}{sev}", file=out)
        for d in m.details():
            print(f"   {d}", file=out)
        print(f"   why:  {m.reason}", file=out)
        if m.keys:
            print(f"   keys: {', '.join(m.keys)}", file=out)
        for j, option in enumerate(fix_options(key_presence(c.cfg), m.fixes)):
            print(f"   {'or: ' if j else 'fix:'}  {shell_line(option)}", file=out)
        if edges:
            for e in m.edges:
                print(f"     {e}", file=out)


def _is_correction(keys: CorrectionKeys) -> str:
    """One phrase on NeMo-RL's loss_fn IS correction (it reweights; it does not align)."""
    if keys.enabled is not True:
        return "off"
    kind = keys.kind
    if kind is None:
        return "on (untruncated)"
    lo, hi = keys.ratio_min, keys.ratio_max
    return f"on ({kind}, weights in [{0 if lo is None else lo}, {hi}])"


def summary(c: Checked) -> dict[str, Any]:
    """The check as plain data (what --json prints). A mismatch's ``fixes`` are the report's
    (connectors ``or ``/``and `` kept), each setting as the config's override (`flow.fixes`);
    ``fix_options``: the alternatives, each a list of override arguments to pass together."""
    from nemo_jetrl.config.overrides import key_presence
    from nemo_jetrl.flow.fixes import fix_options, pasteable_fixes
    from nemo_jetrl.flow.groups import group_verdicts, routing_note

    check = c.check
    refusals = launch_refusals(c) if check.on_policy else {}
    return {
        "model": c.arch.name,
        "family": c.arch.family,
        "groups": [
            {
                "group": g.group,
                "layers": g.layers,
                "same": g.same,
                "train": g.train,
                "rollout": g.rollout,
            }
            for g in group_verdicts(check)
        ],
        "routing": routing_note(c.settings, c.arch),
        "model_note": c.arch_note,
        "recipe": c.recipe.to_dict(),
        "on_policy": c.on_policy,
        "precision_on_policy": c.precision_on_policy,
        "limits": [{"kind": x.kind, "keys": list(x.keys), "message": x.message} for x in c.limits],
        "backends": [
            {
                "backend": b.backend,
                "on_policy": b.on_policy,
                "runs": b.runs,
                "reason": b.reason,
                "launch_refused": _launch_refused(b, refusals),  # see nemo_rl_launch_refusals
            }
            for b in c.backends
        ],
        "nemo_rl_launch_refusals": {
            tree: [{"key": k, "why": why} for k, why in problems]
            for tree, problems in refusals.items()
        },
        "issues": [
            {"level": i.level, "path": i.path, "message": i.message, "allowed": list(i.allowed)}
            for i in c.issues
        ],
        "mismatches": [
            {
                "reason": m.reason,
                "keys": list(m.keys),
                "fixes": pasteable_fixes(key_presence(c.cfg), m.fixes),
                "fix_options": fix_options(key_presence(c.cfg), m.fixes),
                "severity": m.severity,
                "layers": list(m.layers),
                "operands": list(m.operands),
                "edges": len(m.edges),
                "pairs": [[role, t.short(), r.short()] for role, t, r in m.pairs],
            }
            for m in check.mismatches
        ],
    }


def _json_invalid(source: str, issues: Any) -> None:
    """With ``--json``, an invalid config is JSON on stdout too (exit 2 as without it): the
    problems a script would otherwise parse out of stderr's text."""
    import json

    problems = [{"key": i.path, "message": i.message, "level": i.level} for i in issues]
    print(json.dumps({"config": source, "valid": False, "problems": problems}, indent=2))


def run(args: argparse.Namespace) -> int:
    from nemo_jetrl.config import ConfigError
    from nemo_jetrl.errors import UserError

    if args.json and (args.edges or args.backward):
        flags = " and ".join(
            f for f, on in (("--edges", args.edges), ("--backward", args.backward)) if on
        )
        raise UserError(
            f"{flags} with --json: {flags} shape the text report (--json lists every mismatch "
            "with its edges, not the backward precisions); drop one of them"
        )
    if args.json:
        from nemo_jetrl.flow.pipeline import check_config

        try:
            checked = check_config(args.config, list(args.overrides), keep_refused=True)
        except ConfigError as exc:
            _json_invalid(args.config, exc.issues)
            raise UserError(f"invalid config\n{exc}") from None
    else:
        checked = load_and_check(args.config, list(args.overrides), keep_refused=True)
    if checked.refused:
        from nemo_jetrl.flow.table import flow_table

        if not args.json:  # the reading first, then the refusal (exit 2)
            _print_header(checked, args.config, sys.stdout)
            print("\nprecision flow (training forward vs rollout):")
            rows = flow_table(checked.check)
            _table(
                [("layers", "group", "training forward", "rollout", "status"), *rows], sys.stdout
            )
            _print_groups(checked, sys.stdout)
            sys.stdout.flush()
        if args.json:
            _json_invalid(args.config, checked.refused)
        raise UserError(f"invalid config\n{ConfigError(checked.refused, args.config)}")
    if args.json:
        import json

        print(json.dumps(summary(checked), indent=2))
        return EXIT_ON_POLICY if checked.on_policy else EXIT_OFF_POLICY
    return report(checked, args.config, sys.stdout, backward=args.backward, edges=args.edges)
