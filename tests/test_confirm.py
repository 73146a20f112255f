"""``python -m gram_world.confirm`` (gram_world/confirm.py): the plan's worlds and family, the rows each world runs,
the results file (Holm over the family, resume, fingerprints) and the claim check on fresh worlds.  No stage runs:
``run_cell`` is a stand-in."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from helpers import fake_run_cell

from gram_world import confirm, power, study
from gram_world.demo.settings import DemoSettings

NOW = {"commit": "abc", "fingerprint": "f" * 64, "golden": True, "numerics": {"cpu_model": "test CPU"}}


@pytest.fixture(autouse=True)
def _this_machine(monkeypatch):
    """What computed a world here (the real record runs the golden run), and 200 bootstrap draws per pair instead of
    10,000 (the results are rewritten after every world; the intervals are not what these tests check)."""
    monkeypatch.setattr(study, "current_provenance", lambda: NOW)
    full = study.bootstrap_means
    monkeypatch.setattr(study, "bootstrap_means", lambda groups, draws=200, seed=0: full(groups, draws, seed))


def _selection(chosen="init_only/paper"):
    """A finished sweep's choice: fixed λ CoOp text 8, VPT image 10, joint (4, 5); gate λ CoOp text 2 (paper's
    tasks) and 16 (class shift), VPT 5, UNIGRAM (1, 1.25)."""
    gate = {"gram_coop": [2.0, 0.0], "gram_vpt": [0.0, 5.0], "unigram": [1.0, 1.25]}
    return {
        "chosen": chosen,
        "partial": False,
        "off_rule": [],
        "fixed": {
            "gram_coop": {"lambda": [8.0, 0.0]},
            "gram_vpt": {"lambda": [0.0, 10.0]},
            "unigram": {"lambda": [4.0, 5.0]},
        },
        "gate_lambda": {
            "paper": {k: {"lambda": v} for k, v in gate.items()},
            "class_shift": {k: {"lambda": [16.0, 0.0] if k == "gram_coop" else v} for k, v in gate.items()},
        },
    }


def test_the_plans_worlds_are_the_stated_draw_new_and_one_holds_out_another_style():
    assert confirm.CONFIRM_WORLDS == confirm.draw_worlds(confirm.CONFIRM_WORLD_COUNT, confirm.CONFIRM_WORLD_SEED)
    seeds = [confirm.world_fields(w)["world_seed"] for w in confirm.CONFIRM_WORLDS]
    assert len(set(seeds)) == 20 and all(1000 <= s < 1_000_000 for s in seeds)
    assert not {int(study.WORLDS[w]["world_seed"]) for w in study.WORLDS} & set(seeds)  # no world a sweep or study read
    styles = [confirm.world_fields(w)["world"] for w in confirm.CONFIRM_WORLDS]
    assert styles[:-1] == [()] * 19 and styles[-1] == (("holdout_style", "noisy"),) and "noisy" != "sketch"
    # another draw excludes the plan's worlds and is reproducible
    fresh = confirm.draw_worlds(3, 5, exclude=confirm.CONFIRM_WORLDS, held_out_style=False)
    assert fresh == confirm.draw_worlds(3, 5, exclude=confirm.CONFIRM_WORLDS, held_out_style=False)
    assert not set(fresh) & set(confirm.CONFIRM_WORLDS) and all("-" not in w for w in fresh)


def test_world_names_say_what_world_they_are():
    assert confirm.world_fields("1234") == {"world_seed": 1234, "world": ()}
    assert confirm.world_fields("77-cartoon") == {"world_seed": 77, "world": (("holdout_style", "cartoon"),)}
    for bad in ("x1", "12-sketch", "12-purple", "12 "):  # sketch is the default held-out style: one name per world
        with pytest.raises(ValueError, match="not a world name"):
            confirm.world_fields(bad)


def test_the_family_is_the_nine_primary_pairs_and_the_chosen_variant_against_theta_only_and_its_fixed_row():
    ref = confirm.family(_selection())
    assert ref[:9] == power.PRIMARY_PAIRS and len(ref) == 12  # θ* only chosen: only its fixed-λ rows join
    assert ref[9:] == (
        ("gram_coop_init_only", "coop@ct8"),
        ("gram_vpt_init_only", "vpt@ci10"),
        ("unigram_init_only", "joint@ct4_ci5"),
    )
    gate = confirm.family(_selection("gate/class_shift"))
    assert len(gate) == 15
    assert gate[9:11] == (
        ("class_shift_gate_gram_coop_ct16:gram_coop@ct16", "gram_coop_init_only"),
        ("class_shift_gate_gram_coop_ct16:gram_coop@ct16", "coop@ct8"),
    )
    assert gate[13:] == (
        ("class_shift_gate_unigram_ct1_ci1.25:unigram@ct1_ci1.25", "unigram_init_only"),
        ("class_shift_gate_unigram_ct1_ci1.25:unigram@ct1_ci1.25", "joint@ct4_ci5"),
    )
    shift = confirm.family(_selection("init_only/class_shift"))
    assert shift[9] == ("class_shift_gb:gram_coop_init_only", "gram_coop_init_only")
    assert confirm.row_label(shift[9][0]) == "CoOp + GRAM, θ* only, class-shift tasks (meta-trained with γ/β R_φ)"
    assert confirm.row_label(gate[9][0]).endswith("λ text 16, class-shift tasks (meta-trained with gate R_φ)")
    units = confirm.rows_by_unit(gate)
    assert units[""][:3] == study.REGIME_KEYS and "coop@ct8" in units[""] and "unigram_no_reg" in units[""]
    assert units["class_shift_gate_gram_vpt_ci5"] == ("gram_vpt@ci5",)
    # every unit a row names is a unit of the sweep (its META overrides)
    cell = confirm.unit_cell("class_shift_gate_gram_vpt_ci5", "5", DemoSettings.preset(True))
    assert cell.variant == "b2n_class_shift_gate_gram_vpt_ci5" and cell.settings.meta_overrides[:2] == (
        "TASKS.QUERY_NEW_SHARE",
        1.0,
    )
    with pytest.raises(ValueError, match="partial"):
        confirm.check_selection({**_selection(), "partial": True}, "s.json")
    confirm.check_selection({**_selection(), "partial": True}, "s.json", allow_partial=True)


def test_a_study_runs_each_worlds_units_merges_them_and_holm_covers_the_family(tmp_path, monkeypatch):
    ran: list = []
    world_shift = {"11": 0.0, "12": 1.0, "13-cartoon": -0.5}

    def effect(world, variant, key, seed):  # the gate row 2 H above everything, with world and seed noise
        gain = 2.0 if variant.startswith("b2n_paper_gate") else 0.0
        return gain + world_shift[world] * (key == "coop") + 0.1 * seed * (variant != "")

    monkeypatch.setattr(study, "run_cell", fake_run_cell(ran, effect))
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    selection = _selection("gate/paper")
    result = confirm.run(tmp_path, list(world_shift), (0,), base, selection)
    assert len(ran) == 3 * 4  # per world: the plain cell and three gate units
    assert (
        "13-cartoon",
        "",
        confirm.rows_by_unit(confirm.family(selection))[""],
        13,
        (("holdout_style", "cartoon"),),
    ) in ran
    table = result["cells"]["12/0"]
    assert table["paper_gate_gram_coop_ct2:gram_coop@ct2/1"] == [52.1] * 3 and table["coop/2"] == [51.0] * 3
    rows = {(r["method"], r["baseline"]): r for r in result["pairs"]}
    assert len(rows) == 15 and {r["family"] for r in rows.values()} == {15}
    gate_vs_init = rows[("paper_gate_gram_coop_ct2:gram_coop@ct2", "gram_coop_init_only")]
    # per world ΔH: seed noise 0.1 s in the gate row only -> 2.15 in every world
    assert gate_vs_init["mean_diff_H"] == pytest.approx(2.15) and gate_vs_init["p_world_t"] == 0.0
    vs_coop = rows[("gram_coop", "coop")]  # coop moves with the world: -0, -1, +0.5
    assert vs_coop["mean_diff_H"] == pytest.approx(np.mean([0.0, -1.0, 0.5]), abs=1e-3)
    # Holm over the family of 15: the world t-test's p times its step
    ps = [r["p_world_t"] for r in result["pairs"]]
    assert [r["p_holm"] for r in result["pairs"]] == pytest.approx(study.holm(ps), abs=1e-4)
    comps = result["variance_components"]["gram_coop vs coop"]
    assert comps["meta"] is None and comps["finetune"] == pytest.approx(0.0)
    assert comps["world"] == pytest.approx(np.var([0.0, -1.0, 0.5], ddof=1), abs=1e-4)
    # the answer: one sentence per learner, each pair worded by its corrected verdict
    coop_line, vpt_line, unigram_line = result["answer"]
    gate, init = confirm.row_label(gate_vs_init["method"]), confirm.row_label("gram_coop_init_only")
    assert coop_line.startswith("CoOp (3 worlds, Holm over 15 pairs): ")
    assert f"{gate} beats {init} (+2.15 H" in coop_line and gate_vs_init["holds"] == "better"
    assert vs_coop["holds"] == "not shown" and "CoOp + GRAM is not shown to differ from CoOp (-0.17 H" in coop_line
    assert vpt_line.startswith("VPT (3 worlds") and unigram_line.startswith("UNIGRAM (3 worlds")
    assert all(line.count(";") == 4 for line in result["answer"])  # five pairs per learner
    md = (tmp_path / "confirm.md").read_text()
    assert md.startswith(f"- {coop_line}\n- {vpt_line}\n- {unigram_line}\n")
    assert "p Holm (15 rows)" in md and "CoOp + GRAM, λ text 2, paper's tasks (meta-trained with gate R_φ)" in md
    # a Table 4 ablation reads with its parent row where it stands alone; runs (not worlds) are n
    assert "UNIGRAM without gradient regulating" in unigram_line and "- gradient" not in md
    assert "| n runs (worlds) |" in md
    # the pair's variance components stand in its row, as the results file holds them (σ²_world 0.58 here)
    coop_row = next(line for line in md.splitlines() if line.startswith("| CoOp + GRAM | CoOp |"))
    assert "| σ²_world / σ²_finetune (H²) |" in md and f"| {comps['world']:.2f} / 0.00 | not shown |" in coop_row
    assert result["computed_by"]["11/0"] == NOW and result["settings"]["chosen"] == "gate/paper"
    # a rerun keeps every finished world; another family or fingerprint is refused
    ran.clear()
    again = confirm.run(tmp_path, list(world_shift), (0,), base, selection)
    assert ran == [] and again["cells"] == result["cells"]
    with pytest.raises(ValueError, match="family"):
        confirm.run(tmp_path, ["11"], (0,), base, _selection())
    monkeypatch.setattr(study, "current_provenance", lambda: {**NOW, "fingerprint": "0" * 64})
    with pytest.raises(ValueError, match="numerics fingerprint"):
        confirm.run(tmp_path, ["11"], (0,), base, selection)


def test_halves_run_in_parallel_folders_merge_into_one_study_without_rerunning_a_world(tmp_path, monkeypatch):
    ran: list = []
    monkeypatch.setattr(
        study, "run_cell", fake_run_cell(ran, lambda world, variant, key, seed: 0.3 * seed + int(world[:2]))
    )
    base = replace(DemoSettings.preset(True), seeds=(1, 2))
    selection = _selection()
    a = confirm.run(tmp_path / "a", ["11", "12"], (0,), base, selection)
    b = confirm.run(tmp_path / "b", ["13-cartoon"], (0,), base, selection)
    ran.clear()
    halves = [tmp_path / "a" / "confirm.json", tmp_path / "b" / "confirm.json"]
    both = confirm.run(tmp_path / "all", ["11", "12", "13-cartoon"], (0,), base, selection, previous=halves)
    assert ran == [] and both["cells"] == {**a["cells"], **b["cells"]}
    assert sorted(both["computed_by"]) == ["11/0", "12/0", "13-cartoon/0"] and both["pairs"][0]["worlds"] == [
        "11",
        "12",
        "13-cartoon",
    ]
    # a world in two files with different numbers, or a missing file, is refused in one line
    data = json.loads(halves[1].read_text())
    data["cells"]["11/0"] = {k: [0.0, 0.0, 0.0] for k in a["cells"]["11/0"]}
    halves[1].write_text(json.dumps(data))
    with pytest.raises(ValueError, match="world 11/0 holds different numbers"):
        confirm.run(tmp_path / "again", ["11"], (0,), base, selection, previous=halves)
    with pytest.raises(ValueError, match="--resume-from: .*nowhere.json does not exist"):
        confirm.run(tmp_path / "again", ["11"], (0,), base, selection, previous=[tmp_path / "nowhere.json"])


def test_the_answer_words_each_pair_by_its_corrected_verdict_and_waits_for_a_second_world():
    def row(method, base, diff, p_holm, holds, worlds=("1", "2")):
        return {
            "method": method,
            "baseline": base,
            "label": method.upper(),
            "baseline_label": base.upper(),
            "mean_diff_H": diff,
            "ci95": [diff - 1, diff + 1],
            "p_holm": p_holm,
            "holds": holds,
            "worlds": list(worlds),
            "family": 3,
        }

    rows = [
        row("a", "b", -2.5, 0.01, "worse"),
        row("c", "b", 0.4, 0.7, "not shown"),
        row("d", "b", 1.0, None, "not shown", ("1",)),
    ]
    out = confirm.answer(
        rows, {"gram_coop": (("a", "b"), ("c", "b")), "gram_vpt": (("d", "b"),), "unigram": (("x", "y"),)}
    )
    assert out == [
        "CoOp (2 worlds, Holm over 3 pairs): "
        "A is below B (-2.50 H, 95 % interval [-3.50, -1.50], Holm-adjusted p 0.01); "
        "C is not shown to differ from B (+0.40 H, 95 % interval [-0.60, +1.40], Holm-adjusted p 0.7).",
        "VPT (1 world, Holm over 3 pairs): D vs B: no test yet (+1.00 H, 95 % interval [+0.00, +2.00], one world).",
    ]


def test_the_claim_check_compares_the_sign_on_fresh_worlds():
    claims = [
        {"method": "a", "baseline": "b", "label": "A", "baseline_label": "B", "holds": "better", "mean_diff_H": 1.0},
        {"method": "a", "baseline": "c", "label": "A", "baseline_label": "C", "holds": "worse", "mean_diff_H": -1.0},
        {"method": "c", "baseline": "b", "label": "C", "baseline_label": "B", "holds": "not shown", "mean_diff_H": 0.2},
        {"method": "a", "baseline": "z", "label": "A", "baseline_label": "Z", "holds": "better", "mean_diff_H": 3.0},
    ]
    fresh = {
        ("5", 0): {("a", 1): (0, 0, 51.0), ("b", 1): (0, 0, 50.0), ("c", 1): (0, 0, 50.5)},
        ("6", 0): {("a", 1): (0, 0, 49.0), ("b", 1): (0, 0, 49.5), ("c", 1): (0, 0, 48.0)},
    }
    rows = confirm.claim_check(claims, fresh)
    assert [r["verdict"] for r in rows] == ["agrees", "disagrees", "no claim", "no fresh cells"]
    assert rows[0]["fresh_diff_H"] == pytest.approx(0.25) and rows[0]["fresh_per_world"] == {"5": 1.0, "6": -0.5}
    assert rows[1]["fresh_diff_H"] == pytest.approx(0.75)  # a − c: +0.5, +1.0: the claimed "worse" does not hold here
    md = confirm.claim_markdown(rows, "claims.json")
    assert "| A | B | better | +1.00 | +0.25 | 5: +1.00, 6: -0.50 | agrees |" in md


def test_the_check_command_draws_fresh_worlds_and_prints_each_claim(tmp_path, monkeypatch, capsys):
    ran: list = []
    monkeypatch.setattr(study, "run_cell", fake_run_cell(ran, lambda w, v, k, s: 1.0 if k == "gram_coop" else 0.0))
    sel = tmp_path / "sel.json"
    sel.write_text(json.dumps(_selection()))
    claims = tmp_path / "claims.json"
    claims.write_text(
        json.dumps(
            {
                "pairs": [
                    {
                        "method": "gram_coop",
                        "baseline": "coop",
                        "label": "CoOp + GRAM",
                        "baseline_label": "CoOp",
                        "holds": "worse",
                        "mean_diff_H": -0.4,
                    }
                ]
            }
        )
    )
    argv = ["check", "--fresh", "2", "--draw-seed", "3", "--quick", "--seeds", "1", "--selection", str(sel)]
    assert confirm.main(argv + ["--claims", str(claims), "--out", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    worlds = confirm.draw_worlds(2, 3, exclude=confirm.CONFIRM_WORLDS, held_out_style=False)
    assert {w for w, *_ in ran} == set(worlds)
    assert "| CoOp + GRAM | CoOp | worse | -0.40 | +1.00 |" in out and "| disagrees |" in out
    saved = json.loads((tmp_path / "f" / "claims_check.json").read_text())
    assert saved["worlds"] == list(worlds) and saved["rows"][0]["verdict"] == "disagrees"
    assert confirm.main(argv + ["--claims", str(tmp_path / "none.json")]) == 2
    assert "--claims" in capsys.readouterr().err


def test_the_plan_reads_components_from_the_history_and_the_sweeps_val_cells_for_the_pairs_it_lacks():
    rng = np.random.default_rng(0)
    selection = _selection()
    # the sweep's cells: plain units under their keys, a unit with META overrides under <unit>:<key>
    selection["cells"] = {
        f"{unit}/{w}/0": {f"{k}/{fs}": [0, 0, float(50 + rng.normal())] for k in keys for fs in (1, 2, 3)}
        for w in ("0", "1", "2")
        for unit, keys in (
            ("paper_gb", ("gram_coop_init_only", "gram_vpt_init_only", "unigram_init_only")),
            ("fixed_coop", ("coop@ct8",)),
            ("class_shift_gb", ("gram_coop",)),
        )
    }
    merged = confirm.sweep_tables(selection)
    assert set(merged) == {"0/0", "1/0", "2/0"} and "class_shift_gb:gram_coop/2" in merged["1/0"]
    assert merged["1/0"]["coop@ct8/3"] == selection["cells"]["fixed_coop/1/0"]["coop@ct8/3"]
    history = {
        "cells": {
            f"{w}/{m}": {f"{k}/{fs}": [0, 0, float(50 + rng.normal())] for k in study.STUDY_KEYS for fs in (1, 2, 3)}
            for w in ("0", "1", "2")
            for m in (0, 1)
        }
    }
    text = confirm.plan_text(selection, history, 20, 1, history_name="h.json")
    assert "Primary family (12 pairs; chosen variant: init_only/paper)" in text
    assert "10. CoOp + GRAM, θ* only vs CoOp, λ text 8 (`gram_coop_init_only` vs `coop@ct8`)" in text
    assert text.count("| gram_coop | coop |") == 1 and "from the cells of h.json" in text
    assert text.count("| gram_coop_init_only | coop@ct8 |") == 1  # from the sweep's val cells
    assert "No components anywhere for: gram_vpt_init_only vs vpt@ci10, unigram_init_only vs joint@ct4_ci5." in text


def test_readmes_answer_block_is_restated_from_the_results_file_alone(tmp_path, capsys):
    result = {
        "answer": ["CoOp (20 worlds, Holm over 12 pairs): A beats B (+1.00 H)."],
        "cells": {"1/0": {}, "1/1": {}, "2/0": {}},
    }
    block = confirm.readme_block(result, "docs/study/confirm.json")
    assert block.splitlines() == [
        confirm.README_BEGIN,
        "**The confirmatory study** (2 worlds, test splits, plan [docs/study/plan.md](docs/study/plan.md); "
        "table [docs/study/confirm.md](docs/study/confirm.md)):",
        "",
        "- CoOp (20 worlds, Holm over 12 pairs): A beats B (+1.00 H).",
        confirm.README_END,
    ]
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{confirm.README_BEGIN}\nold answer\n{confirm.README_END}\nafter\n")
    results = tmp_path / "confirm.json"
    results.write_text(json.dumps(result))
    assert confirm.main(["readme", "--claims", str(results), "--write", str(readme)]) == 0
    text = readme.read_text()
    assert "old answer" not in text and text.startswith("# Title\n\nbefore\n<!--") and text.endswith("-->\nafter\n")
    assert confirm.readme_block(result, str(results)) in text
    assert (
        confirm.main(["readme", "--claims", str(results), "--write", str(readme)]) == 0 and readme.read_text() == text
    )
    readme.write_text("no markers\n")
    assert confirm.main(["readme", "--claims", str(results), "--write", str(readme)]) == 2  # run_cli: bad input
    assert "README.md: expected the lines" in capsys.readouterr().err and readme.read_text() == "no markers\n"
    with pytest.raises(ValueError, match="no answer yet"):
        confirm.readme_block({"answer": []}, "x.json")


def test_readme_states_the_committed_confirmatory_answer_and_nothing_else():
    """README carries the answer block exactly when the confirmatory results are committed, and then it is theirs."""
    root = confirm.Path(__file__).resolve().parents[1]
    readme, results = (root / "README.md").read_text(encoding="utf-8"), root / confirm.CLAIMS
    if not results.is_file():
        assert confirm.README_BEGIN not in readme and confirm.README_END not in readme
    else:
        assert confirm.readme_block(json.loads(results.read_text()), confirm.CLAIMS) in readme


def test_committed_study_files_are_found_from_any_folder(tmp_path, monkeypatch, capsys):
    """The defaults (docs/study/...) are the repository's committed files wherever the command runs: ``readme``
    prints the committed answer from another folder, and a file found in neither place is a one-line error that
    says where it looked (the advice "run the study first" was false when only the folder was wrong)."""
    monkeypatch.chdir(tmp_path)
    assert confirm.committed_file(confirm.CLAIMS) == confirm.REPO / confirm.CLAIMS
    assert confirm.main(["readme"]) == 0
    out = capsys.readouterr().out
    assert "**The confirmatory study**" in out and "docs/study/confirm.md" in out  # the links stay relative
    assert str(tmp_path) not in out and str(confirm.REPO) not in out
    assert confirm.main(["readme", "--claims", "docs/study/nope.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.json (looked in" in err[0] and str(confirm.REPO) in err[0]
