"""gram_world.study: per-cell H, paired differences and the two-level bootstrap, checked against hand
computations and the normal approximation."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from gram_world import study
from gram_world.demo.settings import DemoSettings

NOW = {"commit": "abc", "fingerprint": "f" * 64, "golden": True, "numerics": {"cpu_model": "test CPU"}}


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    """What computed a new cell here: a fixed record (the real one runs the ~15 s golden run)."""
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)


@pytest.fixture
def few_bootstrap_draws(monkeypatch):
    """study() rewrites its summary after every cell: 10,000 two-level bootstrap draws per pair (a pure-Python
    loop) on each rewrite, 15-50 s for the tests below that run whole studies.  Those tests check cells, rows,
    mean differences and files, none of which depends on the draws (the intervals and p-values do; the tests of
    summarise and bootstrap_interval keep every draw): 200 draws each, through the same function."""
    full = study.bootstrap_means
    monkeypatch.setattr(study, "bootstrap_means", lambda groups, draws=200, seed=0: full(groups, draws, seed))


def _record(key, seed, base, new, dataset="d"):
    return {"key": key, "seed": seed, "base": base, "new": new, "dataset": dataset}


def test_cell_h_averages_base_and_new_over_datasets_before_the_harmonic_mean():
    records = [
        _record("coop", 1, 60.0, 40.0, "a"),
        _record("coop", 1, 80.0, 20.0, "b"),
        _record("coop", 2, 50.0, 50.0, "a"),
    ]
    table = study.cell_h(records)
    base, new = 70.0, 30.0
    assert table[("coop", 1)] == pytest.approx((base, new, 2 * base * new / (base + new)))
    assert table[("coop", 2)] == pytest.approx((50.0, 50.0, 50.0))


def test_paired_differences_pair_rows_by_fine_tuning_seed_and_skip_missing_rows():
    cells = {
        ("0", 0): {
            ("gram_coop", 1): (0, 0, 50.0),
            ("coop", 1): (0, 0, 48.0),
            ("gram_coop", 2): (0, 0, 40.0),
            ("coop", 2): (0, 0, 45.0),
            ("gram_vpt", 1): (0, 0, 30.0),
        },
        ("0", 1): {("gram_coop", 1): (0, 0, 41.0), ("coop", 1): (0, 0, 40.0)},
        ("1", 0): {("gram_coop", 1): (0, 0, 10.0), ("coop", 1): (0, 0, 13.0)},
    }
    diffs = study.paired_differences(cells, (("gram_coop", "coop"), ("gram_vpt", "vpt")))
    assert diffs == {("gram_coop", "coop"): {"0": [2.0, -5.0, 1.0], "1": [-3.0]}}


def test_bootstrap_of_a_constant_is_that_constant():
    assert study.bootstrap_interval({"a": [1.5] * 4, "b": [1.5] * 3}, draws=200) == pytest.approx((1.5, 1.5, 1.5))


def test_one_group_bootstrap_matches_the_normal_interval():
    rng = np.random.default_rng(3)
    values = rng.normal(2.0, 1.0, size=400)
    mean, lo, hi = study.bootstrap_interval({"only": list(values)}, draws=4000)
    half = 1.96 * values.std(ddof=1) / np.sqrt(len(values))
    assert mean == pytest.approx(values.mean())
    assert lo == pytest.approx(mean - half, abs=0.25 * half)
    assert hi == pytest.approx(mean + half, abs=0.25 * half)


def test_worlds_are_the_first_level_of_the_bootstrap():
    """Two worlds with opposite effects and no spread inside: the interval spans both world means
    (cells are not treated as independent), while pooling them into one group makes it narrow."""
    groups = {"a": [1.0] * 20, "b": [3.0] * 20}
    _, lo, hi = study.bootstrap_interval(groups, draws=2000)
    assert lo == pytest.approx(1.0) and hi == pytest.approx(3.0)
    _, lo1, hi1 = study.bootstrap_interval({"pooled": groups["a"] + groups["b"]}, draws=2000)
    assert 1.5 < lo1 < hi1 < 2.5


def test_summarise_says_which_claims_hold():
    cells = {
        (w, 0): {
            row: value
            for s in (1, 2)
            for row, value in (
                (("gram_coop", s), (0, 0, 50.0 + d)),
                (("coop", s), (0, 0, 50.0)),
                (("gram_vpt", s), (0, 0, 50.0 - d)),
                (("vpt", s), (0, 0, 50.0)),
                (("unigram", s), (0, 0, 50.0 + (d if s == 1 else -d))),
                (("joint", s), (0, 0, 50.0)),
            )
        }
        for w, d in (("0", 1.0), ("1", 2.0))
    }
    rows = {
        r["method"]: r
        for r in study.summarise(cells, (("gram_coop", "coop"), ("gram_vpt", "vpt"), ("unigram", "joint")))
    }
    # the per-row interval alone would call the first two; a t-test over two world means cannot (p ~ 0.2)
    assert rows["gram_coop"]["holds_uncorrected"] == "better" and rows["gram_coop"]["mean_diff_H"] == pytest.approx(1.5)
    assert rows["gram_vpt"]["holds_uncorrected"] == "worse" and rows["gram_vpt"]["n"] == 4
    assert rows["unigram"]["holds_uncorrected"] == "not shown" and rows["unigram"]["worlds"] == ["0", "1"]
    assert all(r["holds"] == "not shown" and r["family"] == 3 for r in rows.values())
    t = 1.5 / (np.std([1.0, 2.0], ddof=1) / np.sqrt(2))  # world means 1 and 2
    assert rows["gram_coop"]["p_world_t"] == pytest.approx(2 * (0.5 - np.arctan(t) / np.pi), abs=1e-5)  # t, 1 df
    table = study.markdown(list(rows.values()))
    assert rows["gram_coop"]["mean_H"] == pytest.approx(51.5) and rows["gram_coop"]["baseline_mean_H"] == 50.0
    assert f"| {rows['gram_coop']['label']} | {rows['gram_coop']['baseline_label']} | 51.50 / 50.00 | +1.50 |" in table
    assert "p Holm (3 rows)" in table and "not shown" in table


def test_holm_adjusts_step_down_over_the_family():
    # hand computation: sorted 0.01, 0.02, 0.04 -> 3 x 0.01, max(0.03, 2 x 0.02), max(0.04, 1 x 0.04)
    assert study.holm([0.04, 0.01, None, 0.02]) == pytest.approx([0.04, 0.03, None, 0.04])
    assert study.holm([0.5, 0.6]) == [1.0, 1.0] and study.holm([]) == []


def test_claims_hold_only_after_holm_over_the_table():
    """Six worlds: a clear effect holds after Holm; a weaker one that a lone row's test would call does not."""
    strong = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]
    weak = [0.9, -0.1, 0.8, 0.2, 0.7, 0.3]  # p ~ 0.034 alone; second smallest of three: x 2 under Holm
    null = [0.5, -0.4, 0.1, -0.3, 0.2, -0.2]
    cells = {
        (str(w), 0): {
            ("gram_coop", 1): (0, 0, 50.0 + strong[w]),
            ("coop", 1): (0, 0, 50.0),
            ("gram_vpt", 1): (0, 0, 50.0 + weak[w]),
            ("vpt", 1): (0, 0, 50.0),
            ("unigram", 1): (0, 0, 50.0 + null[w]),
            ("joint", 1): (0, 0, 50.0),
        }
        for w in range(6)
    }
    pairs = (("gram_coop", "coop"), ("gram_vpt", "vpt"), ("unigram", "joint"))
    rows = {r["method"]: r for r in study.summarise(cells, pairs)}
    from scipy.stats import ttest_1samp

    assert rows["gram_vpt"]["p_world_t"] == pytest.approx(ttest_1samp(weak, 0).pvalue, abs=1e-5)
    assert rows["gram_vpt"]["p_world_t"] < 0.05 < rows["gram_vpt"]["p_holm"]
    assert rows["gram_vpt"]["p_holm"] == pytest.approx(2 * rows["gram_vpt"]["p_world_t"], abs=1e-4)
    assert rows["gram_vpt"]["holds"] == "not shown" and rows["gram_coop"]["holds"] == "better"
    assert rows["gram_vpt"]["p_bootstrap"] < rows["gram_vpt"]["p_world_t"]  # the bootstrap is the lenient one


