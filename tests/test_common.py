"""fedbench.algorithms.common: every method's named random stream reproduces the derivation the method used
before the helper existed (written out here by hand), and the one client-weight normalisation."""
import numpy as np
import pytest
import torch

from fedbench.algorithms.common import STREAM_DERIVATIONS, client_weights, method_generator, method_seed, raw_weights
from fedbench.errors import FedbenchError
from fedbench.train.engine import client_generator


def seq(*words):
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(1)[0])


# (method, seed, round, client, tag) -> the seed each method computed inline before
LEGACY = {
    "fedlpa": lambda s, r, c, t: seq(s + 0xF15, r, c),
    "fedlap": lambda s, r, c, t: seq(s + 7919, r, c),
    "fedbe": lambda s, r, c, t: seq(s, r, 0xFEDBE, t),
    "dense": lambda s, r, c, t: seq(s, r, 0xDE45E, t),
    "fedov": lambda s, r, c, t: seq(s, r, c, 0xF0E0, t),
    "fedfisher": lambda s, r, c, t: s * 1_000_003 + 7919 * c + r,
    "regmean": lambda s, r, c, t: s * 1_000_003 + c,
    "fedbens": lambda s, r, c, t: s * 1000 + t,
}
CASES = [(0, 1, 0, 0), (3, 2, 5, 1), (12345, 7, 2, 2)]


def test_every_registered_stream_is_checked_here():
    assert set(STREAM_DERIVATIONS) == set(LEGACY)


@pytest.mark.parametrize("name", sorted(LEGACY))
@pytest.mark.parametrize("case", CASES)
def test_method_seed_reproduces_the_legacy_derivation(name, case):
    s, r, c, t = case
    assert method_seed(name, s, r, c, t) == LEGACY[name](s, r, c, t)


def test_method_generator_draws_the_legacy_numbers():
    got = torch.rand(4, generator=method_generator("fedov", 5, 3, 2, tag=1))
    want = torch.rand(4, generator=torch.Generator().manual_seed(seq(5, 3, 2, 0xF0E0, 1)))
    assert torch.equal(got, want)
    # FedLPA / FedLap used the engine's per-client stream on an offset seed
    got = torch.randperm(50, generator=method_generator("fedlpa", 9, 2, 4))
    assert torch.equal(got, torch.randperm(50, generator=client_generator(9 + 0xF15, 2, 4)))
    got = torch.randn(6, generator=method_generator("fedlap", 9, 2, 4))
    assert torch.equal(got, torch.randn(6, generator=client_generator(9 + 7_919, 2, 4)))


def test_streams_differ_between_methods_and_unknown_name_fails():
    assert method_seed("fedbe", 0, 1, tag=1) != method_seed("dense", 0, 1, tag=1)
    assert method_generator("regmean", 1, client_id=2).device.type == "cpu"
    with pytest.raises(KeyError, match="nosuch"):
        method_seed("nosuch", 0)


def test_client_weights_normalise_in_python_floats():
    assert raw_weights([3, 1], "num_samples") == [3.0, 1.0]
    assert raw_weights([3, 1], "uniform") == [1.0, 1.0]
    assert client_weights([10, 30]) == [0.25, 0.75]
    assert client_weights([10, 30], "uniform") == [0.5, 0.5]
    w = client_weights([1, 1, 1])
    assert w == [1.0 / 3.0] * 3    # the exact float, not merely close
    assert client_weights([7, 0, 3]) == [0.7, 0.0, 0.3]


def test_client_weights_when_every_client_is_empty():
    assert client_weights([0, 0]) == [0.5, 0.5]
    with pytest.raises(FedbenchError, match="nothing here"):
        client_weights([0, 0], empty_error="nothing here")
    assert client_weights([0, 0], "uniform", empty_error="unused") == [0.5, 0.5]
