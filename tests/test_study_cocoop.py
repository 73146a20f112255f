"""``python -m gram_world.study_cocoop`` (gram_world/study_cocoop.py): the plan's draw, size and family, the rows
each world runs, the results file (Holm over the four pairs) and resuming.  No stage runs: ``run_cell`` is a
stand-in (tests/helpers.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import fake_run_cell, worlds_in

from gram_world import confirm, study, study_testtime
from gram_world import study_cocoop as sc

REPO = Path(__file__).resolve().parents[1]
NOW = {"commit": "abc", "fingerprint": "e" * 64, "golden": True, "numerics": {"cpu_model": "test CPU"}}


def test_the_draw_excludes_every_world_read_before_and_is_written_out_as_drawn():
    used = set()
    # the study's own results hold its drawn worlds, not worlds read before the draw; the test-time study was drawn
    # after this one, excluding its worlds (tests/test_study_testtime.py checks that draw)
    later = {REPO / "docs/study" / sc.RESULTS_FILE, REPO / "docs/study" / study_testtime.RESULTS_FILE}
    for path in sorted((REPO / "docs/study").glob("*.json")):
        if path not in later:
            used |= worlds_in(json.loads(path.read_text()))
    assert set(study_testtime.USED_WORLDS) >= set(sc.WORLDS)
    seeds_used = {int(w.split("-")[0]) for w in used if w.split("-")[0].isdigit()}
    assert seeds_used, "no world found in docs/study"
    listed = {int(w.split("-")[0].rstrip("v")) for w in sc.USED_WORLDS}
    in_range = {s for s in seeds_used if confirm.SEED_RANGE[0] <= s < confirm.SEED_RANGE[1]}
    assert in_range <= listed, f"worlds read before but not excluded: {sorted(in_range - listed)}"
    assert sc.WORLDS == confirm.draw_worlds(sc.WORLD_COUNT, sc.DRAW_SEED, sc.USED_WORLDS, held_out_style=False)
    assert len(set(sc.WORLDS)) == sc.WORLD_COUNT and not {int(w) for w in sc.WORLDS} & (listed | seeds_used)


def test_the_planned_size_is_the_power_calculation_on_the_committed_pilot():
    pilot = json.loads((REPO / sc.PILOT_FILE).read_text())
    pair, variance = sc.pilot_variance(pilot)
    comps = pilot["variance_components"][pair]
    # the world mean of 1 meta seed x 3 fine-tuning seeds: σ²_w + σ²_f / 3 (no meta component with one meta seed)
    assert variance == pytest.approx((comps["world"] or 0) + (comps.get("meta") or 0) + comps["finetune"] / 3)
    others = [power_of for p in sc.PILOT_PAIRS for power_of in [pilot["variance_components"][p]]]
    assert variance >= max((c["world"] or 0) + c["finetune"] / 3 for c in others) - 1e-9
    assert sc.planned_worlds(pilot) == sc.WORLD_COUNT
    from gram_world import power

    alpha = sc.ALPHA / len(sc.PAIRS)
    assert (
        power.power(sc.WORLD_COUNT, variance, 1.0, alpha) >= 0.8 > power.power(sc.WORLD_COUNT - 1, variance, 1.0, alpha)
    )
    text = sc.plan_text(pilot)
    assert f"{sc.WORLD_COUNT}; power at {sc.WORLD_COUNT} worlds" in text and ", ".join(sc.WORLDS) in text
    with pytest.raises(ValueError, match="no variance components for gram_coop vs coop"):
        sc.pilot_variance({"variance_components": {}})


def test_a_world_runs_the_family_and_regime_rows_once_and_holm_covers_the_four_pairs(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)
    full = study.bootstrap_means
    monkeypatch.setattr(study, "bootstrap_means", lambda groups, draws=200, seed=0: full(groups, draws, seed))
    ran: list = []
    shift = {"282166": 0.0, "378549": 1.0, "913060": -0.6}

    def effect(world, variant, key, seed):  # GRAM's two rows 1.5 H above CoCoOp; CoCoOp moves with the world
        return 1.5 * key.startswith("gram_cocoop") + shift[world] * (key == "cocoop") + 0.2 * seed * (key == "coop")

    monkeypatch.setattr(study, "run_cell", fake_run_cell(ran, effect))
    from gram_world.demo.settings import DemoSettings

    base = replace(DemoSettings.preset(True), seeds=(1, 2, 3))
    record = sc.study_record(base)
    worlds = list(shift)

    def run():
        return confirm.run_family(
            tmp_path, worlds, sc.META_SEEDS, base, sc.PAIRS, sc.BY_LEARNER, record, sc.RESULTS_FILE, sc.PLAN, sc.REGIME
        )

    result = run()
    keys = ("zsclip", "coop", "gram_cocoop", "cocoop", "gram_cocoop_init_only")
    assert [r[:3] for r in ran] == [(w, "", keys) for w in worlds]  # one plain cell per world, no VPT row
    rows = {(r["method"], r["baseline"]): r for r in result["pairs"]}
    assert list(rows) == list(sc.PAIRS) and {r["family"] for r in rows.values()} == {4}
    gram = rows[("gram_cocoop", "cocoop")]  # per world 1.5 - shift
    assert gram["mean_diff_H"] == pytest.approx(1.5 - np.mean(list(shift.values())), abs=1e-3)  # rounded to 3
    assert rows[("gram_cocoop", "gram_cocoop_init_only")]["mean_diff_H"] == pytest.approx(0.0)
    ps = [r["p_world_t"] for r in result["pairs"]]
    assert [r["p_holm"] for r in result["pairs"]] == pytest.approx(study.holm(ps), abs=1e-4)
    assert result["plan"] == sc.PLAN and result["settings"]["family"] == [list(p) for p in sc.PAIRS]
    (line,) = result["answer"]
    assert line.startswith("CoCoOp (3 worlds, Holm over 4 pairs): ")
    saved = json.loads((tmp_path / sc.RESULTS_FILE).read_text())
    assert saved["cells"] == result["cells"] and (tmp_path / "cocoop.md").read_text().startswith(f"- {line}\n")
    ran.clear()
    assert run()["cells"] == result["cells"] and ran == []  # every finished world kept
    record["family"] = record["family"][:3]
    with pytest.raises(ValueError, match="family"):
        run()


def test_the_command_resumes_on_a_new_machine_from_a_committed_partial_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)
    ran: list = []
    monkeypatch.setattr(study, "run_cell", fake_run_cell(ran, lambda w, v, k, s: 1.0 * (k == "gram_cocoop")))
    first = tmp_path / "first"
    assert sc.main(["run", "--quick", "--out", str(first), "--worlds", "282166", "378549"]) == 0
    assert len(ran) == 2 and "study_cocoop: 2 worlds" in capsys.readouterr().out
    ran.clear()
    argv = ["run", "--quick", "--out", str(tmp_path / "new"), "--worlds", "282166", "378549", "913060"]
    assert sc.main([*argv, "--resume-from", str(first / sc.RESULTS_FILE)]) == 0
    assert [r[0] for r in ran] == ["913060"]  # only the world the partial file lacks
    saved = json.loads((tmp_path / "new" / sc.RESULTS_FILE).read_text())
    assert sorted(saved["cells"]) == ["282166/0", "378549/0", "913060/0"]
