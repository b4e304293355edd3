"""scripts/gaps/niid_min_size_odds.py (results/gaps.md#fedlpa-table2): the odds that one NIID-Bench draw gives every
client its minimum, from the Dirichlet proportions alone, must agree with the real partition's client sizes."""
from __future__ import annotations

import numpy as np
import pytest

from fedbench.partition import make_partition
from tests.script_loader import load_script


def _load():
    return load_script("gaps/niid_min_size_odds.py")


def test_sizes_from_the_proportions_alone_equal_the_partitions_on_a_draw_that_needs_no_redraw():
    # the real partition shuffles each class before its Dirichlet draw; sizes ignore the shuffle, so the same
    # proportions (replayed from a stream that skips the shuffles) give the same client sizes
    m = _load()
    y = np.repeat(np.arange(10), 600)
    parts = make_partition("noniid-labeldir", y, 10, 3, beta=0.5, min_require_size=0)
    rs = np.random.RandomState(3)
    props = []
    for c in range(10):
        rs.shuffle(np.flatnonzero(y == c).copy())
        props.append(rs.dirichlet(np.repeat(0.5, 10)))

    class Replay:
        def __init__(self):
            self.i = -1

        def dirichlet(self, _alpha):
            self.i += 1
            return props[self.i]

    sizes = m.client_sizes(Replay(), 10, 0.5, 600, 10)
    assert sizes.tolist() == [len(p) for p in parts] and sizes.sum() == len(y)


def test_odds_tell_the_drawable_from_the_impossible():
    m = _load()
    easy = m.odds(10, 0.5, 50)                     # FedLPA's usual rows: every draw works
    assert easy["successes"] == 50 and easy["fewest_short"] == 0
    never = m.odds(50, 0.01, 300)                  # FedLPA Table 2, 50 clients at beta = 0.01
    assert never["successes"] == 0 and never["fewest_short"] >= 5
    with pytest.raises(ValueError, match="beta > 0"):
        m.odds(10, 0.0, 10)


def test_the_command_line_prints_one_line(capsys):
    m = _load()
    assert m.main(["--clients", "50", "--beta", "0.01", "--draws", "200"]) == 0
    out = capsys.readouterr().out
    assert "0 of 200 draws give every client the minimum (none: the redraw loop would not end)" in out
    assert m.main(["--clients", "0", "--beta", "0.01"]) == 2
