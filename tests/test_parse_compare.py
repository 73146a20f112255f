"""``scripts/parse_results.py --compare``: a user's base-to-new runs judged like the project's study, datasets as
the units, on synthetic CoOp-layout trees with known numbers and on the paper's Table 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import ttest_rel
from yacs.config import CfgNode

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("parse_results", REPO / "scripts" / "parse_results.py")
pr = importlib.util.module_from_spec(_spec)
sys.modules["parse_results"] = pr  # dataclasses look their module up while the file executes
_spec.loader.exec_module(pr)

COOP, COCOOP = "CoOp/vit_b16_ep50", "CoCoOp/vit_b16_c4_ep10_batch1_ctxv1"  # the fork's TRAINER/CFG folders


@pytest.fixture(autouse=True)
def fewer_draws(monkeypatch):
    """The study's interval through the same function with 400 bootstrap draws instead of 10,000 (test time)."""
    full = pr.bootstrap_interval
    monkeypatch.setattr(pr, "bootstrap_interval", lambda groups: full(groups, draws=400))


def config_dump(backbone: str, model_name: str = "") -> str:
    """What CoOp's ``train.py`` (``print_args``) writes before training: the arguments, then yacs' own dump."""
    cfg = CfgNode()
    cfg.DATASET = CfgNode({"NAME": "DescribableTextures", "NUM_SHOTS": 16})
    cfg.MODEL = CfgNode({"BACKBONE": CfgNode({"NAME": backbone, "PRETRAINED": True}), "HEAD": CfgNode({"NAME": ""})})
    cfg.TRAINER = CfgNode({"GRAM": CfgNode({"MODEL_NAME": model_name, "N_CTX": 4}), "NAME": "GRAM_CoOp"})
    args = "***************\n** Arguments **\n***************\nbackbone: \nconfig_file: configs/x.yaml\n"
    return f"{args}************\n** Config **\n************\n{cfg}\nCollecting env info ...\n"


def log(acc: float, train: bool, dump: str = "") -> str:
    end = "Finish training\nEvaluate on the *test* set\n" if train else "Evaluate on the *test* set\n"
    return f"{dump}epoch [1/1] batch [1/1] loss 1.0\n{end}=> result\n* total: 100\n* accuracy: {acc}%\n"


def write_runs(root: Path, method: str, numbers: dict, shots: int = 16, dump: str = "") -> None:
    """``numbers`` = {dataset: {seed: (base %, new %)}}, written as the fork's base2new scripts lay runs out."""
    for ds, seeds in numbers.items():
        for seed, (base, new) in seeds.items():
            for sub, acc, train in (("train_base", base, True), ("test_new", new, False)):
                d = root / "base2new" / sub / ds / f"shots_{shots}" / method / f"seed{seed}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "log.txt").write_text(log(acc, train, dump))


def h(base: float, new: float) -> float:
    return 2 * base * new / (base + new)


def seed_mean_h(numbers: dict) -> dict[str, float]:
    """By hand: per dataset, H of the seed-averaged base and new accuracies."""
    return {d: h(np.mean([b for b, _ in s.values()]), np.mean([n for _, n in s.values()])) for d, s in numbers.items()}


A = {  # baseline: two seeds on four datasets
    "dtd": {1: (70.0, 50.0), 2: (72.0, 54.0)},
    "eurosat": {1: (80.0, 60.0), 2: (84.0, 58.0)},
    "caltech101": {1: (95.0, 92.0), 2: (96.0, 93.0)},
    "oxford_pets": {1: (90.0, 94.0), 2: (91.0, 95.0)},
}
B = {  # method: better new accuracy everywhere, by different amounts
    "dtd": {1: (71.0, 56.0), 2: (73.0, 60.0)},
    "eurosat": {1: (81.0, 66.0), 2: (83.0, 68.0)},
    "caltech101": {1: (95.0, 93.0), 2: (96.0, 93.5)},
    "oxford_pets": {1: (90.5, 95.0), 2: (91.0, 95.5)},
}


