from fedbench.results.summaries import first_round_reaching, last_k, summarize

H = [{"round": 1, "accuracy": 30.0}, {"round": 2, "accuracy": 45.0}, {"round": 3, "accuracy": float("nan")},
     {"round": 4, "accuracy": 41.0}, {"round": 5, "accuracy": 50.0}]


def test_last_k_skips_unevaluated_rounds():
    assert last_k(H, k=3) == (45 + 41 + 50) / 3
    assert last_k(H, k=3, how="max") == 50
    assert last_k([], k=3) is None


def test_first_round_reaching():
    assert first_round_reaching(H, 40) == 2
    assert first_round_reaching(H, 50) == 5
    assert first_round_reaching(H, 60) is None
    s = summarize(H, thresholds=[40, 60])
    assert s["first_round_accuracy_ge_40"] == 2 and s["first_round_accuracy_ge_60"] is None
    assert s["last3_max_accuracy"] == 50
