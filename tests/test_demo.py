"""The demo's table logic: every paper row present, mean ± std over seeds, H of the means."""
import json
import statistics

import pytest

from meta.coop_data import harmonic_mean
from meta.demo import EVAL_METHODS, META_VARIANTS, DemoSettings, _check_settings, markdown_table, table_rows


def _records():
    out = []
    for d_i, dataset in enumerate(("WorldA", "WorldB")):
        for m_i, (label, _, _) in enumerate(EVAL_METHODS):
            for seed in (1, 2, 3):
                base = 40 + m_i + 3 * seed + d_i
                new = 30 + 0.5 * m_i - seed + 2 * d_i
                out.append({"protocol": "base2new", "dataset": dataset, "method": label, "seed": seed,
                            "base": base, "new": new, "H": harmonic_mean(base, new), "history": []})
    return out


def test_table_has_every_paper_row_with_independent_statistics():
    rows = table_rows(_records())
    labels = [label for label, _, _ in EVAL_METHODS]
    for required in ("CLIP (zero-shot)", "CoOp", "CoOp + GRAM", "VPT", "VPT + GRAM", "UNIGRAM",
                     "- domain shift simulating", "- gradient regulating", "- meta-learning = prompt pre-training",
                     "- CHC = supervised meta-learning", "joint textual & visual tuning"):
        assert required in labels
        for dataset in ("WorldA", "WorldB", "Average"):
            assert any(r["method"] == required and r["dataset"] == dataset for r in rows), (required, dataset)
    recs = _records()
    for row in rows:
        if row["dataset"] == "Average":
            per_seed = [statistics.fmean(r["base"] for r in recs if r["method"] == row["method"] and r["seed"] == s)
                        for s in (1, 2, 3)]
        else:
            per_seed = [r["base"] for r in recs if r["method"] == row["method"] and r["dataset"] == row["dataset"]]
        assert row["base_mean"] == pytest.approx(statistics.fmean(per_seed))
        assert row["base_std"] == pytest.approx(statistics.pstdev(per_seed))
        assert row["H"] == pytest.approx(2 * row["base_mean"] * row["new_mean"] / (row["base_mean"] + row["new_mean"]))
    md = markdown_table(rows, "Average")
    assert md.count("\n") == len(EVAL_METHODS) + 1 and "± " in md


def test_every_gram_row_has_a_meta_variant_and_presets_exist():
    from meta.evaluation import PRESET_NAMES

    variants = {v.name for v in META_VARIANTS}
    for _, preset, variant in EVAL_METHODS:
        assert preset in PRESET_NAMES
        assert variant is None or variant in variants


def test_changed_settings_are_refused(tmp_path):
    _check_settings(DemoSettings.preset(quick=True), tmp_path)
    _check_settings(DemoSettings.preset(quick=True), tmp_path)  # same settings: fine
    from meta.cli_errors import UserError

    with pytest.raises(UserError, match="other settings"):
        _check_settings(DemoSettings.preset(quick=False), tmp_path)
    assert json.loads((tmp_path / "demo_settings.json").read_text())["quick"] is True


def test_dumped_meta_config_reloads(tmp_path):
    """A run's saved config.yaml must merge back (yacs dumps "{}" as a yaml dict)."""
    from meta.config import get_meta_cfg_default, load_meta_cfg

    path = tmp_path / "config.yaml"
    path.write_text(get_meta_cfg_default().dump())
    assert load_meta_cfg(str(path)) == get_meta_cfg_default()
