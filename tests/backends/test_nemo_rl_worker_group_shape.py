"""The worker-group stand-in of the unit and in-process engine tests
(tests/backends/worker_group_shape.py) keeps NeMo-RL's contract: the same signature as the real
``RayWorkerGroup.run_all_workers_single_data`` of the tree under test, and the same refusal of
positional arguments (the real method asserts before it touches Ray or its workers)."""

from __future__ import annotations

import inspect

import pytest
from worker_group_shape import POSITIONAL_REFUSED, CallShapeWorkerGroup

pytestmark = pytest.mark.nemo_rl


def _real():
    from nemo_rl.distributed.worker_groups import RayWorkerGroup

    return RayWorkerGroup


def _shape(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signature_matches_nemo_rls():
    real = _real().run_all_workers_single_data
    assert _shape(CallShapeWorkerGroup.run_all_workers_single_data) == _shape(real)


def test_both_refuse_positional_arguments_with_nemo_rls_words():
    real = object.__new__(_real())  # the assert is the method's first statement
    for group in (real, CallShapeWorkerGroup(results=[])):
        with pytest.raises(AssertionError, match=POSITIONAL_REFUSED):
            group.run_all_workers_single_data("__ray_call__", print, 1)
