"""``python -m gram_world.study_b2n`` (gram_world/study_b2n.py): its units, derived record keys for
rows fine-tuned with consistency weights, the written rule of docs/study/selection_b2n_rule.md on hand-made tables,
its files and resume, and the command line.  No stage runs: ``run_cell`` (or the stages) are stand-ins."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from gram_world import study, study_b2n
from gram_world.demo.settings import (
    METHOD_BY_KEY,
    DemoSettings,
    consistency_key,
    consistency_weights,
    method_row,
)
from gram_world.demo.stages import EvalJob, eval_jobs, method_spec
from gram_world.study_b2n import B2N_FILE, GRIDS, LEARNERS, REFERENCE, b2n_units, rank_b2n_variants

NOW = {"commit": "abc", "fingerprint": "f" * 64, "golden": True, "numerics": {"cpu_model": "test CPU"}}
UNITS = {u.name: u for u in b2n_units()}


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    """What computed a new unit here: a fixed record (the real one runs the ~15 s golden run)."""
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)


def _pairs(overrides: tuple) -> dict:
    return dict(zip(overrides[::2], overrides[1::2]))


# ------------------------------------------------------------------------------ units and rows
def test_each_world_runs_the_rules_units_with_their_rows_overrides_and_lambdas():
    assert len(UNITS) == 34 and sum(len(u.keys) for u in UNITS.values()) == 58
    assert UNITS["baselines"].keys == ("coop", "vpt", "joint", "zsclip")
    assert UNITS["fixed_coop"].keys == ("coop@ct1", "coop@ct2", "coop@ct4", "coop@ct8", "coop@ct16")
    assert UNITS["fixed_vpt"].keys == ("vpt@ci2.5", "vpt@ci5", "vpt@ci10", "vpt@ci20")
    assert UNITS["fixed_joint"].keys == (
        "joint@ct1_ci1.25",
        "joint@ct2_ci2.5",
        "joint@ct4_ci5",
        "joint@ct8_ci10",
        "joint@ct16_ci20",
    )
    rows = ("gram_coop", "gram_vpt", "unigram", "gram_coop_init_only", "gram_vpt_init_only", "unigram_init_only")
    assert UNITS["paper_gb"].keys == rows and UNITS["paper_gb"].meta_overrides == ()
    assert UNITS["class_shift_gb"].keys == rows
    assert UNITS["class_shift_gb"].meta_overrides == ("TASKS.QUERY_NEW_SHARE", 1.0)
    gates = [u for u in UNITS.values() if "_gate_" in u.name]
    assert len(gates) == 2 * (5 + 4 + 5)
    for unit in gates:
        (key,) = unit.keys
        task = "class_shift" if unit.name.startswith("class_shift_") else "paper"
        pairs = _pairs(unit.meta_overrides)
        assert pairs["META.REGULATOR.FORM"] == "gate"
        assert pairs.get("TASKS.QUERY_NEW_SHARE") == (1.0 if task == "class_shift" else None)
        weights = (pairs["META.CONSISTENCY.TEXT_WEIGHT"], pairs["META.CONSISTENCY.IMAGE_WEIGHT"])
        assert consistency_weights(key) == weights and weights in GRIDS[method_row(key).variant]
        assert all(isinstance(v, float) for v in weights)  # yacs refuses an int for a float key
    assert {u.name for u in gates if u.name.startswith("paper_gate_unigram")} == {
        f"paper_gate_unigram_ct{t:g}_ci{1.25 * t:g}" for t in (1, 2, 4, 8, 16)
    }
    # the plain units share the world's plain cell; every meta-trained variant has its own cell and meta folder
    ws = replace(study.world_settings("0", DemoSettings()), eval_split="val")
    plain = study.Cell("0", ws)
    for name in ("baselines", "fixed_coop", "fixed_vpt", "fixed_joint", "paper_gb"):
        assert UNITS[name].cell("0", ws) == plain
    own = [u.cell("0", ws) for u in UNITS.values() if u.meta_overrides]
    assert len({c.meta_folder for c in own} | {plain.meta_folder}) == len(own) + 1
    assert len({c.name for c in own} | {plain.name}) == len(own) + 1
    cell = UNITS["class_shift_gate_gram_vpt_ci10"].cell("0", ws)
    assert cell.meta_folder == "meta_seed0_qbw0_b2n_class_shift_gate_gram_vpt_ci10"
    assert cell.settings.meta_overrides == UNITS["class_shift_gate_gram_vpt_ci10"].meta_overrides


def test_the_gate_meta_training_config_carries_the_units_overrides():
    from gram_world.demo.settings import VARIANT_BY_NAME
    from gram_world.demo.stages import _variant_cfg

    unit = UNITS["class_shift_gate_unigram_ct2_ci2.5"]
    settings = replace(DemoSettings(), meta_overrides=unit.meta_overrides)
    cfg = _variant_cfg(VARIANT_BY_NAME["unigram"], "m", "/w.pt", Path("/tmp/out"), settings, "/labelled")
    assert (cfg.META.REGULATOR.FORM, cfg.TASKS.QUERY_NEW_SHARE) == ("gate", 1.0)
    assert (cfg.META.CONSISTENCY.TEXT_WEIGHT, cfg.META.CONSISTENCY.IMAGE_WEIGHT) == (2.0, 2.5)


def test_a_gate_rows_method_spec_has_the_consistency_weights_of_its_meta_training():
    ws = replace(DemoSettings(), eval_split="val")
    for unit in UNITS.values():
        if "_gate_" not in unit.name:
            continue
        (key,) = unit.keys
        pairs = _pairs(unit.meta_overrides)
        spec = method_spec(method_row(key), "/x.safetensors", ws)
        assert (spec.consistency_text, spec.consistency_image) == (
            pairs["META.CONSISTENCY.TEXT_WEIGHT"],
            pairs["META.CONSISTENCY.IMAGE_WEIGHT"],
        )
        assert spec.regulate and spec.init_prompts and spec.init_path == "/x.safetensors"
        plain = method_spec(METHOD_BY_KEY[method_row(key).variant], "/x.safetensors", ws)
        assert replace(spec, name=plain.name, consistency_text=0.0, consistency_image=0.0) == plain
    fixed = method_spec(method_row("joint@ct4_ci5"))
    assert (fixed.consistency_text, fixed.consistency_image, fixed.regulate, fixed.init_path) == (4.0, 5.0, False, "")
    theta = method_spec(method_row("unigram_init_only"), "/x.safetensors")
    assert (theta.regulate, theta.init_prompts, theta.n_ctx_text, theta.n_ctx_vision) == (False, True, 2, 2)
    assert theta.name == "UNIGRAM, θ* only" and method_row("unigram_init_only").variant == "unigram"


def test_rows_with_consistency_weights_have_their_own_record_keys():
    assert consistency_key("coop", 4) == "coop@ct4" and consistency_key("coop") == "coop"
    assert consistency_key("vpt", 0, 2.5) == "vpt@ci2.5" and consistency_key("joint", 1, 1.25) == "joint@ct1_ci1.25"
    row = method_row("gram_coop@ct4")
    assert (row.key, row.method_key, row.variant, row.preset) == (
        "gram_coop@ct4",
        "gram_coop",
        "gram_coop",
        "gram_coop",
    )
    assert row.label == "CoOp + GRAM, λ text 4" and row.spec_overrides == (("consistency_text", 4.0),)
    assert method_row("joint@ct1_ci1.25").label == "joint textual & visual prompt tuning, λ text 1, image 1.25"
    assert method_row("coop") is METHOD_BY_KEY["coop"] and consistency_weights("coop") == (0.0, 0.0)
    for bad in (
        "coop@ct4.0",
        "coop@ci2.5_ct1",
        "coop@",
        "coop@ct0",
        "coop@ct4_ct8",
        "nope@ct4",
        "coop@ctx",
        "coop@cinf",
    ):
        with pytest.raises(KeyError, match="unknown demo row"):
            method_row(bad)
    with pytest.raises(ValueError, match="finite number >= 0"):
        consistency_key("coop", -1)
    # runs, records and tables keep them apart from the plain row
    assert EvalJob("base2new", "D", "/d", "coop@ct4", 1, 16).path(Path("o")) == Path(
        "o/runs/base2new/D/coop@ct4/seed1.json"
    )
    table = study.cell_h(
        [
            {"key": "coop", "seed": 1, "base": 60.0, "new": 40.0},
            {"key": "coop@ct4", "seed": 1, "base": 50.0, "new": 50.0},
        ]
    )
    assert table[("coop", 1)][2] == pytest.approx(48.0) and table[("coop@ct4", 1)][2] == 50.0
    assert study.table_from_json({"coop@ct1_ci1.25/2": [1.0, 2.0, 3.0]}) == {("coop@ct1_ci1.25", 2): (1.0, 2.0, 3.0)}
    world = SimpleNamespace(dataset=lambda name: SimpleNamespace(dataset_dir=f"/w/{name}"))
    settings = replace(DemoSettings(), datasets=("D",), seeds=(1,))
    jobs = eval_jobs(world, {"gram_coop": "/gate.safetensors"}, settings, keys=("gram_coop@ct4", "coop@ct4"))
    assert [(j.key, j.init) for j in jobs] == [("gram_coop@ct4", "/gate.safetensors"), ("coop@ct4", "")]
    assert jobs[0].cost == 1 and EvalJob("base2new", "D", "/d", "vpt@ci5", 1, 16).cost == 4


def test_a_gate_units_cell_meta_trains_only_its_learner_in_its_own_folder(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(study, "stage_world", lambda s, out, world_root=None: ("world", tmp_path / "w.pt", "m", {}))
    monkeypatch.setattr(study, "check_world", lambda out, world, weights: None)
    monkeypatch.setattr(study, "stage_chc", lambda *a: None)

    def fake_meta(world, weights, model, out, settings, names=None):
        seen["meta"] = (names, settings.meta_overrides, (out / "meta").resolve().name)
        return {n: f"/{n}.safetensors" for n in names}

    def fake_eval(world, weights, model, inits, out, settings, keys=None):
        seen["eval"] = (inits, keys)
        return []

    monkeypatch.setattr(study, "stage_meta", fake_meta)
    monkeypatch.setattr(study, "stage_eval", fake_eval)
    unit = UNITS["paper_gate_gram_coop_ct4"]
    ws = replace(study.world_settings("0", DemoSettings.preset(True)), eval_split="val")
    study.run_cell(unit.cell("0", ws), tmp_path, unit.keys)
    assert seen["meta"] == (("gram_coop",), unit.meta_overrides, "meta_seed0_qbw0_b2n_paper_gate_gram_coop_ct4")
    assert seen["eval"] == ({"gram_coop": "/gram_coop.safetensors"}, ("gram_coop@ct4",))
    fixed = UNITS["fixed_coop"]
    study.run_cell(fixed.cell("0", ws), tmp_path, fixed.keys)
    assert seen["meta"][0] == ()  # the fixed-λ rows meta-train nothing


# ------------------------------------------------------------------------------ the rule on hand-made tables
def _cells(h=None, worlds=("0", "1"), seeds=(1, 2, 3), drop=()):
    """Every unit's cell on ``worlds``; H of a row = ``h(unit, key, world, seed)`` (base = new = H), default 50."""
    h = h or (lambda unit, key, world, seed: 50.0)
    cells: dict = {}
    for unit in b2n_units():
        for world in worlds:
            if (unit.name, world) in drop:
                continue
            cells.setdefault(unit.name, {})[(world, 0)] = {
                (k, s): (x, x, x) for k in unit.keys for s in seeds for x in [h(unit.name, k, world, s)]
            }
    return cells