def test_the_difference_and_p_are_the_paired_t_test_over_datasets(tmp_path, capsys):
    write_runs(tmp_path, COOP, A)
    write_runs(tmp_path, COCOOP, B)
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 0
    out = capsys.readouterr().out
    ha, hb = seed_mean_h(A), seed_mean_h(B)
    names = list(ha)
    deltas = np.array([hb[d] - ha[d] for d in names])
    p = ttest_rel([hb[d] for d in names], [ha[d] for d in names]).pvalue
    [row] = pr.compare(pr.collect(tmp_path)[0], [(COOP, COCOOP)])
    assert row["mean_diff_H"] == pytest.approx(deltas.mean(), abs=1e-9)
    assert row["p"] == pytest.approx(p, rel=1e-9) and row["p_holm"] == pytest.approx(p, rel=1e-9)  # family of one
    assert row["per_dataset"] == pytest.approx(dict(zip(names, deltas)))
    assert row["H"] == pytest.approx((np.mean(list(ha.values())), np.mean(list(hb.values()))))
    assert row["base"][0] == pytest.approx(np.mean([b for s in A.values() for b, _ in s.values()]))
    assert deltas.min() <= row["ci95"][0] < deltas.mean() < row["ci95"][1] <= deltas.max()
    line = next(x for x in out.splitlines() if x.startswith(f"| {COOP} → {COCOOP} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:3] == ["16", "4"] and cells[6] == f"{deltas.mean():+.2f}" and cells[8] == f"{p:.3g}"
    assert f"dtd {hb['dtd'] - ha['dtd']:+.2f}" in out and f"missing from {COCOOP}: none" in out


def test_holm_steps_down_over_the_pairs_asked(tmp_path, capsys):
    """Three pairs from our own layout (method keys); Holm by hand from each pair's own t-test."""
    rng = np.random.default_rng(3)
    datasets = ["dtd", "eurosat", "caltech101", "oxford_pets", "food101"]
    base_numbers = {d: {1: (70.0 + i, 60.0 + i)} for i, d in enumerate(datasets)}
    write_runs(tmp_path, "coop", base_numbers)
    gains = {"gram_coop": 2.0, "vpt": 0.3, "unigram": 1.0}  # new-accuracy gain, the spread is the same
    for method, gain in gains.items():
        noise = rng.normal(0.0, 1.0, len(datasets))
        write_runs(tmp_path, method, {d: {1: (70.0 + i, 60.0 + i + gain + noise[i])} for i, d in enumerate(datasets)})
    pairs = [("coop", m) for m in gains]
    argv = [str(tmp_path)] + [x for pair in pairs for x in ("--compare", *pair)]
    assert pr.main(argv) == 0
    rows = pr.compare(pr.collect(tmp_path)[0], pairs)
    raw = [r["p"] for r in rows]
    order = np.argsort(raw)
    expected, running = [0.0] * 3, 0.0
    for rank, i in enumerate(order):  # smallest p times 3, next times 2 (never below the one before), last times 1
        running = max(running, min(1.0, (3 - rank) * raw[i]))
        expected[i] = running
    assert [r["p_holm"] for r in rows] == pytest.approx(expected)
    assert len(set(np.round(raw, 12))) == 3 and rows[order[0]]["p_holm"] == pytest.approx(3 * raw[order[0]])
    assert all(r["family"] == 3 for r in rows)
    out = capsys.readouterr().out
    assert "Holm over the 3 rows tested" in out
    assert "| CoOp → CoOp + GRAM | 16 | 5 |" in out  # the method table's labels for our keys


def test_runs_missing_from_either_side_are_named_and_left_out(tmp_path, capsys):
    write_runs(tmp_path, COOP, A)
    partial = {"dtd": {1: B["dtd"][1]}, "caltech101": B["caltech101"], "oxford_pets": B["oxford_pets"]}
    partial["caltech101"] = {**B["caltech101"], 3: (97.0, 94.0)}  # a seed the baseline never ran
    write_runs(tmp_path, COCOOP, partial)
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 0
    out = capsys.readouterr().out
    assert f"missing from {COCOOP}: dtd seed2, eurosat seed1, eurosat seed2" in out
    assert f"missing from {COOP}: caltech101 seed3" in out
    [row] = pr.compare(pr.collect(tmp_path)[0], [(COOP, COCOOP)])
    assert row["datasets"] == ["caltech101", "oxford_pets", "dtd"]  # the paper's order; eurosat has no pair
    # dtd is paired on seed 1 only: both sides' seed-1 numbers, not the baseline's two-seed mean
    assert row["per_dataset"]["dtd"] == pytest.approx(h(*B["dtd"][1]) - h(*A["dtd"][1]))
    assert row["per_dataset"]["caltech101"] == pytest.approx(
        seed_mean_h({"c": B["caltech101"]})["c"] - seed_mean_h({"c": A["caltech101"]})["c"]
    )


def test_one_paired_dataset_has_no_test_and_no_holm(tmp_path, capsys):
    write_runs(tmp_path, COOP, {"dtd": A["dtd"]})
    write_runs(tmp_path, COCOOP, {"dtd": B["dtd"]})
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 0
    out = capsys.readouterr().out
    assert "no test: 1 dataset(s) paired, a test needs two" in out
    [row] = pr.compare(pr.collect(tmp_path)[0], [(COOP, COCOOP)])
    assert row["p"] is None and row["p_holm"] is None and row["family"] == 0


def test_different_shot_counts_are_refused_in_one_line(tmp_path, capsys):
    write_runs(tmp_path, COOP, A, shots=16)
    write_runs(tmp_path, COCOOP, B, shots=4)
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 2
    captured = capsys.readouterr()
    err = [x for x in captured.err.splitlines() if not x.startswith(("note:", "WARNING:"))]
    assert err == [
        f"--compare {COOP} {COCOOP}: runs of different shot counts ({COOP}: shots 16; {COCOOP}: shots 4); "
        "pass --shots K to pair one shot count both ran"
    ]
    assert captured.out == ""
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP, "--shots", "16"]) == 2
    assert f"--shots 16: {COCOOP} has runs at shots 4 only" in capsys.readouterr().err
    write_runs(tmp_path, COOP, A, shots=4)  # now both ran 4 shots: --shots 4 pairs them, 16 stays unpaired
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP, "--shots", "4"]) == 0
    assert f"| {COOP} → {COCOOP} | 4 | 4 |" in capsys.readouterr().out
    write_runs(tmp_path, COCOOP, B, shots=16)  # both at 4 and 16: one row per shot count, Holm over both
    rows = pr.compare(pr.collect(tmp_path)[0], [(COOP, COCOOP)])
    assert [r["shots"] for r in rows] == [4, 16] and rows[0]["family"] == 2
    assert pr.main([str(tmp_path), "--shots", "4"]) == 2  # --shots alone would be ignored: refused instead
    assert capsys.readouterr().err == "--shots: only with --compare (the tables cover every shot count)\n"
    assert pr.main([str(tmp_path), "--compare", COOP, "GRAM_CoOp/none"]) == 2
    assert "no base-to-new runs of method 'GRAM_CoOp/none' (methods found: " in capsys.readouterr().err