def test_bootstrap_p_is_twice_the_smaller_tail():
    stats = np.array([-1.0, 0.5, 1.0, 2.0, 3.0])  # one draw at or below 0
    assert study.bootstrap_p(stats) == pytest.approx(2 * (1 + 1) / 6)
    assert study.bootstrap_p(np.zeros(5)) == 1.0


def test_cells_name_their_switches_and_unknown_worlds_are_refused(tmp_path):
    base = DemoSettings.preset(True)
    cell = study.Cell(
        "13v",
        replace(
            study.world_settings("13v", base),
            reg_window=20,
            launch=True,
            query_before_weight=1.0,
            meta_seed=1,
            eval_split="val",
        ),
    )
    assert cell.name == "val_seed1_w20_launch1_qbw1"
    assert cell.settings.world_seed == 13 and dict(cell.settings.world)["holdout_style"] == "noisy"
    with pytest.raises(ValueError, match="--worlds: unknown world '5'"):
        study.world_settings("5", base)
    study._link(tmp_path / "cell" / "chc", tmp_path / "shared_chc")
    assert (tmp_path / "cell" / "chc").resolve() == (tmp_path / "shared_chc").resolve()
    (tmp_path / "cell2" / "chc").mkdir(parents=True)
    with pytest.raises(ValueError, match="expected a link"):
        study._link(tmp_path / "cell2" / "chc", tmp_path / "shared_chc")