def _rule(gains: dict, fixed_h: float = 50.0, **kw):
    """Hand-made sweep: θ* only of the paper's tasks at 50 H; ``gains[variant]`` = H above it, one number (every
    learner) or ``{learner: gain}``; the fixed-λ rows at ``fixed_h`` (every grid point) or per learner."""

    def gain(variant, learner):
        g = gains.get(variant, 0.0)
        return g.get(learner, 0.0) if isinstance(g, dict) else g

    def h(unit, key, world, seed):
        row = method_row(key)
        learner = next((k for k in LEARNERS if row.variant == k), "")
        if unit.startswith("fixed_"):
            learner = next(k for k, b in study_b2n.FIXED_OF.items() if b == row.method_key)
            return fixed_h.get(learner, 50.0) if isinstance(fixed_h, dict) else fixed_h
        if unit == "baselines":
            return 40.0
        task = "class_shift" if unit.startswith("class_shift") else "paper"
        form = "gate" if "_gate_" in unit else "init_only" if row.method_key.endswith("_init_only") else "gb"
        return 50.0 + gain(f"{form}/{task}", learner)

    return rank_b2n_variants(_cells(h, **kw), worlds=("0", "1"), seeds=(1, 2, 3))


def test_the_lambda_of_each_row_is_the_best_mean_val_h_with_ties_to_the_smaller():
    def h(unit, key, world, seed):
        table = {
            "coop@ct2": 55.0,  # tied with ct8 over worlds and seeds: the smaller λ
            "coop@ct8": 55.0,
            "joint@ct4_ci5": 60.0 if world == "0" else 40.0,  # mean 50: not above ct16's 52
            "joint@ct16_ci20": 52.0,
            "gram_coop@ct16": 51.0 if seed == 1 else 49.0,  # mean 49.67 < 50 of the others
        }
        return table.get(key, 50.0)

    result = rank_b2n_variants(_cells(h))
    fixed = result["fixed"]
    assert (fixed["gram_coop"]["lambda"], fixed["gram_coop"]["key"], fixed["gram_coop"]["mean_H"]) == (
        [2.0, 0.0],
        "coop@ct2",
        55.0,
    )
    assert fixed["gram_vpt"]["lambda"] == [0.0, 2.5]  # every point equal: the smallest
    assert fixed["unigram"]["lambda"] == [16.0, 20.0] and fixed["unigram"]["row"] == "joint"
    assert [g["mean_H"] for g in fixed["unigram"]["grid"]] == [50.0, 50.0, 50.0, 50.0, 52.0]
    gate = result["gate_lambda"]["paper"]["gram_coop"]
    assert gate["lambda"] == [1.0, 0.0] and gate["key"] == "gram_coop@ct1"
    assert gate["unit"] == "paper_gate_gram_coop_ct1"


