from fedbench.results.summaries import first_round_reaching, history_value, last_k, summarize

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


def test_record_value_reads_metrics_summaries_and_component_families():
    import pytest
    from fedbench.results.summaries import record_value

    rec = {"metrics": {"accuracy": 60.0, "nll": None, "component0_accuracy": 53.0, "component1_accuracy": 59.5,
                       "component2_accuracy": 57.0, "component0_nll": 9.0},
           "summary": {"first_round_accuracy_ge_97.5": 6, "first_round_accuracy_ge_99": None}}
    assert record_value(rec, "metrics.accuracy") == (60.0, "value")
    assert record_value(rec, "accuracy") == (60.0, "value")                     # a bare key is a metric
    assert record_value(rec, "summary.first_round_accuracy_ge_97.5") == (6.0, "value")   # dots after the first kept
    assert record_value(rec, "summary.first_round_accuracy_ge_99") == (None, "null")     # never reached
    assert record_value(rec, "summary.first_round_accuracy_ge_50") == (None, "absent")   # threshold not recorded
    assert record_value(rec, "metrics.nll") == (None, "null")
    assert record_value(rec, "min(metrics.component*_accuracy)") == (53.0, "value")      # nll entries not matched
    assert record_value(rec, "max(metrics.component*_accuracy)") == (59.5, "value")
    assert record_value(rec, "mean(metrics.component*_accuracy)")[0] == pytest.approx((53 + 59.5 + 57) / 3)
    assert record_value({"metrics": {"accuracy": 1.0}}, "max(metrics.component*_accuracy)") == (None, "absent")


def test_bad_sources_are_one_line_errors():
    import pytest
    from fedbench.errors import FedbenchError
    from fedbench.results.summaries import parse_source

    assert parse_source("max(summary.first_round_*)") == ("max", "summary", "first_round_*")
    for bad in ("metrics.component*_accuracy", "median(metrics.accuracy)", "metrics.", "min(metrics.a b)"):
        with pytest.raises(FedbenchError):
            parse_source(bad)


def test_a_threshold_the_run_did_not_record_comes_from_its_history():
    recorded = summarize(H, thresholds=[40, 45.5, 60])
    for t in (40, 45.5, 60):   # the same value (or never) as the run would have recorded
        key = f"first_round_accuracy_ge_{t:g}"
        v, state = history_value(H, f"summary.{key}")
        assert v == recorded[key] and state == ("null" if recorded[key] is None else "value")
    assert history_value(H, "summary.first_round_nll_ge_1") == (None, "absent")          # no such column
    assert history_value([], "summary.first_round_accuracy_ge_40") == (None, "absent")   # no history
    for other in ("summary.last3_mean_accuracy", "metrics.accuracy", "max(summary.first_round_*)"):
        assert history_value(H, other) == (None, "absent")


def test_history_value_gives_last_k_summaries_as_they_stood_at_an_earlier_round():
    """FedLap App. E.5's cells: the mean / max of the last 3 rounds at round r, from the round history."""
    # at round 4 the last 3 evaluated rounds are 1, 2 and 4 (round 3 has no accuracy)
    assert history_value(H, "summary.last3_mean_accuracy@4") == ((30 + 45 + 41) / 3, "value")
    assert history_value(H, "summary.last3_max_accuracy@4") == (45.0, "value")
    assert history_value(H, "summary.last2_mean_accuracy@2") == (37.5, "value")
    # at the final round it equals the summary the run stores
    assert history_value(H, "summary.last3_max_accuracy@5")[0] == summarize(H)["last3_max_accuracy"]
    assert history_value(H, "summary.last3_mean_accuracy@6") == (None, "absent")    # the run stops at round 5
    assert history_value(H, "summary.last3_mean_nll@4") == (None, "absent")         # no such column
    assert history_value([], "summary.last3_mean_accuracy@4") == (None, "absent")
