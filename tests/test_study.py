"""gram_world.study: per-cell H, paired differences and the two-level bootstrap, checked against hand
computations and the normal approximation."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gram_world import study
from gram_world.demo.settings import DemoSettings


def _record(key, seed, base, new, dataset="d"):
    return {"key": key, "seed": seed, "base": base, "new": new, "dataset": dataset}


def test_cell_h_averages_base_and_new_over_datasets_before_the_harmonic_mean():
    records = [_record("coop", 1, 60.0, 40.0, "a"), _record("coop", 1, 80.0, 20.0, "b"),
               _record("coop", 2, 50.0, 50.0, "a")]
    table = study.cell_h(records)
    base, new = 70.0, 30.0
    assert table[("coop", 1)] == pytest.approx((base, new, 2 * base * new / (base + new)))
    assert table[("coop", 2)] == pytest.approx((50.0, 50.0, 50.0))


def test_paired_differences_pair_rows_by_fine_tuning_seed_and_skip_missing_rows():
    cells = {("0", 0): {("gram_coop", 1): (0, 0, 50.0), ("coop", 1): (0, 0, 48.0),
                        ("gram_coop", 2): (0, 0, 40.0), ("coop", 2): (0, 0, 45.0),
                        ("gram_vpt", 1): (0, 0, 30.0)},
             ("0", 1): {("gram_coop", 1): (0, 0, 41.0), ("coop", 1): (0, 0, 40.0)},
             ("1", 0): {("gram_coop", 1): (0, 0, 10.0), ("coop", 1): (0, 0, 13.0)}}
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
    cells = {(w, 0): {row: value for s in (1, 2) for row, value in (
                 (("gram_coop", s), (0, 0, 50.0 + d)), (("coop", s), (0, 0, 50.0)),
                 (("gram_vpt", s), (0, 0, 50.0 - d)), (("vpt", s), (0, 0, 50.0)),
                 (("unigram", s), (0, 0, 50.0 + (d if s == 1 else -d))), (("joint", s), (0, 0, 50.0)))}
             for w, d in (("0", 1.0), ("1", 2.0))}
    rows = {r["method"]: r for r in study.summarise(cells, (("gram_coop", "coop"), ("gram_vpt", "vpt"),
                                                           ("unigram", "joint")))}
    assert rows["gram_coop"]["holds"] == "better" and rows["gram_coop"]["mean_diff_H"] == pytest.approx(1.5)
    assert rows["gram_vpt"]["holds"] == "worse" and rows["gram_vpt"]["n"] == 4
    assert rows["unigram"]["holds"] == "not shown" and rows["unigram"]["worlds"] == ["0", "1"]
    table = study.markdown(list(rows.values()))
    assert rows["gram_coop"]["mean_H"] == pytest.approx(51.5) and rows["gram_coop"]["baseline_mean_H"] == 50.0
    assert f"| {rows['gram_coop']['label']} | {rows['gram_coop']['baseline_label']} | 51.50 / 50.00 | +1.50 |" in table
    assert "holds: worse" in table and "not shown" in table


def test_cells_name_their_switches_and_unknown_worlds_are_refused(tmp_path):
    base = DemoSettings.preset(True)
    cell = study.Cell("13v", replace(study.world_settings("13v", base), reg_window=20, launch=True,
                                     query_before_weight=1.0, meta_seed=1, eval_split="val"))
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
    assert (tmp_path / "results.md").read_text().count("\n") == 3


def test_a_study_resumes_from_an_earlier_results_file_and_runs_only_missing_cells(tmp_path, monkeypatch):
    import json
    from dataclasses import replace

    base = DemoSettings.preset(True)
    earlier = {("0", 0): {("gram_coop", 1): (50.0, 40.0, 44.4), ("coop", 1): (50.0, 38.0, 43.2)}}
    study._write_results(tmp_path / "old", earlier, {"0/0": 12.0}, base)
    ran = []

    def fake_run_cell(cell, root, keys, world_root=None):   # stands in for the demo's stages
        ran.append((cell.world, cell.settings.meta_seed))
        return [{"key": "gram_coop", "seed": 1, "base": 60.0, "new": 50.0},
                {"key": "coop", "seed": 1, "base": 60.0, "new": 40.0}]

    monkeypatch.setattr(study, "run_cell", fake_run_cell)
    result = study.study(tmp_path / "new", ["0", "1"], [0], base, previous=tmp_path / "old" / "results.json")
    assert ran == [("1", 0)]                                        # world 0, seed 0 came from the file
    assert set(result["cells"]) == {"0/0", "1/0"} and result["seconds_per_cell"]["0/0"] == 12.0
    h = {w: result["cells"][f"{w}/0"]["gram_coop/1"][2] - result["cells"][f"{w}/0"]["coop/1"][2] for w in "01"}
    assert result["pairs"][0]["mean_diff_H"] == pytest.approx((h["0"] + h["1"]) / 2, abs=1e-3)
    again = study.study(tmp_path / "new", ["0", "1"], [0], base)    # default: <out>/results.json
    assert ran == [("1", 0)] and again["cells"] == json.loads((tmp_path / "new" / "results.json").read_text())["cells"]
    with pytest.raises(ValueError, match="launch"):                 # another setting: not this study's cells
        study.study(tmp_path / "other", ["0"], [0], replace(base, launch=not base.launch),
                    previous=tmp_path / "old" / "results.json")
