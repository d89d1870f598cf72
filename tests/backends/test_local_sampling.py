"""Token sampling in the local rollout (`backends/local/rollout.py`: `sample`, `device_draw`).

A CPU run draws with the run's sampling generator itself (unchanged: the CPU demo's draws). On an
accelerator the draw runs on the device from a generator seeded by one draw of the host
generator, so the host's work per decode step no longer grows with the vocabulary (131 ms a
step for 32 rows x 151,936 on a 2-core EPYC with a CPU generator, one thread).

On CPU `device_draw` runs with a CPU tensor and a second CPU generator standing in for the
device's (the same calls; only the generator's device differs): the host advances by exactly one
draw whatever the batch and vocabulary, the draws repeat from the same host state (a resumed run
draws what the uninterrupted one drew), and they follow ``probs`` (certain and impossible ids,
frequencies against the probabilities). The ``gpu`` test runs `sample` with CUDA probabilities
and the run's CPU generator.
"""

from __future__ import annotations

import pytest
import torch

from nemo_jetrl.backends.local.rollout import SEED_HIGH, device_draw, sample

QWEN3_VOCAB = 151_936


def _host(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _next_host_value(g: torch.Generator) -> int:
    return int(torch.randint(SEED_HIGH, (1,), generator=g))


def test_the_host_generator_advances_by_one_draw_whatever_the_vocabulary():
    for rows, vocab in ((1, 5), (32, QWEN3_VOCAB)):
        probs = torch.softmax(torch.randn(rows, vocab, generator=_host(1)), dim=-1)
        host, twin = _host(), _host()
        ids = device_draw(probs, host, torch.Generator())
        assert ids.shape == (rows,) and ids.dtype == torch.long
        _next_host_value(twin)  # the one draw device_draw takes
        assert host.get_state().equal(twin.get_state()), (rows, vocab)
    # the CPU run's own path draws one exponential per entry: its host state moves differently
    host, twin = _host(), _host()
    sample(probs, host)
    _next_host_value(twin)
    assert not host.get_state().equal(twin.get_state())


def test_the_same_host_state_gives_the_same_draws_on_resume():
    probs = torch.softmax(torch.randn(8, 1000, generator=_host(2)), dim=-1)
    host = _host()
    first = [device_draw(probs, host, torch.Generator()) for _ in range(3)]
    saved = host.get_state()  # what a checkpoint keeps
    later = [device_draw(probs, host, torch.Generator()) for _ in range(3)]
    resumed = torch.Generator()
    resumed.set_state(saved)
    dev = torch.Generator().manual_seed(123)  # whatever state the device generator had
    assert all(device_draw(probs, resumed, dev).equal(x) for x in later)
    # and consecutive steps draw from different seeds (not the same ids every step)
    assert not all(x.equal(first[0]) for x in first[1:] + later)


def test_draws_follow_the_probabilities():
    # row 0 certain, row 1 never its zero-probability ids, row 2 against its frequencies
    probs = torch.tensor(
        [[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]], dtype=torch.float32
    )
    host, dev = _host(), torch.Generator()
    n = 4000
    draws = torch.stack([device_draw(probs, host, dev) for _ in range(n)])  # [n, 3]
    assert (draws[:, 0] == 2).all()
    assert set(draws[:, 1].tolist()) == {0, 2}
    freq = torch.bincount(draws[:, 2], minlength=4).double() / n
    # 5 standard deviations of a binomial frequency at n = 4000 (largest: p = 0.4, 0.039)
    sd = (probs[2].double() * (1 - probs[2].double()) / n).sqrt()
    assert ((freq - probs[2].double()).abs() < 5 * sd).all(), freq


@pytest.mark.gpu
def test_cuda_probabilities_draw_on_the_device_from_the_host_generator():
    probs = torch.softmax(torch.randn(32, QWEN3_VOCAB, device="cuda"), dim=-1)
    a, b = _host(), _host()
    ids = sample(probs, a)
    assert ids.device.type == "cuda" and ids.shape == (32,)
    assert ids.equal(sample(probs, b))  # the same host state: the same draws
    twin = _host()
    _next_host_value(twin)
    assert a.get_state().equal(twin.get_state())  # one host draw, not 32 x 151,936
    assert (probs.gather(1, ids[:, None]) > 0).all()
