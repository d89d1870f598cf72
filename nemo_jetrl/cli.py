"""The `jetrl` console script: discovers subcommands in `nemo_jetrl.commands`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from nemo_jetrl import commands
from nemo_jetrl.errors import UserError


def _command_modules() -> list:
    mods = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mods.append(importlib.import_module(f"{commands.__name__}.{info.name}"))
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetrl",
        description="On-policy FP8 RL tools: check and align configs, train, compare runs.",
    )
    parser.add_argument(
        "--version", action="store_true", help="print the version and the commit it was built from"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _command_modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, except that ``KEY=VALUE`` overrides after an option reach ``overrides``.

    Before Python 3.12.7 / 3.13.1 (tried: 3.10, 3.11, 3.12.1, 3.13.0) argparse fills the
    ``overrides`` positional (``nargs="*"``) with the empty list at ``CONFIG`` and leaves
    ``train CFG --backend nemo-rl k=v``'s ``k=v`` unrecognized. Leftovers that are not options
    are appended to ``overrides`` in their order (they all come after the ones argparse took);
    anything else is still an error. ``parse_intermixed_args`` is not used: it refuses
    subparsers.
    """
    args, extras = parser.parse_known_args(argv)
    if extras:
        stray = [e for e in extras if e.startswith("-")]
        if stray or not isinstance(getattr(args, "overrides", None), list):
            parser.error("unrecognized arguments: " + " ".join(extras))
        args.overrides = [*args.overrides, *extras]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if args.version:
        from nemo_jetrl.build_info import version_line

        print(version_line())
        return 0
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"jetrl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jetrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
