"""Errors the user sees: what went wrong and what to change. Imports nothing of the package.

`UserError` is printed by the ``jetrl`` console script without a traceback (exit code 2);
`MissingDependencyError` names the optional dependency and how to install it
(`nemo_jetrl._optional.require` raises it).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input: printed without a traceback, exit code 2."""


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to get it."""