def test_the_reference_and_the_margin():
    tied = _rule({})
    assert tied["chosen"] == REFERENCE and tied["reason"] == "reference_best" and not tied["partial"]
    by_variant = {r["variant"]: r for r in tied["variants"]}
    assert by_variant[REFERENCE]["mean_delta_H"] == 0.0
    assert by_variant[REFERENCE]["delta_H_per_world"] == {
        "0": dict.fromkeys(LEARNERS, 0.0),
        "1": dict.fromkeys(LEARNERS, 0.0),
    }
    at_margin = _rule({"gb/paper": 0.5}, fixed_h=40.0)  # not more than 0.5 H
    assert at_margin["best"] == "gb/paper" and at_margin["reason"] == "margin" and at_margin["chosen"] == REFERENCE
    above = _rule({"gb/paper": 0.6}, fixed_h=40.0)
    assert above["chosen"] == "gb/paper" and above["reason"] == "chosen"
    assert "Chosen by the rule: **γ/β R_φ, paper's tasks**: mean ΔH +0.60" in study_b2n.b2n_markdown(above)
    # the mean is over worlds and learners: +1.5 on one learner only is +0.5
    one = _rule({"gb/class_shift": {"gram_vpt": 1.5}}, fixed_h=40.0)
    assert one["best"] == "gb/class_shift" and one["reason"] == "margin"
    row = next(r for r in one["variants"] if r["variant"] == "gb/class_shift")
    assert row["mean_delta_H"] == 0.5 and row["delta_H"] == {"gram_coop": 0.0, "gram_vpt": 1.5, "unigram": 0.0}