def test_results_files_are_written_from_the_finished_cells(tmp_path):
    cells = {("0", 0): {("gram_coop", 1): (50.0, 40.0, 44.4), ("coop", 1): (50.0, 38.0, 43.2)}}
    result = study._write_results(tmp_path, cells, {"0/0": 12.0}, DemoSettings.preset(True))
    import json

    again = json.loads((tmp_path / "results.json").read_text())
    assert again["pairs"] == result["pairs"] and again["pairs"][0]["mean_diff_H"] == pytest.approx(1.2)
    assert again["cells"] == {"0/0": {"gram_coop/1": [50.0, 40.0, 44.4], "coop/1": [50.0, 38.0, 43.2]}}
    text = (tmp_path / "results.md").read_text()
    assert text.split("\n\nRegime")[0].count("\n") == 2  # header, rule, one pair
    assert "| paper, Table 1a (11 datasets) | 69.34 / 74.22 | 77.58 / 73.11 | 72.53 / 72.34 | +8.24 / -1.11 |" in text
    assert "| world 0 | - | 50.00 / 38.00 | - | - | - |" in text  # no zero-shot row in that cell


def _earlier_study(folder, base):
    """An earlier study's results.json in ``folder``: world 0, meta seed 0, CoOp + GRAM and CoOp, seed 1."""
    earlier = {("0", 0): {("gram_coop", 1): (50.0, 40.0, 44.4), ("coop", 1): (50.0, 38.0, 43.2)}}
    study._write_results(folder, earlier, {"0/0": 12.0}, base, book=study._Book({"0/0": NOW}, set()))
    return folder / "results.json"


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_a_study_resumes_from_an_earlier_results_file_and_runs_only_missing_cells(tmp_path, monkeypatch):
    import json
    from dataclasses import replace

    base = DemoSettings.preset(True)
    _earlier_study(tmp_path / "old", base)
    ran = []

    def fake_run_cell(cell, root, keys, world_root=None):  # stands in for the demo's stages
        ran.append((cell.world, cell.settings.meta_seed))
        return [
            {"key": "gram_coop", "seed": 1, "base": 60.0, "new": 50.0},
            {"key": "coop", "seed": 1, "base": 60.0, "new": 40.0},
        ]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    result = study.study(tmp_path / "new", ["0", "1"], [0], base, previous=tmp_path / "old" / "results.json")
    assert ran == [("1", 0)]  # world 0, seed 0 came from the file
    assert set(result["cells"]) == {"0/0", "1/0"} and result["seconds_per_cell"]["0/0"] == 12.0
    h = {w: result["cells"][f"{w}/0"]["gram_coop/1"][2] - result["cells"][f"{w}/0"]["coop/1"][2] for w in "01"}
    assert result["pairs"][0]["mean_diff_H"] == pytest.approx((h["0"] + h["1"]) / 2, abs=1e-3)
    again = study.study(tmp_path / "new", ["0", "1"], [0], base)  # default: <out>/results.json
    assert ran == [("1", 0)] and again["cells"] == json.loads((tmp_path / "new" / "results.json").read_text())["cells"]
    with pytest.raises(ValueError, match="launch"):  # another setting: not this study's cells
        study.study(
            tmp_path / "other",
            ["0"],
            [0],
            replace(base, launch=not base.launch),
            previous=tmp_path / "old" / "results.json",
        )