def test_different_backbones_are_refused_and_spellings_of_one_are_not(tmp_path, capsys):
    write_runs(tmp_path, COOP, A, dump=config_dump("RN50"))
    write_runs(tmp_path, COCOOP, B, dump=config_dump("ViT-B/16"))
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"--compare {COOP} {COCOOP} (shots 16): runs of different configs")
    assert f"{COOP} ran RN50; {COCOOP} ran ViT-B-16" in err[0]
    # ours: MODEL.BACKBONE.NAME empty, the architecture in TRAINER.GRAM.MODEL_NAME; the same CLIP as ViT-B/16
    write_runs(tmp_path, COOP, A, dump=config_dump("", model_name="ViT-B-16"))
    assert pr.recorded_clip(next(tmp_path.rglob("log.txt"))) == "ViT-B-16"
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 0
    assert "config dump" not in capsys.readouterr().err
    write_runs(tmp_path, COOP, {"dtd": A["dtd"]})  # two logs of the baseline without a dump: counted, named
    assert pr.main([str(tmp_path), "--compare", COOP, COCOOP]) == 0
    assert (
        f"note: --compare {COOP} {COCOOP} (shots 16): 4 of 32 logs carry no Dassl config dump; backbone not checked"
        in capsys.readouterr().err
    )