def test_the_chosen_variant_must_beat_the_fixed_lambda_row_for_two_of_three_learners():
    # γ/β on the paper's tasks: 51 H for every learner; the fixed-λ rows at 52 (CoOp, VPT) and 50 (UNIGRAM)
    one = _rule({"gb/paper": 1.0}, fixed_h={"gram_coop": 52.0, "gram_vpt": 52.0, "unigram": 50.0})
    row = next(r for r in one["variants"] if r["variant"] == "gb/paper")
    assert row["above_fixed"] == {"gram_coop": False, "gram_vpt": False, "unigram": True}
    assert one["reason"] == "fixed" and one["chosen"] == REFERENCE
    assert "above its learner's fixed-λ row for 1 of 3 learners, fewer than 2" in study_b2n.b2n_markdown(one)
    two = _rule({"gb/paper": 1.0}, fixed_h={"gram_coop": 52.0, "gram_vpt": 51.0, "unigram": 50.0})
    row = next(r for r in two["variants"] if r["variant"] == "gb/paper")
    assert row["learners_above_fixed"] == 1  # equal is not above
    three = _rule({"gb/paper": 1.0}, fixed_h={"gram_coop": 52.0, "gram_vpt": 50.9, "unigram": 50.0})
    assert three["chosen"] == "gb/paper"


