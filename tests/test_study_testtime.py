"""``python -m gram_world.study_testtime`` (gram_world/study_testtime.py) and the demo's val / transfer-only test-time
runs it reads: the draw and size of docs/study/testtime_plan.md, the written rule of
docs/study/testtime_selection_rule.md on hand-made cells, the family's summary (Holm over four pairs), resuming and
the refusal without a selection file.  No stage runs: the test-time records are stand-ins."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import one_error_line, worlds_in

from gram_world import confirm, power, study
from gram_world import study_testtime as st
from gram_world.demo import stages
from gram_world.demo.settings import TESTTIME_BY_KEY, VARIANT_BY_NAME, DemoSettings, settings_hash, settings_record
from gram_world.demo.stages import EvalJob, _variant_cfg

REPO = Path(__file__).resolve().parents[1]
NOW = {"commit": "abc", "fingerprint": "e" * 64, "golden": True, "numerics": {"cpu_model": "test CPU"}}


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)


def fake_records(ran: list, effect):
    """A stand-in for ``study_testtime.testtime_records``: a transfer record per row and seed, accuracy 50 +
    ``effect(world, row, seed)`` on one target (zero-shot CLIP without a test-time part, as its real record)."""

    def fake(cell, root, keys, world_root=None):
        s = cell.settings
        ran.append((cell.world, cell.name, tuple(keys), s.testtime_steps, s.meta_overrides, s.eval_split))
        out = []
        for key in keys:
            for seed in s.seeds:
                acc = 50.0 + effect(cell.world, key, seed)
                record = {"protocol": "transfer", "test_time_row": key, "seed": seed, "key": key, "targets": {"T": acc}}
                if key != "zsclip":
                    tuned = {"accuracy": acc, "accuracy_before": acc - 2, "ece": 7.0, "ece_before": 5.0}
                    record["test_time"] = {"sets": {"T": {**tuned, "seconds_per_image": 0.01}}}
                out.append(record)
        return out

    return fake


# ------------------------------------------------------------------------------ the plan's draw and size
def test_the_draw_excludes_every_world_read_before_and_is_written_out_as_drawn():
    used = set()
    for path in sorted((REPO / "docs/study").glob("*.json")):
        if not path.name.startswith("testtime"):  # the study's own files hold its drawn worlds
            used |= worlds_in(json.loads(path.read_text()))
    seeds_used = {int(w.split("-")[0].rstrip("v")) for w in used if w.split("-")[0].rstrip("v").isdigit()}
    listed = {int(w.split("-")[0].rstrip("v")) for w in st.USED_WORLDS}
    in_range = {s for s in seeds_used if confirm.SEED_RANGE[0] <= s < confirm.SEED_RANGE[1]}
    assert in_range and in_range <= listed, f"worlds read before but not excluded: {sorted(in_range - listed)}"
    assert set(st.USED_WORLDS) >= set(confirm.CONFIRM_WORLDS) | set(st.study_cocoop.WORLDS)
    assert st.WORLDS == confirm.draw_worlds(st.WORLD_COUNT, st.DRAW_SEED, st.USED_WORLDS, held_out_style=False)
    assert len(set(st.WORLDS)) == st.WORLD_COUNT and not {int(w) for w in st.WORLDS} & (listed | seeds_used)


def test_the_count_is_the_power_calculation_on_the_pilot_capped_by_the_cost():
    pilot = json.loads((REPO / st.PILOT_FILE).read_text())
    pair, variance = st.pilot_variance(pilot)
    # recomputed by hand: the world mean of one meta seed x 3 fine-tuning seeds of the new-class accuracy difference
    cells = {n: {k: [0, 0, v[1]] for k, v in t.items()} for n, t in pilot["cells"].items()}
    by_pair = {}
    for m, b in st.PILOT_PAIRS:
        c = power.variance_components(power.differences(cells, m, b))
        by_pair[f"{m} vs {b}"] = c["world"] + c["finetune"] / 3
    assert pair == max(by_pair, key=by_pair.get) and variance == pytest.approx(by_pair[pair])
    alpha = st.ALPHA / len(st.PAIRS)
    needed = st.planned_worlds(pilot)
    assert power.power(needed, variance, 1.0, alpha) >= 0.8 > power.power(needed - 1, variance, 1.0, alpha)
    cost = 89 + 274 + 83 + 25 + 2 * 955 + 3 * 1200 * (0.078 + 0.030 + 4 * 0.025)
    assert sum(st.COST_S.values()) == pytest.approx(cost)
    assert st.WORLD_CAP == int(8 * 3600 // cost) and st.WORLD_CAP * cost <= 8 * 3600 < (st.WORLD_CAP + 1) * cost
    assert st.WORLD_COUNT == min(needed, st.WORLD_CAP)
    mdd = st.detectable(st.WORLD_COUNT, variance)
    assert (
        power.power(st.WORLD_COUNT, variance, mdd, alpha)
        >= 0.8
        > power.power(st.WORLD_COUNT, variance, mdd - 0.02, alpha)
    )
    text = st.plan_text(pilot)
    assert f"Worlds run: {st.WORLD_COUNT}" in text and ", ".join(st.WORLDS) in text and f"{mdd:.2f} points" in text


# ------------------------------------------------------------------------------ the rule
def _cells(means: dict, worlds=st.SELECT_WORLDS, seeds=st.SELECT_SEEDS, rows=st.TT_GRAM_ROWS) -> dict:
    """Cells whose rows average to ``means[choice]``: tt_gram 1 below, the prototype row 1 above, seeds ±0.5."""
    out = {}
    for name, mean in means.items():
        for w in worlds:
            table = {}
            for row in rows:
                for s in seeds:
                    acc = mean + (1.0 if row == "tt_gram_proto" else -1.0) + (s - 2) * 0.5
                    table[(row, s)] = (acc - 3, 5.0, acc)
            out.setdefault(name, {})[(w, 0)] = table
    return out


def test_the_rule_picks_the_highest_mean_and_breaks_ties_by_fewer_steps_then_fewer_views():
    names = [c.name for c in st.CHOICES]
    assert names == ["steps1_views8", "steps1_views16", "steps2_views8", "steps2_views16"]
    # within 0.1 of the best (steps2_views16): steps2_views8 only; the same steps, so fewer views
    got = st.rank_choices(_cells(dict(zip(names, (50.0, 50.05, 50.3, 50.35)))))
    assert got["chosen"] == "steps2_views8" and not got["partial"]
    assert {r["choice"]: r["mean_accuracy"] for r in got["choices"]}["steps2_views16"] == pytest.approx(50.35)
    assert got["choices"][3]["per_row"] == {"tt_gram": pytest.approx(49.35), "tt_gram_proto": pytest.approx(51.35)}
    # exactly 0.1 below ties (inclusive); fewer steps first
    assert st.rank_choices(_cells(dict(zip(names, (50.0, 50.25, 50.3, 50.35)))))["chosen"] == "steps1_views16"
    assert st.rank_choices(_cells(dict(zip(names, (50.0, 50.24, 50.3, 50.35)))))["chosen"] == "steps2_views8"
    # a clear winner
    assert st.rank_choices(_cells(dict(zip(names, (52.0, 50.0, 50.0, 51.0)))))["chosen"] == "steps1_views8"
    # averaged over worlds: world 1 pulls steps1_views8 below
    cells = _cells(dict(zip(names, (51.0, 50.0, 50.0, 50.0))))
    cells["steps1_views8"][("1", 0)] = {k: (0, 0, v[2] - 4.0) for k, v in cells["steps1_views8"][("1", 0)].items()}
    assert st.rank_choices(cells)["chosen"] == "steps1_views16"  # 49.0 against 50.0: ties go to fewer views


def test_a_partial_or_off_rule_sweep_chooses_nothing_and_says_what_the_rule_would_pick():
    names = [c.name for c in st.CHOICES]
    cells = _cells(dict(zip(names, (50.0, 51.0, 50.0, 50.0))))
    del cells["steps2_views16"][("1", 0)][("tt_gram_proto", 3)]
    got = st.rank_choices(cells)
    assert got["chosen"] is None and got["best_if_complete"] == "steps1_views16"
    assert got["partial"] and got["missing"] == ["steps2_views16/1"]
    full = _cells(dict(zip(names, (50.0, 51.0, 50.0, 50.0))))
    off = st.rank_choices(full, st.off_rule(DemoSettings.preset(True)))
    assert off["chosen"] is None and "the demo's --quick settings" in off["off_rule"]
    one = st.rank_choices(
        _cells(dict(zip(names, (50.0,) * 4)), seeds=(1,)), st.off_rule(DemoSettings(seeds=(1,))), (1,)
    )
    assert not one["partial"] and one["off_rule"] == ["fine-tuning seeds 1, the rule's are 1 2 3"] and not one["chosen"]
    assert "the rule would pick steps1_views16" in st.selection_markdown({**off, **st.selection_record(DemoSettings())})


def test_the_cache_rule_picks_the_highest_mean_and_breaks_ties_by_fewer_views():
    names = [c.name for c in st.CACHE_CHOICES]
    assert names == ["cache_views1", "cache_views64"]
    rows = (st.CACHE_ROW,)
    # tda_cache 1 below the mean, seeds +-0.5: the mean over seeds is the choice's mean minus 1
    got = st.rank_cache_views(_cells(dict(zip(names, (50.0, 50.35))), rows=rows))
    assert got["chosen"] == "cache_views64" and not got["partial"] and got["rule"] == st.CACHE_RULE
    by = {r["choice"]: r for r in got["choices"]}
    assert by["cache_views64"]["mean_accuracy"] == pytest.approx(49.35)
    assert by["cache_views64"]["zero_shot_per_world"] == {"0": pytest.approx(46.35), "1": pytest.approx(46.35)}
    # exactly 0.1 below ties (inclusive) and goes to fewer views; 0.11 below does not
    assert st.rank_cache_views(_cells(dict(zip(names, (50.25, 50.35))), rows=rows))["chosen"] == "cache_views1"
    assert st.rank_cache_views(_cells(dict(zip(names, (50.24, 50.35))), rows=rows))["chosen"] == "cache_views64"
    # averaged over worlds: world 1 pulls the 64-view choice below
    cells = _cells(dict(zip(names, (50.0, 51.0))), rows=rows)
    cells["cache_views64"][("1", 0)] = {k: (0, 0, v[2] - 4.0) for k, v in cells["cache_views64"][("1", 0)].items()}
    assert st.rank_cache_views(cells)["chosen"] == "cache_views1"  # 49.0 against 50.0
    # a missing seed chooses nothing and names the cell; the markdown says what the rule would pick
    del cells["cache_views1"][("0", 0)][(st.CACHE_ROW, 2)]
    partial = st.rank_cache_views(cells)
    assert partial["chosen"] is None and partial["missing"] == ["cache_views1/0"]
    md = st.cache_markdown({**partial, **st.selection_record(DemoSettings())})
    assert "missing cache_views1/0" in md and "| 1 | " in md and "| 64 | " in md


# ------------------------------------------------------------------------------ the sweep and the study, stand-ins
def test_the_sweep_runs_each_choice_on_val_in_its_own_cell_and_resumes(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(st, "testtime_records", fake_records(ran, lambda w, k, s: 0.0))
    base = DemoSettings()
    result = st.select(tmp_path, st.SELECT_WORLDS, base)
    assert len(ran) == 8 and {r[2] for r in ran} == {st.TT_GRAM_ROWS} and {r[5] for r in ran} == {"val"}
    got = {(r[0], r[3], r[4]) for r in ran}
    assert got == {(w, s, v) for w in "01" for s in (1, 2) for v in (("META.TEST_TIME.VIEWS", 16), ())}
    assert len({r[1] for r in ran}) == 4  # four cell folders per world: steps name the cell, views 16 its own
    assert "val_seed0_w0_launch1_qbw0" in {r[1] for r in ran} and st.DEFAULT_VIEWS == 8
    assert result["chosen"] == "steps1_views8"  # every choice equal: fewest steps, fewest views
    saved = json.loads((tmp_path / st.SELECTION_FILE).read_text())
    assert sorted(saved["computed_by"]) == sorted(saved["cells"]) and len(saved["cells"]) == 8
    assert {v["fingerprint"] for v in saved["computed_by"].values()} == {NOW["fingerprint"]}
    ran.clear()
    assert st.select(tmp_path, st.SELECT_WORLDS, base)["cells"] == saved["cells"] and ran == []
    with pytest.raises(ValueError, match="other settings"):
        st.select(tmp_path, st.SELECT_WORLDS, replace(base, seeds=(1,)))


def test_the_cache_sweep_runs_each_views_choice_on_val_in_its_own_cell_and_resumes(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(st, "testtime_records", fake_records(ran, lambda w, k, s: 0.0))
    result = st.select(tmp_path, st.SELECT_WORLDS, DemoSettings(), sweep=st.CACHE_VIEWS_SWEEP)
    assert len(ran) == 4 and {r[2] for r in ran} == {(st.CACHE_ROW,)} and {r[5] for r in ran} == {"val"}
    assert {r[1] for r in ran} == {"val_seed0_w0_launch1_qbw0"}  # one cell folder: the records have their own files
    assert result["chosen"] == "cache_views1"  # equal means: fewer views
    saved = json.loads((tmp_path / st.CACHE_FILE).read_text())
    assert sorted(saved["cells"]) == [f"cache_views{v}/{w}/0" for v in (1, 64) for w in "01"]
    assert (tmp_path / st.CACHE_FILE).with_suffix(".md").read_text().startswith("Val splits")
    ran.clear()
    assert st.select(tmp_path, st.SELECT_WORLDS, DemoSettings(), sweep=st.CACHE_VIEWS_SWEEP)["cells"] == saved["cells"]
    assert ran == []


def test_the_family_runs_on_test_splits_with_the_choice_and_holm_covers_the_four_pairs(tmp_path, monkeypatch, capsys):
    ran: list = []
    shift = {"237604": 0.0, "600737": 1.0, "779045": -0.6}
    gains = {"zsclip": 0.0, "tpt_hand": 0.6, "tpt_init": -8.0, "tt_gram": -7.0, "tt_gram_proto": -6.5, "tda_cache": 3.0}

    def effect(world, key, seed):
        moved = shift.get(world, 0.0) if key.startswith("tt_gram") else 0.0
        return gains[key] + moved + 0.1 * seed * (key != "zsclip")

    monkeypatch.setattr(st, "testtime_records", fake_records(ran, effect))
    selection = tmp_path / "sel.json"
    selection.write_text(json.dumps({"chosen": "steps2_views16", "partial": False}))
    out = tmp_path / "study"
    argv = ["run", "--selection", str(selection), "--out", str(out), "--worlds", *shift]
    assert st.main(argv) == 0
    keys = ("tt_gram_proto", "tt_gram", "tpt_init", "zsclip", "tpt_hand", "tda_cache")  # the last: descriptive only
    assert [r[0] for r in ran] == list(shift) and {r[2:] for r in ran} == {
        (keys, 2, ("META.TEST_TIME.VIEWS", 16), "test")
    }
    result = json.loads((out / st.RESULTS_FILE).read_text())
    rows = result["pairs"]
    assert [(r["method"], r["baseline"]) for r in rows] == list(st.PAIRS) and {r["family"] for r in rows} == {4}
    assert [r["p_holm"] for r in rows] == pytest.approx(study.holm([r["p_world_t"] for r in rows]), abs=1e-4)
    order = sorted(range(4), key=lambda i: rows[i]["p_world_t"])
    assert rows[order[0]]["p_holm"] == pytest.approx(min(1.0, 4 * rows[order[0]]["p_world_t"]), abs=1e-4)
    by = {(r["method"], r["baseline"]): r for r in rows}
    assert by[("tt_gram_proto", "tt_gram")]["mean_diff_H"] == pytest.approx(0.5)
    assert by[("tt_gram", "tpt_init")]["mean_diff_H"] == pytest.approx(1.0 + sum(shift.values()) / 3, abs=1e-3)
    assert by[("tpt_hand", "zsclip")]["mean_diff_H"] == pytest.approx(0.6 + 0.2)
    assert result["settings"]["choice"] == "steps2_views16" and result["plan"] == st.PLAN
    (line,) = result["answer"]
    assert line.startswith("Test-time tuning (3 worlds, Holm over 4 pairs): ") and " acc, 95 % interval" in line
    md = (out / "testtime.md").read_text()
    assert "| acc method / baseline | mean Δacc |" in md and "Regime" not in md
    assert "Descriptive (no claim)" in md and "| TPT from the hand prompt | 50.80 | 48.80 | 7.00 |" in md
    assert "| Zero-shot CLIP (no tuning) | 50.00 | 50.00 | — |" in md
    assert "| TDA's caches on zero-shot CLIP (training-free, online) | 53.20 | 51.20 | 7.00 |" in md
    assert not any("tda_cache" in (r["method"], r["baseline"]) for r in rows)  # in no pair, so in no Holm family
    ran.clear()
    argv2 = ["run", "--selection", str(selection), "--out", str(tmp_path / "new"), "--worlds", *shift, "454425"]
    assert st.main([*argv2, "--resume-from", str(out / st.RESULTS_FILE)]) == 0
    assert [r[0] for r in ran] == ["454425"]  # only the world the partial file lacks
    capsys.readouterr()


def test_run_refuses_without_a_finished_selection_file(tmp_path, capsys):
    missing = tmp_path / "testtime_selection.json"
    assert st.main(["run", "--selection", str(missing), "--out", str(tmp_path / "o")]) != 0
    one_error_line(capsys, str(missing), "select first")
    missing.write_text(json.dumps({"chosen": None, "partial": True, "best_if_complete": "steps1_views16"}))
    assert st.main(["run", "--selection", str(missing), "--out", str(tmp_path / "o")]) != 0
    one_error_line(capsys, str(missing), "partial")
    assert st.read_selection(str(missing), allow_partial=True) == st.Choice(1, 16)


# ------------------------------------------------------------------------------ the demo's test-time runs on val
def _world():
    data = {n: SimpleNamespace(name=n, dataset_dir=f"/d/{n}") for n in ("Src", "Tgt", "B1")}
    roles = {"cross_domain_source": ["Src"], "cross_domain_target": ["Tgt"], "base2new": ["B1"]}
    return SimpleNamespace(with_role=lambda r: [data[n] for n in roles.get(r, [])], dataset=lambda n: data[n])


def test_testtime_jobs_on_val_go_to_their_own_folder_and_can_be_transfer_only():
    settings = DemoSettings(seeds=(1,))
    jobs = stages.testtime_jobs(_world(), {}, settings, ("B1",))
    assert {j.protocol for j in jobs} == {"base2new", "transfer"} and {j.eval_split for j in jobs} == {"test"}
    val = replace(settings, eval_split="val", testtime_protocols=("transfer",))
    only = stages.testtime_jobs(_world(), {"gram_coop_testtime": "/i.pt"}, val, ("B1",), rows=("tt_gram", "zsclip"))
    assert [(j.protocol, j.test_time, j.eval_split, j.init) for j in only] == [
        ("transfer", "tt_gram", "val", "/i.pt"),
        ("transfer", "zsclip", "val", ""),
    ]
    assert only[0].path(Path("o")) == Path("o/runs/testtime_transfer_16shot_val/Src/tt_gram/seed1.json")
    assert replace(only[0], eval_split="test").path(Path("o")) == Path(
        "o/runs/testtime_transfer_16shot/Src/tt_gram/seed1.json"
    )
    assert stages.eval_jobs(_world(), {}, val, testtime=("tpt_hand",))[0].test_time == "tpt_hand"
    # the cache row's records at other views than TPT's 64 lie in their own files; the other rows ignore the views
    for views, folder in ((1, "tda_cache_views1"), (64, "tda_cache")):
        cache, tt = stages.testtime_jobs(
            _world(), {}, replace(val, cache_views=views), ("B1",), ("tda_cache", "tt_gram")
        )
        assert cache.path(Path("o")) == Path(f"o/runs/testtime_transfer_16shot_val/Src/{folder}/seed1.json")
        assert (cache.cache_views, tt.cache_views) == (views, 64)


def test_a_test_time_job_takes_the_splits_and_the_steps_of_its_settings(tmp_path, monkeypatch):
    seen: list = []

    def fake_transfer(source, targets, **kw):
        seen.append(kw)
        return {"source": 1.0, "target_mean": 2.0}

    monkeypatch.setattr(stages, "evaluate_transfer", fake_transfer)
    monkeypatch.setattr(stages.DatasetRef, "from_dir", lambda d, name="": SimpleNamespace(name=name))
    settings = DemoSettings(eval_split="val", testtime_steps=2)
    monkeypatch.setattr(
        stages, "_WORKER", {"settings": settings, "out": tmp_path, "evaluation": None, "clip": 0, "dims": 0}
    )
    for tt in ("tt_gram", "tpt_init"):
        row = TESTTIME_BY_KEY[tt].row
        stages.run_eval_job(EvalJob("transfer", "Src", str(tmp_path), row, 1, 16, "/i.pt", (("T", "/t"),), tt, "val"))
    stages.run_eval_job(EvalJob("transfer", "Src", str(tmp_path), "coop", 1, 16))  # Table 2's run: test
    assert [kw["eval_split"] for kw in seen] == ["val", "val", "test"]
    assert (seen[0]["test_time"].steps, seen[0]["test_time"].optimizer) == (2, "meta")
    assert (seen[1]["test_time"].steps, seen[1]["test_time"].optimizer) == (1, "adamw")  # TPT keeps its one step
    assert seen[2]["test_time"] is None
    for views in (1, 64):
        job = EvalJob("transfer", "Src", str(tmp_path), "zsclip", 1, 16, "", (("T", "/t"),), "tda_cache", "val", views)
        stages.run_eval_job(job)
        assert (seen[-1]["test_time"].adapt, seen[-1]["test_time"].views) == ("cache", views)
    assert len(seen) == 5


def test_new_settings_leave_earlier_hashes_and_the_views_override_wins_over_the_variants():
    record = settings_record(DemoSettings())
    assert "testtime_steps" not in record and "testtime_protocols" not in record and "meta_overrides" not in record
    assert settings_hash(DemoSettings(testtime_protocols=("transfer",))) == settings_hash(DemoSettings())
    assert settings_record(DemoSettings(testtime_steps=2))["testtime_steps"] == 2
    assert study.Cell("0", DemoSettings(testtime_steps=2)).name.endswith("_tts2")
    # the cache row's views choose its records' files, not the folder: hashes and cell names stay
    assert "cache_views" not in record and settings_hash(DemoSettings(cache_views=64)) == settings_hash(DemoSettings())
    assert study.Cell("0", DemoSettings(cache_views=64)).name == study.Cell("0", DemoSettings()).name
    # the default is the committed val sweep's choice
    chosen = json.loads((REPO / st.CACHE_SELECTION).read_text())["chosen"]
    assert chosen == st.CacheChoice(DemoSettings().cache_views).name
    sixteen = st.Choice(1, 16).settings(DemoSettings())
    cfg = _variant_cfg(VARIANT_BY_NAME["gram_coop_testtime"], "m", "/w.pt", Path("/tmp/out"), sixteen, "/l")
    assert (cfg.META.MODE, cfg.META.TEST_TIME.VIEWS) == ("testtime", 16)
    plain = _variant_cfg(VARIANT_BY_NAME["gram_coop_testtime"], "m", "/w.pt", Path("/tmp/out"), DemoSettings(), "/l")
    # the demo's views are the val sweep's choice, the committed file's
    chosen = json.loads((REPO / st.SELECTION).read_text())["chosen"]
    assert st.BY_NAME[chosen] == st.Choice(1, plain.META.TEST_TIME.VIEWS)


@pytest.mark.skipif("tt_gram_proto" not in TESTTIME_BY_KEY, reason="the prototype row lands with the main branch")
def test_the_prototype_row_is_a_test_time_gram_row_with_its_own_meta_training():
    from gram_world.demo.settings import method_row

    proto, plain = TESTTIME_BY_KEY["tt_gram_proto"], TESTTIME_BY_KEY["tt_gram"]
    assert proto.optimizer == plain.optimizer == "meta" and not proto.fine_tuned
    variant = VARIANT_BY_NAME[method_row(proto.row).variant]
    assert variant.name != method_row(plain.row).variant
    pairs = dict(zip(variant.overrides[::2], variant.overrides[1::2]))
    assert pairs["META.MODE"] == "testtime" and pairs["META.TEST_TIME.PROTOTYPES"] == "nearest"
    assert pairs["META.TEST_TIME.VIEWS"] == st.DEFAULT_VIEWS
    assert st.row_label("tt_gram_proto") == proto.label
