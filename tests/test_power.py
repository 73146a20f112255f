"""gram_world.power: variance components against a hand computation and the power against a simulation."""

from __future__ import annotations

import numpy as np
import pytest

from gram_world import power


def test_variance_components_of_a_hand_built_design():
    # 2 worlds x 2 meta seeds x 2 fine-tuning seeds; hand: cell means 1, 3 | 5, 7; world means 2, 6; grand 4
    d = np.array([[[0.0, 2.0], [2.0, 4.0]], [[4.0, 6.0], [6.0, 8.0]]])
    comps = power.variance_components(d)
    ms_f = 8 * 1.0 / (2 * 2 * 1)  # every value is 1 from its cell mean
    ms_m = 2 * 4 * 1.0 / (2 * 1)  # every cell mean is 1 from its world mean
    ms_w = 2 * 2 * (4 + 4) / 1  # world means 2 from the grand mean
    assert comps["finetune"] == pytest.approx(ms_f)
    assert comps["meta"] == pytest.approx((ms_m - ms_f) / 2)
    assert comps["world"] == pytest.approx((ms_w - ms_m) / 4)
    assert comps["mean"] == pytest.approx(4.0)


def test_components_are_recovered_from_a_large_simulated_design():
    rng = np.random.default_rng(0)
    w, m, f = 400, 3, 4
    d = rng.normal(0, 1.0, (w, 1, 1)) + rng.normal(0, 0.5, (w, m, 1)) + rng.normal(0, 2.0, (w, m, f))
    comps = power.variance_components(d)
    assert comps["world"] == pytest.approx(1.0, rel=0.2)
    assert comps["meta"] == pytest.approx(0.25, abs=0.15)
    assert comps["finetune"] == pytest.approx(4.0, rel=0.1)


def test_power_matches_a_simulated_t_test():
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(1)
    worlds, variance, delta, alpha = 8, 1.5, 1.0, 0.05
    hits = [ttest_1samp(rng.normal(delta, np.sqrt(variance), worlds), 0).pvalue < alpha for _ in range(4000)]
    assert power.power(worlds, variance, delta, alpha) == pytest.approx(np.mean(hits), abs=0.03)
    need = power.worlds_needed(variance, delta, alpha)
    assert power.power(need, variance, delta, alpha) >= 0.8 > power.power(need - 1, variance, delta, alpha)


def test_differences_need_a_balanced_design():
    cells = {
        "0/0": {"a/1": [0, 0, 50.0], "b/1": [0, 0, 49.0], "a/2": [0, 0, 51.0], "b/2": [0, 0, 49.0]},
        "0/1": {"a/1": [0, 0, 50.0], "b/1": [0, 0, 50.0], "a/2": [0, 0, 52.0], "b/2": [0, 0, 50.0]},
        "1/0": {"a/1": [0, 0, 50.0], "b/1": [0, 0, 48.0], "a/2": [0, 0, 50.0], "b/2": [0, 0, 49.0]},
        "1/1": {"a/1": [0, 0, 53.0], "b/1": [0, 0, 50.0], "a/2": [0, 0, 50.0], "b/2": [0, 0, 50.0]},
    }
    d = power.differences(cells, "a", "b")
    assert d.shape == (2, 2, 2) and d[0, 1, 1] == pytest.approx(2.0) and d[1, 0, 0] == pytest.approx(2.0)
    del cells["1/1"]["b/2"]
    assert power.differences(cells, "a", "b") is None


def test_power_of_an_affordable_design_matches_a_simulated_nested_study():
    """``at=(W, M)``: the power of W worlds x M meta seeds x F fine-tuning seeds, against a simulation of that nested
    design (world, meta-seed and fine-tuning-seed effects drawn from the components, t-test over world means)."""
    from scipy.stats import ttest_1samp

    rng = np.random.default_rng(2)
    comps = {"world": 1.0, "meta": 0.5, "finetune": 2.0}
    worlds, metas, seeds, delta, alpha = 10, 2, 3, 1.0, 0.05

    def world_means():
        d = (
            delta
            + rng.normal(0, 1.0, (worlds, 1, 1))
            + rng.normal(0, np.sqrt(0.5), (worlds, metas, 1))
            + rng.normal(0, np.sqrt(2.0), (worlds, metas, seeds))
        )
        return d.mean(axis=(1, 2))

    hits = np.mean([ttest_1samp(world_means(), 0).pvalue < alpha for _ in range(3000)])
    variance = power.world_mean_variance(comps, metas, seeds)
    assert power.power(worlds, variance, delta, alpha) == pytest.approx(hits, abs=0.03)
    # plan_table reports that power for each pair, at the family's level, from the pair's own components
    big = rng.normal(0, 1.0, (6, 2, 3))
    cells = {
        f"{w}/{m}": {f"{k}/{f + 1}": [0, 0, (big[w, m, f] if k == "a" else 0.0)] for k in "ab" for f in range(3)}
        for w in range(6)
        for m in range(2)
    }
    (row,) = power.plan_table(cells, [("a", "b")], delta=1.0, family=4, at=(worlds, metas))
    own = power.variance_components(big)
    assert row["power_at"] == pytest.approx(
        power.power(worlds, power.world_mean_variance(own, metas, 3), 1.0, 0.05 / 4)
    )
    assert "power at 10 worlds x 2 meta seeds" in power.markdown([row], 1.0, 4, 0.05, 3, at=(worlds, metas))


def test_power_far_in_the_tail_is_a_probability_not_nan():
    # scipy's noncentral t returns nan for a large noncentrality; the power there is ~1 and never decreases
    values = [power.power(w, 0.5, 1.0, 0.05 / 11) for w in (20, 24, 40, 100)]
    assert all(0.0 <= v <= 1.0 for v in values) and values == sorted(values) and values[-1] > 0.999


def test_one_meta_seed_folds_its_component_into_the_worlds():
    # 3 worlds x 1 meta seed x 2 fine-tuning seeds; hand: world means 1, 2, 6 (grand 3), each value 1 from its mean
    d = np.array([[[0.0, 2.0]], [[1.0, 3.0]], [[5.0, 7.0]]])
    comps = power.variance_components(d)
    ms_f = 6 * 1.0 / (3 * 1 * 1)
    ms_w = 2 * (4 + 1 + 9) / 2
    assert comps["meta"] is None and comps["finetune"] == pytest.approx(ms_f)
    assert comps["world"] == pytest.approx((ms_w - ms_f) / 2)
    assert power.world_mean_variance(comps, 1, 2) == pytest.approx(comps["world"] + ms_f / 2)