def test_ties_within_a_tenth_go_to_the_simpler_variant():
    # the gate beats γ/β (class shift) by 0.1 H: γ/β is simpler (the regulator first, then the tasks)
    r = _rule({"gate/paper": 1.1, "gb/class_shift": 1.0}, fixed_h=40.0)
    assert r["best"] == "gb/class_shift" and r["chosen"] == "gb/class_shift"
    r = _rule({"gate/paper": 1.11, "gb/class_shift": 1.0}, fixed_h=40.0)
    assert r["chosen"] == "gate/paper"
    r = _rule({"gb/paper": 1.0, "init_only/class_shift": 0.95}, fixed_h=40.0)  # θ* only before γ/β
    assert r["chosen"] == "init_only/class_shift"
    r = _rule({"gb/class_shift": 1.0, "gb/paper": 0.9}, fixed_h=40.0)  # the paper's tasks before class shift
    assert r["chosen"] == "gb/paper"
    # the tie goes to the simpler variant before the conditions: here it then fails the margin
    r = _rule({"gate/paper": 0.58, "gb/paper": 0.5}, fixed_h=40.0)
    assert r["best"] == "gb/paper" and r["reason"] == "margin" and r["chosen"] == REFERENCE
    r = _rule({"gate/class_shift": 0.1}, fixed_h=40.0)  # within 0.1 of θ* only itself
    assert r["best"] == REFERENCE and r["reason"] == "reference_best"


def test_the_gate_variant_is_measured_at_its_chosen_lambda():
    def h(unit, key, world, seed):
        if unit.startswith("class_shift_gate_") and key in ("gram_coop@ct8", "gram_vpt@ci5", "unigram@ct2_ci2.5"):
            return 52.0
        return 40.0 if unit.startswith("fixed_") else 50.0

    r = rank_b2n_variants(_cells(h), worlds=("0", "1"), seeds=(1, 2, 3))
    gate = r["gate_lambda"]["class_shift"]
    assert [gate[k]["lambda"] for k in LEARNERS] == [[8.0, 0.0], [0.0, 5.0], [2.0, 2.5]]
    assert r["chosen"] == "gate/class_shift"
    row = next(x for x in r["variants"] if x["variant"] == "gate/class_shift")
    assert row["mean_delta_H"] == 2.0 and row["mean_H"] == dict.fromkeys(LEARNERS, 52.0)
    md = study_b2n.b2n_markdown(r)
    assert "| CoOp | coop text 1 | 40.00 | text 1 | 50.00 | text 8 | 52.00 | 50.00 |" in md
    assert "| UNIGRAM | gate, class-shift tasks | text 1, image 1.25: 50.00; **text 2, image 2.5: 52.00**;" in md


def test_differences_are_paired_by_fine_tuning_seed_and_averaged_per_world_first():
    def h(unit, key, world, seed):
        if unit == "paper_gb" and key == "gram_coop_init_only":
            return 50.0 + seed  # the reference moves with the seed ...
        if unit == "paper_gb" and key == "gram_coop":
            return 51.0 + seed  # ... and γ/β is one above it in every seed
        return 50.0

    r = rank_b2n_variants(_cells(h))
    row = next(x for x in r["variants"] if x["variant"] == "gb/paper")
    assert row["delta_H_per_world"]["0"]["gram_coop"] == 1.0 and row["delta_H"]["gram_coop"] == 1.0


def test_a_sweep_missing_a_unit_or_a_seed_is_partial_and_keeps_the_reference():
    def h(unit, key, world, seed):
        return 40.0 if unit.startswith("fixed_") else 52.0 if unit == "paper_gb" and "init_only" not in key else 50.0

    cells = _cells(h, drop=(("paper_gate_gram_vpt_ci20", "1"),))
    r = rank_b2n_variants(cells, worlds=("0", "1"), seeds=(1, 2, 3))
    assert r["partial"] and r["missing"] == ["paper_gate_gram_vpt_ci20/1"]
    assert r["chosen"] == REFERENCE and r["best_if_complete"] == "gb/paper"
    md = study_b2n.b2n_markdown(r)
    assert "Partial sweep (missing paper_gate_gram_vpt_ci20/1): the choice stays **θ* only, paper's tasks**" in md
    assert "on the finished units the rule would pick **γ/β R_φ, paper's tasks**" in md
    one_seed_short = _cells(h, seeds=(1, 2))
    r = rank_b2n_variants(one_seed_short, worlds=("0",), seeds=(1, 2, 3))
    assert r["partial"] and len(r["missing"]) == len(UNITS)
    assert rank_b2n_variants(_cells(h), worlds=("0", "1", "2"))["missing"][0] == "baselines/2"  # a world not run
    assert not rank_b2n_variants(one_seed_short, worlds=("0", "1"), seeds=(1, 2))["partial"]
    empty = rank_b2n_variants({}, worlds=("0",))
    assert empty["chosen"] == REFERENCE and empty["reason"] == "no_cells" and empty["best"] is None
    assert "no finished cells of it yet" in study_b2n.b2n_markdown(empty)


