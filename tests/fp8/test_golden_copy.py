"""The golden vectors shipped in tests/data/golden are the shared originals, byte for byte."""

from __future__ import annotations

import hashlib

import pytest
from conftest import REPO_GOLDEN_DIR, SHARED_GOLDEN_DIR

FILES = (
    "te_golden_seed0.safetensors",
    "te_golden_seed0.json",
    "vllm_golden_seed0.safetensors",
    "vllm_golden_seed0.json",
    "te_golden_tails_seed0.safetensors",
    "te_golden_tails_seed0.json",
)


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", FILES)
def test_repository_copy_is_complete(name):
    assert (REPO_GOLDEN_DIR / name).stat().st_size > 0


@pytest.mark.parametrize("name", FILES)
def test_repository_copy_equals_shared_original(name):
    original = SHARED_GOLDEN_DIR / name
    if not original.is_file():
        pytest.skip(f"no shared original at {original} (a plain clone): the copy is what we have")
    assert _sha(REPO_GOLDEN_DIR / name) == _sha(original), f"{name}: copy differs from {original}"
