"""The arithmetic behind scripts/gaps/fola_mix_confusion.py (results/gaps.md#fola-figures3-4), on hand-sized cases:
the pairs' co-training mass, the balanced client weights, and the errors per pair."""
from __future__ import annotations

import numpy as np
import pytest

from tests.script_loader import load_script


@pytest.fixture(scope="module")
def diag():
    return load_script("gaps/fola_mix_confusion.py")


def test_co_mass_is_the_rarer_class_share_held_beside_the_other(diag):
    counts = np.array([[10, 0, 5], [0, 4, 4]], float)   # class totals 10, 4, 9
    mass = diag.co_mass(counts)
    assert mass[0, 1] == 0                                # no client holds classes 0 and 1 together
    assert mass[0, 2] == pytest.approx(5 / 9)             # client 0: min(10, 5) of the rarer class 2's 9
    assert mass[1, 2] == pytest.approx(1.0)               # client 1 holds all of class 1 beside class 2
    assert np.allclose(mass, mass.T) and np.allclose(np.diag(mass), 1)


def test_balanced_weights_equalise_the_holder_weights_where_they_can(diag):
    holds = np.eye(3)                                     # each client holds one class
    w0 = np.array([0.6, 0.3, 0.1])                        # size weights: holder weights 0.6 / 0.3 / 0.1
    w = diag.balanced_weights(holds, w0)
    assert w.min() >= 0 and w.sum() == pytest.approx(1)
    assert (w @ holds).std() < 0.01 < (w0 @ holds).std()
    # two clients with the same classes: balance leaves their split to the pull towards the size weights
    holds = np.array([[1, 0], [1, 0], [0, 1]], float)
    w = diag.balanced_weights(holds, np.array([0.5, 0.3, 0.2]))
    assert (w @ holds) == pytest.approx([0.5, 0.5], abs=0.01) and w[0] > w[1]


def test_pair_errors_count_both_directions_per_thousand(diag):
    y = np.repeat(np.arange(10), 100)                     # 100 test samples a class
    pred = y.copy()
    pred[:10] = 1                                         # 10 zeros read as one
    pred[100:105] = 0                                     # 5 ones read as zero
    pred[200:220] = 3                                     # 20 twos read as three
    covered = np.zeros(45, bool)
    covered[0] = True                                     # pair (0, 1) is the first upper-triangle pair
    err_covered, err_uncovered = diag.pair_errors(pred, y, covered)
    assert err_covered == pytest.approx(15 / 200 * 1000)
    assert err_uncovered == pytest.approx(20 / 200 * 1000 / 44)


def test_wrong_vote_concentration_is_one_when_the_non_holders_agree(diag):
    y = np.array([0, 1])
    holds = np.array([[1, 0], [0, 1], [0, 1]], float)     # client 0 holds class 0, clients 1-2 hold class 1
    weight = np.array([0.5, 0.25, 0.25])
    agree = [np.array([[1.0, 0.0], [1.0, 0.0]]), np.array([[0.0, 1.0], [0.0, 1.0]]), np.array([[0.0, 1.0], [0.0, 1.0]])]
    # sample 0 (class 0): clients 1-2 vote class 1 together -> 1.0; sample 1 (class 1): client 0 votes class 0 -> 1.0
    assert diag.wrong_vote_concentration(agree, weight, holds, y) == pytest.approx(1.0)
    split = [agree[0], np.array([[0.5, 0.5], [0.0, 1.0]]), agree[2]]
    # sample 0: client 1 puts half its vote on the true class, so the wrong class gets 0.25 * 0.5 + 0.25 of 0.5
    assert diag.wrong_vote_concentration(split, weight, holds, y) == pytest.approx((0.75 + 1.0) / 2)
