"""The setup every Triton kernel test module here shares: its marks, device and block shapes.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1),
which runs them in numpy: numpy warns on 448/0 (zero blocks) and inf*0 (bad input), warnings
these modules expect and filter.
"""

from __future__ import annotations

import pytest
import torch

TRITON_MARKS = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The quantizer's block shapes: 1x128 (activations), 128x128 (weights), 128x1 (WGrad operands).
BLOCKS = [(1, 128), (128, 128), (128, 1)]
