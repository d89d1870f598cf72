"""Shared by the Megatron tests: one real megatron-core GPTModel on CPU per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def gpt():
    from megatron_shims import build_gpt, megatron_cpu

    with megatron_cpu():
        model = build_gpt()
        model.eval()
        yield model
