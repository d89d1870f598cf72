"""The `jetrl` console script: discovers subcommands in `nemo_jetrl.commands`.

Exit codes common to every command: 2 a `UserError` (bad input, printed without a traceback),
130 interrupted (Ctrl-C), 141 stdout's reader went away before the output was all written
(`jetrl check CONFIG | head -1`: ``EXIT_BROKEN_PIPE``, 128 + SIGPIPE, what a shell reports for
a tool that SIGPIPE ended, `yes | head -1` under ``set -o pipefail``). That one is silent and
never the command's own code: a cut-short ``check`` is neither 0 (on-policy) nor 1
(off-policy), as its verdict was not delivered, even when the command itself had finished and
only the last flush failed. The commands' own codes are in each command's help and the README.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import select
import stat
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
        p.set_defaults(_run=mod.run, _parser=p)  # _parser: a usage error shows its usage
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, except that ``KEY=VALUE`` overrides after an option reach ``overrides``.

    Before Python 3.12.7 / 3.13.1 (tried: 3.10, 3.11, 3.12.1, 3.13.0) argparse fills the
    ``overrides`` positional (``nargs="*"``) with the empty list at ``CONFIG`` and leaves
    ``train CFG --backend nemo-rl k=v``'s ``k=v`` unrecognized. Leftovers that are not options
    are appended to ``overrides`` in their order (they all come after the ones argparse took);
    anything else is still an error, said by the subcommand's parser (its usage, ``jetrl
    train: error: unrecognized arguments: --steps 3``), not the top-level one's.
    ``parse_intermixed_args`` is not used: it refuses subparsers.
    """
    args, extras = parser.parse_known_args(argv)
    if extras:
        stray = [e for e in extras if e.startswith("-")]
        if stray or not isinstance(getattr(args, "overrides", None), list):
            sub = getattr(args, "_parser", parser)
            hint = _near_option(stray, sub)
            if not hint and stray and isinstance(getattr(args, "overrides", None), list):
                hint = " (set a config key as a KEY=VALUE override, not as an option)"
            sub.error("unrecognized arguments: " + " ".join(extras) + hint)
        args.overrides = [*args.overrides, *extras]
    return args


def _near_option(stray: list[str], parser: argparse.ArgumentParser) -> str:
    """`` (did you mean: --jsn -> --json?)`` for options a typo away from one ``parser``
    takes; "" when none is."""
    import difflib

    known = list(parser._option_string_actions)  # argparse keeps no public list of them
    near = [
        f"{s.split('=')[0]} -> {m[0]}"
        for s in stray
        if (m := difflib.get_close_matches(s.split("=")[0], known, n=1, cutoff=0.75))
    ]
    return f" (did you mean: {', '.join(near)}?)" if near else ""


#: exit code when stdout's reader closed the pipe early (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``jetrl ARGV`` and return its exit code (the console script exits with it).

    Output into a pipe whose reader has gone (``| head -1``) ends the command quietly with
    ``EXIT_BROKEN_PIPE``, whether the write failed in the command's body or in the flush of
    what is still buffered when it returns. The standard recipe: stdout then points at
    devnull, so the interpreter's own flush at exit finds nothing to write and prints no
    "Exception ignored". (argparse's ``--help`` ignores a failed write itself and exits 0.)
    A BrokenPipeError while stdout's reader is still there (a worker's pipe, a socket) is the
    command's own failure and propagates."""
    try:
        try:
            code = _main(argv)
        except SystemExit:  # argparse: --help, usage errors; their text may still be buffered
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    return code


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end is closed (poll: POLLERR/POLLHUP)."""
    try:
        fd = sys.stdout.fileno()
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no descriptor (replaced stdout), no poll
        return False


def _stdout_to_devnull() -> None:
    """Point file descriptor 1 at devnull (stdout's buffer is then written there, at exit)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
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
