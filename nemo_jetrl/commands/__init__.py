"""`jetrl` subcommands, one module each.

A command module defines ``NAME`` (the subcommand), ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int`` (the exit code). `nemo_jetrl.cli` discovers them, so adding a command
never edits a shared file. Modules must import heavy dependencies inside ``run``; modules
whose name starts with ``_`` are helpers of a command, not commands.
"""