# ------------------------------------------------------------------------------ files, resume, command line
def _fake_run_cell(ran, seeds=(1, 2)):
    def fake(cell, root, keys, world_root=None):  # stands in for the demo's stages
        ran.append((cell.world, cell.variant, tuple(keys)))
        h = 55.0 if cell.variant == "b2n_class_shift_gb" else 50.0
        return [{"key": k, "seed": s, "base": h, "new": h} for k in keys for s in seeds]

    return fake


def test_the_sweep_writes_after_every_unit_and_a_rerun_keeps_every_finished_one(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(study, "run_cell", _fake_run_cell(ran))
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    writes = []
    real = study_b2n._write_b2n_result
    monkeypatch.setattr(study_b2n, "_write_b2n_result", lambda *a: writes.append(1) or real(*a))
    result = study_b2n.select_b2n(tmp_path / "s", ["0"], base)
    assert len(ran) == len(UNITS) and len(writes) == len(UNITS) + 1
    assert {keys for _, _, keys in ran} == {u.keys for u in UNITS.values()}
    assert ("0", "", UNITS["paper_gb"].keys) in ran and ("0", "b2n_class_shift_gb", UNITS["class_shift_gb"].keys) in ran
    # 55 H everywhere on class shift: the rule would pick θ* only of class-shift tasks, but world 1 (a world of the
    # rule) is missing and two seeds of the quick settings are not the rule's cells: the reference stays
    assert result["partial"] and result["missing"] == [f"{u}/1" for u in UNITS]
    assert result["best_if_complete"] == "init_only/class_shift" and result["chosen"] == REFERENCE
    assert result["off_rule"] == ["fine-tuning seeds 1 2, the rule's are 1 2 3", "the demo's --quick settings"]
    on_disk = json.loads((tmp_path / "s" / B2N_FILE).read_text())
    assert on_disk["cells"]["fixed_coop/0/0"]["coop@ct4/2"] == [50.0, 50.0, 50.0]
    assert on_disk["cells"]["paper_gate_unigram_ct16_ci20/0/0"] == {
        "unigram@ct16_ci20/1": [50.0] * 3,
        "unigram@ct16_ci20/2": [50.0] * 3,
    }
    assert on_disk["computed_by"]["baselines/0/0"] == NOW and on_disk["mixed_fingerprints"] == []
    assert (on_disk["seeds"], on_disk["split"], on_disk["meta_seed"]) == ([1, 2], "val", 0)
    assert set(on_disk["seconds_per_cell"]) == set(on_disk["cells"])
    md = (tmp_path / "s" / "selection_b2n.md").read_text()
    assert (
        "| θ* only, class-shift tasks | +5.00 / +5.00 / +5.00 (+5.00) | +5.00 | 55.00 / 55.00 / 55.00 | 3 of 3 |" in md
    )
    assert (
        "Not the rule's sweep (fine-tuning seeds 1 2, the rule's are 1 2 3; the demo's --quick settings): the choice "
        "stays **θ* only, paper's tasks**; on these cells the rule would pick **θ* only, class-shift tasks**: mean "
        "ΔH +5.00 over θ* only, paper's tasks (more than 0.5 H), above its learner's fixed-λ row for 3 of 3 "
        "learners; the sweep is also partial (missing world 1)." in md
    )
    ran.clear()
    again = study_b2n.select_b2n(tmp_path / "s", ["0"], base)  # <out>'s own file: every unit kept
    assert ran == [] and again["cells"] == result["cells"] and again["chosen"] == result["chosen"]
    # --resume-from another folder's file: world 0 kept, world 1 runs
    both = study_b2n.select_b2n(tmp_path / "t", ["0", "1"], base, previous=tmp_path / "s" / B2N_FILE)
    assert {w for w, _, _ in ran} == {"1"} and len(ran) == len(UNITS) and not both["partial"]
    assert both["chosen"] == REFERENCE and both["best_if_complete"] == "init_only/class_shift"  # still off the rule
    with pytest.raises(ValueError, match=r"seeds \[1, 2\] != \[1, 2, 3\]"):  # other seeds: not this sweep's cells
        study_b2n.select_b2n(tmp_path / "x", ["0"], replace(base, seeds=(1, 2, 3)), previous=tmp_path / "s" / B2N_FILE)
    with pytest.raises(ValueError, match="settings"):
        study_b2n.select_b2n(
            tmp_path / "x", ["0"], replace(base, launch=not base.launch), previous=tmp_path / "s" / B2N_FILE
        )
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a selection_b2n.json"):
        study_b2n.select_b2n(tmp_path / "x", ["0"], base, previous=tmp_path / "bad.json")
    assert not (tmp_path / "x").exists()


def test_a_stopped_sweep_is_partial_and_resumes_with_the_missing_units(tmp_path, monkeypatch):
    ran: list = []
    fake = _fake_run_cell(ran, seeds=(1, 2, 3))

    def stops(cell, root, keys, world_root=None):
        if len(ran) == len(UNITS) + 5:
            raise KeyboardInterrupt
        return fake(cell, root, keys, world_root)

    monkeypatch.setattr(study, "run_cell", stops)
    base = DemoSettings()  # the rule's settings: fine-tuning seeds 1 2 3
    with pytest.raises(KeyboardInterrupt):
        study_b2n.select_b2n(tmp_path, ["0", "1"], base)
    stopped = json.loads((tmp_path / B2N_FILE).read_text())
    assert len(stopped["cells"]) == len(UNITS) + 5 and stopped["partial"] and stopped["off_rule"] == []
    assert stopped["chosen"] == REFERENCE and stopped["best_if_complete"] == "init_only/class_shift"
    assert stopped["missing"][:2] == ["class_shift_gb/1", "paper_gate_gram_coop_ct1/1"]  # world 1 ran five units
    assert (
        "Partial sweep (missing class_shift_gb/1, paper_gate_gram_coop_ct1/1, paper_gate_gram_coop_ct2/1, "
        "paper_gate_gram_coop_ct4/1, paper_gate_gram_coop_ct8/1, paper_gate_gram_coop_ct16/1 and 23 more units): "
        "the choice stays **θ* only, "
        "paper's tasks**; on the finished units the rule would pick **θ* only, class-shift tasks**"
    ) in (tmp_path / "selection_b2n.md").read_text()
    ran.clear()
    monkeypatch.setattr(study, "run_cell", fake)
    done = study_b2n.select_b2n(tmp_path, ["0", "1"], base)
    assert len(ran) == len(UNITS) - 5 and {w for w, _, _ in ran} == {"1"}
    assert not done["partial"] and done["chosen"] == "init_only/class_shift"
    assert "Chosen by the rule: **θ* only, class-shift tasks**" in (tmp_path / "selection_b2n.md").read_text()


def test_kept_units_of_another_fingerprint_are_refused_unless_mixed(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(study, "run_cell", _fake_run_cell(ran))
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    study_b2n.select_b2n(tmp_path, ["0"], base)
    other = {**NOW, "fingerprint": "e" * 64}
    monkeypatch.setattr(study, "current_provenance", lambda: other)
    before = (tmp_path / B2N_FILE).read_text()
    with pytest.raises(
        ValueError, match=r"cells baselines/0/0, class_shift_gate_gram_coop_ct1/0/0, .* fingerprint ffff"
    ):
        study_b2n.select_b2n(tmp_path, ["0", "1"], base)
    assert (tmp_path / B2N_FILE).read_text() == before
    mixed = study_b2n.select_b2n(tmp_path, ["0", "1"], base, mix_fingerprints=True)
    assert len(mixed["mixed_fingerprints"]) == len(UNITS) and mixed["computed_by"]["baselines/1/0"] == other
    assert "**Mixed numerics fingerprints**" in (tmp_path / "selection_b2n.md").read_text()


def test_the_command_line(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        study_b2n.main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "docs/study/selection_b2n_rule.md" in out and "default 1 2 3" in out and "default 0 1" in out
    assert study_b2n.main(["--worlds", "5", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == "error: --worlds: unknown world '5'; known: 0, 1, 2, 7, 13v, 3\n"
    assert study_b2n.main(["--jobs", "0", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("error: --jobs: expected an integer >= 1")
    for option in (
        ["--variants", "k1"],
        ["--meta-seeds", "1"],
        ["--bogus"],
    ):  # the study's options are not this sweep's
        with pytest.raises(SystemExit) as done:
            study_b2n.main(["--out", str(tmp_path / "o"), *option])
        assert done.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "o").exists()  # refused before any work
    with pytest.raises(SystemExit) as done:  # the study's select no longer takes the b2n sweep
        study.main(["select", "--sweep", "b2n"])
    assert done.value.code == 2 and "invalid choice: 'b2n'" in capsys.readouterr().err
    # the defaults: the rule's worlds 0 and 1 and fine-tuning seeds 1 2 3
    ran: list = []
    fake = _fake_run_cell(ran)
    monkeypatch.setattr(
        study,
        "run_cell",
        lambda cell, root, keys, world_root=None: [
            {**r, "seed": s} for r in fake(cell, root, keys)[::2] for s in (1, 2, 3)
        ],
    )
    assert study_b2n.main(["--out", str(tmp_path / "o")]) == 0
    data = json.loads((tmp_path / "o" / B2N_FILE).read_text())
    assert (data["worlds"], data["seeds"], data["partial"]) == (["0", "1"], [1, 2, 3], False)
    out = capsys.readouterr().out
    assert "study_b2n: chosen init_only/class_shift" in out and "| variant |" in out
    # the other commands keep their defaults
    seen = []
    monkeypatch.setattr(
        study,
        "study",
        lambda root, worlds, meta_seeds, base, **kw: seen.append((worlds, meta_seeds, kw["rows"])) or {"cells": {}},
    )
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "results.md").write_text("")
    assert study.main(["run", "--out", str(tmp_path / "r")]) == 0
    assert seen == [(list(study.WORLDS), list(study.META_SEEDS), "all")]


def test_worlds_swept_in_parallel_into_two_folders_merge_without_rerunning(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(study, "run_cell", _fake_run_cell(ran))
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    study_b2n.select_b2n(tmp_path / "w0", ["0"], base)
    study_b2n.select_b2n(tmp_path / "w1", ["1"], base)
    ran.clear()
    files = [tmp_path / "w0" / B2N_FILE, tmp_path / "w1" / B2N_FILE]
    both = study_b2n.select_b2n(tmp_path / "all", ["0", "1"], base, previous=files)
    assert ran == [] and not both["partial"] and len(both["cells"]) == 2 * len(UNITS)
    assert set(both["computed_by"]) == set(both["cells"]) == set(both["seconds_per_cell"])
    # the same unit with other numbers in two files is not merged
    data = json.loads(files[1].read_text())
    data["cells"]["baselines/0/0"] = {"coop/1": [1.0, 1.0, 1.0]}
    (tmp_path / "odd.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="baselines/0/0 holds different numbers"):
        study_b2n.select_b2n(tmp_path / "x", ["0", "1"], base, previous=[files[0], tmp_path / "odd.json"])


def test_one_worlds_units_split_over_two_folders_merge_into_the_whole_world(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(study, "run_cell", _fake_run_cell(ran))
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    names = list(UNITS)
    head = study_b2n.select_b2n(tmp_path / "a", ["1"], base, units=names[:7])
    assert len(ran) == 7 and sorted(head["cells"]) == sorted(f"{n}/1/0" for n in names[:7]) and head["partial"]
    study_b2n.select_b2n(tmp_path / "b", ["1"], base, units=list(reversed(names[7:])))  # order: the sweep's
    assert [r[1] for r in ran[7:]] == [UNITS[n].cell("1", base).variant for n in names[7:]]
    ran.clear()
    files = [tmp_path / d / B2N_FILE for d in "ab"]
    whole = study_b2n.select_b2n(tmp_path / "all", ["1"], base, previous=files)
    assert ran == [] and len(whole["cells"]) == len(UNITS)
    with pytest.raises(ValueError, match="--units: unknown nope; expected some of baselines, fixed_coop"):
        study_b2n.select_b2n(tmp_path / "c", ["1"], base, units=["nope"])