# GRAM, ICCV 2023, Table 1 (base-to-new generalisation, 16 shots, ViT-B/16): Base / New per dataset, as printed.
PAPER_DATASETS = (
    "imagenet caltech101 oxford_pets stanford_cars oxford_flowers food101 fgvc_aircraft sun397 dtd eurosat ucf101"
).split()
PAPER_BASE = {  # per dataset, in PAPER_DATASETS' order
    "CoOp": [76.21, 97.49, 94.48, 71.26, 87.87, 90.63, 30.66, 79.78, 69.46, 74.79, 80.72],
    "CoOp + GRAM": [76.42, 98.07, 94.71, 72.08, 92.60, 90.68, 31.19, 80.09, 72.87, 76.00, 81.47],
    "CoCoOp": [75.98, 97.96, 95.20, 70.49, 94.87, 90.70, 33.41, 79.74, 77.01, 87.49, 82.33],
}
PAPER_NEW = {
    "CoOp": [69.98, 94.67, 95.88, 73.92, 74.11, 91.17, 35.73, 76.04, 55.67, 61.50, 75.55],
    "CoOp + GRAM": [70.17, 95.00, 97.52, 74.80, 75.64, 91.91, 36.50, 76.97, 59.49, 69.92, 76.33],
    "CoCoOp": [70.43, 93.81, 97.69, 73.59, 71.75, 91.29, 23.71, 76.86, 56.00, 60.04, 73.45],
}
PAPER_TABLE_1 = {row: dict(zip(PAPER_DATASETS, zip(PAPER_BASE[row], PAPER_NEW[row]))) for row in PAPER_BASE}
# The same table's H column and "Average over 11 datasets" row (Base, New) for the rows above.
PAPER_H = {
    "CoOp": [72.96, 96.06, 95.17, 72.57, 80.41, 90.90, 33.00, 77.87, 61.81, 67.50, 78.05],
    "CoOp + GRAM": [73.16, 96.51, 96.09, 73.41, 83.27, 91.29, 33.64, 78.50, 65.50, 72.83, 78.82],
    "CoCoOp": [73.10, 95.84, 96.43, 72.01, 81.71, 90.99, 27.74, 78.27, 64.85, 71.21, 77.64],
}
PAPER_AVERAGE = {"CoOp": (77.58, 73.11), "CoOp + GRAM": (78.74, 74.93), "CoCoOp": (80.47, 71.69)}
FOLDER = {"CoOp": "coop", "CoOp + GRAM": "gram_coop", "CoCoOp": COCOOP}  # our layout beside the fork's


def test_the_papers_table_1_through_the_comparison(tmp_path, capsys):
    for row, numbers in PAPER_TABLE_1.items():
        write_runs(tmp_path, FOLDER[row], {d: {1: bn} for d, bn in numbers.items()})
    pairs = [("coop", "gram_coop"), ("coop", COCOOP)]
    assert pr.main([str(tmp_path), "--compare", *pairs[0], "--compare", *pairs[1]]) == 0
    out = capsys.readouterr().out
    rows = pr.compare(pr.collect(tmp_path)[0], pairs)
    for row, (baseline, method) in zip(rows, (("CoOp", "CoOp + GRAM"), ("CoOp", "CoCoOp"))):
        assert row["datasets"] == list(PAPER_TABLE_1["CoOp"])  # all 11, in the paper's order
        for side, name in enumerate((baseline, method)):  # the paper's Average row: the mean over the 11 datasets
            assert (row["base"][side], row["new"][side]) == pytest.approx(PAPER_AVERAGE[name], abs=0.006)
        # each dataset's ΔH from the printed Base / New agrees with the printed H columns to their rounding
        paper_delta = np.subtract(PAPER_H[method], PAPER_H[baseline])
        assert list(row["per_dataset"].values()) == pytest.approx(paper_delta, abs=0.011)
        assert row["p"] == pytest.approx(ttest_rel(PAPER_H[method], PAPER_H[baseline]).pvalue, rel=0.02)
    gram, cocoop = rows
    assert all(d > 0 for d in gram["per_dataset"].values())  # GRAM raises H on every dataset of Table 1
    assert gram["mean_diff_H"] == pytest.approx(
        np.mean(np.subtract(PAPER_H["CoOp + GRAM"], PAPER_H["CoOp"])), abs=0.011
    )
    assert gram["p"] < 0.02  # t-test over the 11 datasets of the printed H: p = 0.013
    assert cocoop["p"] > 0.5  # CoCoOp vs CoOp: H up on some datasets, down on others (FGVC −5.3)
    assert gram["p_holm"] == pytest.approx(2 * gram["p"]) and cocoop["p_holm"] == pytest.approx(cocoop["p"])
    assert "| CoOp → CoOp + GRAM | 16 | 11 | 77.58 / 78.74 | 73.11 / 74.93 |" in out