def test_regime_averages_each_world_and_subtracts_zero_shot():
    cells = {
        ("0", 0): {
            ("zsclip", 1): (40.0, 50.0, 0.0),
            ("coop", 1): (50.0, 44.0, 0.0),
            ("coop", 2): (52.0, 46.0, 0.0),
            ("vpt", 1): (45.0, 49.0, 0.0),
        },
        ("0", 1): {("zsclip", 1): (40.0, 50.0, 0.0), ("coop", 1): (54.0, 48.0, 0.0)},
    }
    reg = study.regime(cells)
    assert reg["0"]["coop"] == pytest.approx((52.0, 46.0)) and reg["0"]["zsclip"] == (40.0, 50.0)
    assert (
        "| world 0 | 40.00 / 50.00 | 52.00 / 46.00 | 45.00 / 49.00 | +12.00 / -4.00 | +5.00 / -1.00 |"
        in study.regime_markdown(cells)
    )


def test_gram_against_theta_only_pairs_and_zero_shot_are_study_rows():
    assert {
        ("gram_coop", "gram_coop_init_only"),
        ("gram_vpt", "gram_vpt_init_only"),
        ("unigram", "unigram_no_reg"),
    } <= set(study.PAIRS)
    assert "zsclip" in study.STUDY_KEYS


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_add_missing_rows_runs_only_the_rows_a_kept_cell_lacks(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    earlier = {("0", 0): {(k, 1): (50.0, 40.0, 44.4) for k in study.STUDY_KEYS if k != "zsclip"}}
    study._write_results(tmp_path / "old", earlier, {"0/0": 12.0}, base, book=study._Book({"0/0": NOW}, set()))
    asked = []

    def fake_run_cell(cell, root, keys, world_root=None):
        asked.append(tuple(keys))
        return [{"key": k, "seed": 1, "base": 30.0, "new": 60.0} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    kept = study.study(tmp_path / "a", ["0"], [0], base, previous=tmp_path / "old" / "results.json")
    assert asked == [] and "zsclip/1" not in kept["cells"]["0/0"]
    result = study.study(
        tmp_path / "b", ["0"], [0], base, previous=tmp_path / "old" / "results.json", add_missing_rows=True
    )
    assert asked == [("zsclip",)]
    assert result["cells"]["0/0"]["zsclip/1"] == [30.0, 60.0, 40.0]
    assert result["cells"]["0/0"]["coop/1"] == [50.0, 40.0, 44.4] and result["seconds_per_cell"]["0/0"] >= 12.0


def test_regulator_sweep_cells_and_the_written_rule():
    base = DemoSettings.preset(True)
    cell = study.Cell("0", replace(base, meta_overrides=study.REGULATOR_SWEEP["k4"], eval_split="val"), variant="k4")
    assert cell.name.endswith("_k4") and cell.meta_folder == "meta_seed0_qbw0_k4"
    assert study.Cell("0", base).meta_folder == "meta_seed0_qbw0"  # the earlier folders keep their names

    def table(gram_minus_base):
        t = {}
        for (g, b), d in zip(study.BASELINE_OF.items(), gram_minus_base):
            t[(b, 1)] = (50.0, 50.0, 50.0)
            t[(g, 1)] = (50.0 + d, 50.0 + d, 50.0 + d)
        return t

    per = {
        "k1": {("0", 0): table((1.0, -2.0, 0.0)), ("1", 0): table((0.0, 0.0, 0.0))},
        "k4": {("0", 0): table((1.0, 0.0, 0.0)), ("1", 0): table((0.0, 0.0, 0.0))},  # +0.33 over k1
        "beta_only": {("0", 0): table((3.0, 0.0, 0.0)), ("1", 0): table((3.0, 0.0, 0.0))},
    }  # +1.33 over k1
    ranked = study.rank_regulator_variants(per)
    assert [r["variant"] for r in ranked["rows"]] == ["beta_only", "k4", "k1"]
    assert ranked["rows"][0]["mean_val_diff_H"] == pytest.approx(1.0)
    assert ranked["chosen"] == "beta_only"
    partial = study.rank_regulator_variants(per, worlds=("0", "1", "2"))  # world 2 asked for, not finished
    assert partial["partial"] and partial["chosen"] == "k1" and partial["best_if_complete"] == "beta_only"
    assert "partial sweep: no default changes" in study.regulator_markdown(partial)
    assert not study.rank_regulator_variants(per, worlds=("0", "1"))["partial"]
    del per["beta_only"]
    assert study.rank_regulator_variants(per)["chosen"] == "k1"  # +0.33 H is within the 0.5 H margin
    assert "| k4 | +1.00 / +0.00 / +0.00 (+0.33) | +0.00 / +0.00 / +0.00 (+0.00) | +0.17 |" in study.regulator_markdown(
        study.rank_regulator_variants(per)
    )


def test_the_regulator_sweep_resumes_from_an_earlier_selection_file(tmp_path, monkeypatch):
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    cell = {(k, 1): (50.0, 40.0, 44.0) for k in study.BASELINE_OF.values()}
    cell.update({(k, 1): (52.0, 41.0, 45.0) for k in study.BASELINE_OF})
    study._write_regulator_result(tmp_path / "old", {"k1": {("0", 0): cell}}, ("0",), base)
    ran = []

    def fake_run_cell(cell, root, keys, world_root=None):  # stands in for the demo's stages
        ran.append((cell.world, cell.variant))
        h = 60.0 if cell.variant == "k4" else 50.0
        return [{"key": k, "seed": 1, "base": h, "new": h} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    old = tmp_path / "old" / "selection_regulator.json"
    result = study.select_regulator(tmp_path / "new", ["0", "1"], base, ("k1", "k4"), previous=old)
    # world 0's k1 came from the file; world 0 still needs k4 (and so its baselines), world 1 everything
    assert ran == [("0", ""), ("0", "k4"), ("1", ""), ("1", "k1"), ("1", "k4")]
    assert result["cells"]["k1/0/0"]["gram_coop/1"] == [52.0, 41.0, 45.0]
    assert result["worlds_done"] == ["0", "1"] and not result["partial"]
    ran.clear()
    again = study.select_regulator(tmp_path / "new", ["0", "1"], base, ("k1", "k4"))  # <out>'s own file
    assert ran == [] and again["cells"] == result["cells"]
    with pytest.raises(ValueError, match="seeds"):  # other fine-tuning seeds: not this sweep's cells
        study.select_regulator(tmp_path / "x", ["0"], replace(base, seeds=(1, 2, 3)), ("k1",), previous=old)
    old.write_text("[1, 2]")
    with pytest.raises(ValueError, match="selection_regulator.json"):
        study.select_regulator(tmp_path / "y", ["0"], base, ("k1",), previous=old)


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_deep_rows_join_kept_cells_and_get_their_own_pairs(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    _earlier_study(tmp_path / "old", base)
    ran = []

    def fake_run_cell(cell, root, keys, world_root=None):  # stands in for the demo's stages
        ran.append((cell.world, tuple(keys)))
        return [{"key": k, "seed": 1, "base": 60.0 + ("gram" in k), "new": 50.0} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    result = study.study(tmp_path / "new", ["0"], [0], base, previous=tmp_path / "old" / "results.json", deep=True)
    assert ran == [("0", study.DEEP_STUDY_KEYS)]  # the kept cell runs the deep rows only
    assert {"ivlp", "gram_maple_init_only"} <= set(study.DEEP_STUDY_KEYS)
    pairs = {(r["method"], r["baseline"]): r for r in result["pairs"]}
    h_gram, h_base = (2 * 61 * 50 / 111), (2 * 60 * 50 / 110)  # H of base 61 / new 50 against 60 / 50
    assert pairs[("gram_ivlp", "ivlp")]["mean_diff_H"] == pytest.approx(h_gram - h_base, abs=1e-3)
    assert pairs[("gram_maple", "gram_maple_init_only")]["mean_diff_H"] == pytest.approx(0.0, abs=1e-3)
    assert ("gram_coop", "coop") in pairs  # the kept shallow pair is still summarised
    ran.clear()
    study.study(tmp_path / "new", ["0"], [0], base, deep=True)  # now complete: nothing runs
    assert ran == []


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_cells_record_the_start_they_came_from_and_keep_it_across_a_resume(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)

    def record(key, seed, sha, fingerprint="fp0"):
        init = {"prompt_sha256": sha, "provenance": {"hierarchy": {"fingerprint": fingerprint}}} if sha else {}
        return {"key": key, "seed": seed, "base": 50.0, "new": 40.0, "init": init}

    records = [record("gram_coop", 1, "aa"), record("gram_coop", 2, "aa"), record("coop", 1, None)]
    assert study.cell_inputs(records) == {"hierarchy": ["fp0"], "start_sha256": {"gram_coop": "aa"}}

    def fake_run_cell(cell, root, keys, world_root=None):
        return [record(k, 1, f"{cell.world}-{k}" if k.startswith("gram") else None) for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    first = study.study(tmp_path / "s", ["0"], [0], base)
    assert first["inputs"]["0/0"]["start_sha256"]["gram_coop"] == "0-gram_coop"
    assert first["inputs"]["0/0"]["hierarchy"] == ["fp0"]
    again = study.study(tmp_path / "s", ["0", "1"], [0], base)  # world 0 kept from the file, world 1 run
    assert again["inputs"]["0/0"] == first["inputs"]["0/0"]
    assert again["inputs"]["1/0"]["start_sha256"]["gram_vpt"] == "1-gram_vpt"
    # a cell whose rows load no init file (here: only zero-shot added to a cell kept without inputs) gets no entry
    _earlier_study(tmp_path / "old", base)
    monkeypatch.setattr(study, "run_cell", lambda cell, root, keys, world_root=None: [record("zsclip", 1, None)])
    added = study.study(
        tmp_path / "z", ["0"], [0], base, previous=tmp_path / "old" / "results.json", add_missing_rows=True
    )
    assert "0/0" in added["cells"] and added["inputs"] == {}


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_a_study_of_a_regulator_variant_keeps_its_own_cells_and_file(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    seen = []

    def fake_run_cell(cell, root, keys, world_root=None):
        seen.append((cell.variant, cell.settings.meta_overrides, cell.meta_folder))
        return [{"key": k, "seed": 1, "base": 50.0, "new": 40.0} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    result = study.study(tmp_path, ["0"], [0], base, variant="k4")
    assert seen == [("k4", study.REGULATOR_SWEEP["k4"], "meta_seed0_qbw0_k4")]
    assert result["settings"]["regulator_variant"] == "k4"
    assert (tmp_path / "results_k4.json").is_file() and (tmp_path / "results_k4.md").is_file()
    assert not (tmp_path / "results.json").exists()
    with pytest.raises(ValueError, match="regulator_variant"):  # its cells are not today's study's
        study.study(tmp_path, ["0"], [0], base, previous=tmp_path / "results_k4.json")
    study.study(tmp_path, ["0"], [0], base, variant="k1")  # k1 is today's study: results.json
    assert "regulator_variant" not in json.loads((tmp_path / "results.json").read_text())["settings"]


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_reg_adds_rows_run_only_each_gram_row_and_its_theta_only_row(tmp_path, monkeypatch, capsys):
    """``--rows reg-adds``: a new cell runs the six rows of the "GRAM vs θ* only" pairs and is summarised on
    those pairs (H from the records, computed here independently); a kept cell with every row stays as it is."""
    base = DemoSettings.preset(True)
    assert study.REG_ADDS_PAIRS == (
        ("gram_coop", "gram_coop_init_only"),
        ("gram_vpt", "gram_vpt_init_only"),
        ("unigram", "unigram_no_reg"),
    )
    ran = []

    def fake_run_cell(cell, root, keys, world_root=None):
        ran.append((cell.world, tuple(keys)))
        regulated = {"gram_coop", "gram_vpt", "unigram"}
        return [{"key": k, "seed": 1, "base": 60.0 if k in regulated else 58.0, "new": 50.0} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    result = study.study(tmp_path, ["0"], [0], base, variant="k4", rows="reg-adds")
    assert ran == [("0", study.REG_ADDS_KEYS)] and len(study.REG_ADDS_KEYS) == 6
    pairs = {(r["method"], r["baseline"]): r for r in result["pairs"]}
    assert set(pairs) == set(study.REG_ADDS_PAIRS)  # no baseline rows, so no other pair is summarised
    h = lambda b, n: 2 * b * n / (b + n)  # noqa: E731
    assert pairs[("unigram", "unigram_no_reg")]["mean_diff_H"] == pytest.approx(h(60, 50) - h(58, 50), abs=1e-3)
    ran.clear()
    study.study(tmp_path, ["0"], [0], base, variant="k4", rows="reg-adds", add_missing_rows=True)
    assert ran == []  # the cell holds every row reg-adds asks for
    with pytest.raises(ValueError, match="--rows"):
        study.study(tmp_path, ["0"], [0], base, rows="some")
    assert study.main(["run", "--variants", "k1", "k4", "--out", str(tmp_path)]) == 2
    assert "run takes one variant" in capsys.readouterr().err


def test_unknown_regulator_variants_are_refused_by_every_command(tmp_path, capsys):
    assert study.study_variant("k1") == "" and study.study_variant("") == ""
    assert study.study_variant("k4") == "k4"
    # a variant of the committed sweep whose option was removed: refused with the option it needed
    with pytest.raises(ValueError, match="--variants: beta_only needs META.REGULATOR.HALVES, which was removed"):
        study.study_variant("beta_only")
    refused = "--variants: unknown beta; known: k1, k4"
    for call in (
        lambda: study.study(tmp_path, ["0"], [0], DemoSettings.preset(True), variant="beta"),
        lambda: study.select_regulator(tmp_path, ["0"], DemoSettings.preset(True), variants=("k1", "beta")),
    ):
        with pytest.raises(ValueError, match=refused):
            call()
    assert study.main(["travel", "--worlds", "0", "--variants", "beta", "--out", str(tmp_path)]) == 2
    assert refused in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before any stage ran or any file was written


def test_travel_of_a_variant_has_its_own_file_and_reads_that_variants_cells(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_travel_cell(cell, root, keys=study.TRAVEL_KEYS, seed=1, datasets=None, world_root=None):
        seen.append((cell.world, cell.settings.meta_seed, cell.variant, cell.meta_folder, cell.settings.eval_split))
        return [{"dataset": "D", "key": "gram_coop", "seed": seed, "beta_share": 0.25, "beta_projection": 0.1}]

    monkeypatch.setattr(study, "travel_cell", fake_travel_cell)
    argv = ["travel", "--worlds", "0", "3", "--meta-seeds", "0", "--out", str(tmp_path), "--quick"]
    assert study.main(argv + ["--variants", "k4"]) == 0
    assert seen == [
        ("0", 0, "k4", "meta_seed0_qbw0_k4", "test"),
        ("3", 0, "k4", "meta_seed0_qbw0_k4", "test"),
    ]
    assert study.main(argv) == 0  # today's meta-training: travel.json, the study's own meta folders
    assert seen[-1] == ("3", 0, "", "meta_seed0_qbw0", "test")
    variant = json.loads((tmp_path / "travel_k4.json").read_text())
    today = json.loads((tmp_path / "travel.json").read_text())
    assert [r["world"] for r in variant["records"]] == ["0", "3"] and variant["split"] == "test"
    assert {r["variant"] for r in variant["records"]} == {"k4"}
    assert {r["variant"] for r in today["records"]} == {""}
    out = capsys.readouterr().out
    assert "gram_coop              beta share of the travel 0.250 (projection +0.100), 2 runs" in out
    # a later call adds its cells to the file and measures again only the cells it names
    assert study.main(["travel", "--worlds", "1", "3", "--meta-seeds", "0", "--out", str(tmp_path), "--quick"]) == 0
    today = json.loads((tmp_path / "travel.json").read_text())
    assert sorted(r["world"] for r in today["records"]) == ["0", "1", "3"] and seen[-2][0] == "1"
    assert study.main(argv + ["--seeds", "2"]) == 2  # another fine-tuning seed: not this file's cells
    assert "fine-tuning seed 1" in capsys.readouterr().err


def test_a_pairs_mean_h_is_taken_over_the_units_its_difference_is():
    """A cell holding only one row of a pair (a reg-adds cell beside a full one) does not enter that pair's H
    means: mean H of the method minus that of the baseline is the pair's mean difference."""
    full = {("gram_coop", 1): (50.0, 40.0, 44.0), ("coop", 1): (50.0, 38.0, 43.0)}
    reg_adds_only = {("gram_coop", 1): (70.0, 60.0, 64.0), ("gram_coop_init_only", 1): (70.0, 61.0, 65.0)}
    (row,) = [r for r in study.summarise({("0", 0): full, ("1", 0): reg_adds_only}) if r["baseline"] == "coop"]
    assert (row["mean_H"], row["baseline_mean_H"], row["mean_diff_H"]) == (44.0, 43.0, 1.0)
    assert row["worlds"] == ["0"] and row["n"] == 1


def _fake_cell(monkeypatch, ran):
    def fake_run_cell(cell, root, keys, world_root=None):
        ran.append((cell.world, tuple(keys)))
        return [{"key": k, "seed": 1, "base": 60.0, "new": 50.0} for k in keys]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_cells_record_what_computed_them_and_other_fingerprints_are_not_pooled(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    ran: list = []
    _fake_cell(monkeypatch, ran)
    first = study.study(tmp_path / "s", ["0"], [0], base)
    assert first["computed_by"] == {"0/0": NOW} and first["mixed_fingerprints"] == []
    # the same file read on a machine (or code) of another fingerprint: refused in one line, nothing written
    other = {**NOW, "fingerprint": "e" * 64}
    monkeypatch.setattr(study, "current_provenance", lambda: other)
    before = (tmp_path / "s" / "results.json").read_text()
    with pytest.raises(ValueError, match=r"cells 0/0 were computed at numerics fingerprint ffffffffffff, this machine"):
        study.study(tmp_path / "s", ["0", "1"], [0], base)
    assert (tmp_path / "s" / "results.json").read_text() == before and len(ran) == 1
    # asked to mix: kept, named in both files; the new cell records the new fingerprint
    mixed = study.study(tmp_path / "s", ["0", "1"], [0], base, mix_fingerprints=True)
    assert mixed["mixed_fingerprints"] == ["0/0"]
    assert mixed["computed_by"]["0/0"] == NOW and mixed["computed_by"]["1/0"] == other
    assert (
        "Mixed numerics fingerprints** (kept with --mix-fingerprints): cells 0/0"
        in (tmp_path / "s" / "results.md").read_text()
    )


@pytest.mark.usefixtures("few_bootstrap_draws")
def test_a_kept_cell_that_gains_rows_at_another_fingerprint_is_mixed(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    ran: list = []
    _fake_cell(monkeypatch, ran)
    _earlier_study(tmp_path / "old", base)
    other = {**NOW, "fingerprint": "e" * 64}
    monkeypatch.setattr(study, "current_provenance", lambda: other)
    old = tmp_path / "old" / "results.json"
    result = study.study(tmp_path / "n", ["0"], [0], base, previous=old, add_missing_rows=True, mix_fingerprints=True)
    assert len(ran) == 1 and result["mixed_fingerprints"] == ["0/0"]
    assert result["computed_by"]["0/0"]["fingerprint"] == other["fingerprint"]
    assert result["computed_by"]["0/0"]["earlier"] == NOW


def test_cells_without_a_record_count_as_another_fingerprint(tmp_path, monkeypatch):
    base = DemoSettings.preset(True)
    earlier = {("0", 0): {("coop", 1): (50.0, 38.0, 43.2)}}
    study._write_results(tmp_path / "old", earlier, {"0/0": 1.0}, base)  # a file from before cells were recorded
    with pytest.raises(ValueError, match="cells 0/0 were computed at numerics fingerprint none"):
        study.study(tmp_path / "n", ["0"], [0], base, previous=tmp_path / "old" / "results.json")
