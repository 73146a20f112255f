"""scripts/parse_results.py on synthetic log trees with known numbers."""

from __future__ import annotations

import csv
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("parse_results", REPO / "scripts" / "parse_results.py")
pr = importlib.util.module_from_spec(_spec)
sys.modules["parse_results"] = pr  # dataclasses look their module up while the file executes
_spec.loader.exec_module(pr)

TRAIN_LOG = """Loading trainer: GRAM_CoOp
epoch [1/2] batch [1/1] loss 1.0
Finish training
Deploy the last-epoch model
Evaluate on the *test* set
=> result
* total: 100
* correct: {c}
* accuracy: {acc}%
* error: {err}%
* macro_f1: 10.0%
Elapsed: 0:00:01
"""
EVAL_LOG = """Loading weights to prompt_learner from "x/prompt_learner/model.pth.tar-2"
Evaluate on the *test* set
=> result
* total: 100
* accuracy: {acc}%
* macro_f1: 10.0%
"""


def write_run(root: Path, rel: str, text: str, mode: str | None = None) -> Path:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    (d / "log.txt").write_text(text)
    if mode:
        (d / "gram_run.txt").write_text(f"hash abc\nmode {mode}\narg --seed\n")
    return d


def train_log(acc: float) -> str:
    return TRAIN_LOG.format(acc=acc, c=int(acc), err=100 - acc)


def make_tree(root: Path, numbers: dict) -> None:
    """numbers[(method, dataset)] = (base accs by seed, new accs by seed)."""
    for (method, ds), (base, new) in numbers.items():
        for seed, acc in enumerate(base, 1):
            write_run(root, f"base2new/train_base/{ds}/shots_16/{method}/seed{seed}", train_log(acc))
        for seed, acc in enumerate(new, 1):
            write_run(root, f"base2new/test_new/{ds}/shots_16/{method}/seed{seed}", EVAL_LOG.format(acc=acc))


NUMBERS = {
    ("coop", "dtd"): ([80.0, 82.0, 84.0], [50.0, 55.0, 60.0]),
    ("coop", "eurosat"): ([90.5, 91.5, 92.5], [70.0, 66.0, 68.0]),
    ("gram_coop", "dtd"): ([81.0, 81.0, 84.0], [58.0, 59.0, 63.0]),
    ("gram_coop", "eurosat"): ([92.0, 93.0, 91.0], [71.0, 73.0, 69.0]),
}


def read_csv(path: Path) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        return {(r["method"], r["dataset"]): r for r in csv.DictReader(f)}


def test_base_new_h_tables_match_independent_numbers(tmp_path):
    make_tree(tmp_path, NUMBERS)
    assert pr.main([str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "tables" / "base2new_shots16.csv")
    for (method, ds), (base, new) in NUMBERS.items():
        r = rows[(method, ds)]
        assert float(r["base_mean"]) == pytest.approx(np.mean(base), abs=1e-4)
        assert float(r["base_std"]) == pytest.approx(statistics.pstdev(base), abs=1e-4)
        assert float(r["new_mean"]) == pytest.approx(np.mean(new), abs=1e-4)
        assert float(r["H"]) == pytest.approx(statistics.harmonic_mean([np.mean(base), np.mean(new)]), abs=1e-4)
        assert r["base_seeds"] == "3" and r["new_seeds"] == "3"
    for method in ("coop", "gram_coop"):
        b = np.mean([np.mean(NUMBERS[(method, d)][0]) for d in ("dtd", "eurosat")])
        n = np.mean([np.mean(NUMBERS[(method, d)][1]) for d in ("dtd", "eurosat")])
        avg = rows[(method, "average")]
        assert float(avg["base_mean"]) == pytest.approx(b, abs=1e-4)
        assert float(avg["H"]) == pytest.approx(statistics.harmonic_mean([b, n]), abs=1e-4)
    md = (tmp_path / "tables" / "base2new_shots16.md").read_text()
    b, n = NUMBERS[("coop", "dtd")]
    dtd_row = (
        f"| CoOp | {np.mean(b):.2f} ± {statistics.pstdev(b):.2f} | {np.mean(n):.2f} ± {statistics.pstdev(n):.2f}"
        f" | {2 * np.mean(b) * np.mean(n) / (np.mean(b) + np.mean(n)):.2f} | 3/3 |"
    )
    assert dtd_row in md.split("## DTD")[1]
    png = tmp_path / "tables" / "base2new_shots16_H.png"
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size[0] > 100


def test_paper_average_convention():
    """CLIP's Table 1 average row: H(69.34, 74.22) = 71.70, the H of the averaged Base and New."""
    from meta.data.coop_data import harmonic_mean

    assert harmonic_mean(69.34, 74.22) == pytest.approx(71.70, abs=0.005)


def test_end_signals_and_last_match(tmp_path):
    d = write_run(tmp_path, "a", "* accuracy: 10.0%\nFinish training\n* accuracy: 20.0%\n* accuracy: 30.5%\n")
    assert pr.read_accuracy(d / "log.txt", "train") == 30.5  # before the end signal ignored, last one wins
    d = write_run(tmp_path, "b", "Finished training\n=> result\n* accuracy: 70.0%\n")  # MaPLe's old string
    with pytest.raises(pr.LogProblem, match=r"unfinished run: .*b/log.txt has no 'Finish training'"):
        pr.read_accuracy(d / "log.txt", "train")
    assert pr.read_accuracy(d / "log.txt", "eval") == 70.0
    d = write_run(tmp_path, "c", "Finish training\n")
    with pytest.raises(pr.LogProblem, match="no result"):
        pr.read_accuracy(d / "log.txt", "train")
    with pytest.raises(pr.LogProblem, match="missing log"):
        pr.read_accuracy(tmp_path / "nowhere" / "log.txt", "eval")


def test_missing_and_unfinished_runs_are_named(tmp_path, capsys):
    make_tree(tmp_path, {("coop", "dtd"): ([80.0, 82.0], [50.0, 55.0])})
    write_run(tmp_path, "base2new/train_base/dtd/shots_16/coop/seed3", "epoch [3/10]\n")  # crashed, no new run
    # an older log next to log.txt (Dassl names a rerun's log log.txt-<time>) is ignored: the newest is read
    older = tmp_path / "base2new/train_base/dtd/shots_16/coop/seed1/log.txt-2024-01-01-00-00-00"
    older.write_text(train_log(1.0))
    os.utime(older, (1_000_000_000, 1_000_000_000))
    assert pr.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "unfinished run: " + str(tmp_path / "base2new/train_base/dtd/shots_16/coop/seed3/log.txt") in err
    assert "missing new run: " + str(tmp_path / "base2new/test_new/dtd/shots_16/coop/seed3/log.txt") in err
    rows = read_csv(tmp_path / "tables" / "base2new_shots16.csv")
    assert float(rows[("coop", "dtd")]["base_mean"]) == pytest.approx(81.0)
    assert rows[("coop", "dtd")]["base_seeds"] == "2"
    assert pr.main([str(tmp_path), "--strict"]) == 1


def test_zero_shot_base_runs_are_read_as_eval_logs(tmp_path):
    write_run(tmp_path, "base2new/train_base/dtd/shots_16/zsclip/seed1", EVAL_LOG.format(acc=53.0), mode="eval")
    write_run(tmp_path, "base2new/test_new/dtd/shots_16/zsclip/seed1", EVAL_LOG.format(acc=58.0), mode="eval")
    assert pr.main([str(tmp_path)]) == 0
    r = read_csv(tmp_path / "tables" / "base2new_shots16.csv")[("zsclip", "dtd")]
    assert float(r["H"]) == pytest.approx(2 * 53 * 58 / 111, abs=1e-4)


def test_cross_domain_table_four_shots(tmp_path):
    accs = {
        "imagenetv2": [60.0, 62.0],
        "imagenet_sketch": [46.0, 47.0],
        "imagenet_a": [47.0, 49.0],
        "imagenet_r": [73.0, 75.0],
    }
    for seed, src in ((1, 70.0), (2, 71.0)):
        write_run(tmp_path, f"xd/train_imagenet/shots_4/unigram/seed{seed}", train_log(src), mode="train")
        for target, values in accs.items():
            write_run(
                tmp_path,
                f"xdomain/test/{target}/shots_4/unigram/seed{seed}",
                EVAL_LOG.format(acc=values[seed - 1]),
                mode="eval",
            )
    assert pr.main([str(tmp_path)]) == 0
    rows = read_csv(tmp_path / "tables" / "xdomain_shots4.csv")
    assert float(rows[("unigram", "imagenet")]["mean"]) == pytest.approx(70.5)
    assert float(rows[("unigram", "imagenet_a")]["std"]) == pytest.approx(1.0)
    expected_avg = np.mean([np.mean(v) for v in accs.values()])
    assert float(rows[("unigram", "target_average")]["mean"]) == pytest.approx(expected_avg, abs=1e-4)
    assert "| UNIGRAM | 70.50 ± 0.50 | 61.00 ± 1.00 |" in (tmp_path / "tables" / "xdomain_shots4.md").read_text()
    assert not (tmp_path / "tables" / "xd_shots4.csv").exists()  # no cross-dataset runs, no table


def test_empty_root_is_an_error(tmp_path, capsys):
    assert pr.main([str(tmp_path)]) == 1
    assert "no finished runs under" in capsys.readouterr().err
    assert pr.main([str(tmp_path / "absent")]) == 2


def test_cross_dataset_missing_targets_are_named(tmp_path, capsys):
    write_run(tmp_path, "xd/train_imagenet/shots_16/coop/seed1", train_log(71.0), mode="train")
    write_run(tmp_path, "xd/test/dtd/shots_16/coop/seed1", EVAL_LOG.format(acc=44.0), mode="eval")
    assert pr.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    missing = [line for line in err.splitlines() if "missing target run" in line]
    assert len(missing) == 9 and str(tmp_path / "xd/test/eurosat/shots_16/coop/seed1/log.txt") in err
    rows = read_csv(tmp_path / "tables" / "xd_shots16.csv")
    assert float(rows[("coop", "imagenet")]["mean"]) == 71.0 and float(rows[("coop", "dtd")]["mean"]) == 44.0


def test_coop_and_maple_layout_grouped_by_trainer_and_config(tmp_path):
    """CoOp's/MaPLe's scripts write shots_<K>/<TRAINER>/<CFG>/seed<S>; one row per trainer + config."""
    runs = {
        ("CoOp", "vit_b16_ep50"): ([70.0, 72.0], [60.0, 64.0]),
        ("CoCoOp", "vit_b16_c4_ep10_batch1_ctxv1"): ([80.0, 81.0], [70.0, 73.0]),
        ("CoOp", "vit_b16_ep50_ctxv1"): ([75.0, 75.0], [65.0, 65.0]),
    }
    for (trainer, cfg), (base, new) in runs.items():  # no gram_run.txt: the fork's scripts write none
        for seed, (b, n) in enumerate(zip(base, new), 1):
            write_run(tmp_path, f"base2new/train_base/dtd/shots_16/{trainer}/{cfg}/seed{seed}", train_log(b))
            write_run(tmp_path, f"base2new/test_new/dtd/shots_16/{trainer}/{cfg}/seed{seed}", EVAL_LOG.format(acc=n))
    write_run(tmp_path, "base2new/train_base/dtd/shots_16/gram_coop/seed1", train_log(90.0))  # ours beside them
    write_run(tmp_path, "base2new/test_new/dtd/shots_16/gram_coop/seed1", EVAL_LOG.format(acc=80.0))
    assert pr.main([str(tmp_path), "--strict"]) == 0
    with open(tmp_path / "tables" / "base2new_shots16.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f) if r["dataset"] == "dtd"}
    assert set(rows) == {f"{t}/{c}" for t, c in runs} | {"gram_coop"}
    for (trainer, cfg), (base, new) in runs.items():
        row = rows[f"{trainer}/{cfg}"]
        assert float(row["base_mean"]) == pytest.approx(np.mean(base)) and row["base_seeds"] == "2"
        assert float(row["new_mean"]) == pytest.approx(np.mean(new))
        assert float(row["H"]) == pytest.approx(
            2 * np.mean(base) * np.mean(new) / (np.mean(base) + np.mean(new)), abs=1e-3
        )
    assert float(rows["gram_coop"]["H"]) == pytest.approx(2 * 90 * 80 / 170, abs=1e-3)


def test_average_row_is_the_summary_modules_with_seeds_every_dataset_has(tmp_path):
    """parse_results' Average row = meta.evaluation.summary's (the demo's): each seed averaged over the
    datasets first (seed 3 is only on dtd, so it is left out), mean ± population std over seeds, H of the means."""
    from meta.evaluation.summary import summarise

    numbers = {
        ("coop", "dtd"): ([80.0, 82.0, 90.0], [50.0, 56.0, 40.0]),
        ("coop", "eurosat"): ([60.0, 66.0], [70.0, 62.0]),
    }
    make_tree(tmp_path, numbers)
    assert pr.main([str(tmp_path), "--out", str(tmp_path / "t")]) == 0
    avg = read_csv(tmp_path / "t" / "base2new_shots16.csv")[("coop", "average")]
    base = [(80.0 + 60.0) / 2, (82.0 + 66.0) / 2]  # seeds 1 and 2: 70, 74
    new = [(50.0 + 70.0) / 2, (56.0 + 62.0) / 2]  # 60, 59
    assert float(avg["base_mean"]) == pytest.approx(72.0, abs=1e-4) == pytest.approx(np.mean(base))
    assert float(avg["base_std"]) == pytest.approx(2.0, abs=1e-4) == pytest.approx(np.std(base))
    assert float(avg["new_mean"]) == pytest.approx(59.5, abs=1e-4) == pytest.approx(np.mean(new))
    assert float(avg["new_std"]) == pytest.approx(0.5, abs=1e-4) == pytest.approx(np.std(new))
    assert float(avg["H"]) == pytest.approx(2 * 72.0 * 59.5 / (72.0 + 59.5), abs=1e-4)
    assert avg["base_seeds"] == "2"
    records = pr.base2new_records(pr.collect(tmp_path)[0], 16)
    ref = next(r for r in summarise(records, average="Average") if r["dataset"] == "Average")
    assert (ref["base_mean"], ref["new_std"], ref["H"]) == pytest.approx(
        (float(avg["base_mean"]), float(avg["new_std"]), float(avg["H"])), abs=1e-4
    )
    md = (tmp_path / "t" / "base2new_shots16.md").read_text()
    assert "| CoOp | 72.00 ± 2.00 | 59.50 ± 0.50 | 65.16 | 2 (on all 2 datasets) |" in md


def test_transfer_target_average_is_the_summary_modules_over_complete_seeds(tmp_path, capsys):
    """Seed 2 lacks one target: it is named on stderr and left out of every cell; the target average
    is each seed's mean over the targets, then mean ± std over seeds (numbers by hand)."""
    targets = {
        "imagenetv2": [60.0, 61.0, 64.0],
        "imagenet_sketch": [40.0, None, 44.0],
        "imagenet_a": [50.0, 52.0, 46.0],
        "imagenet_r": [70.0, 71.0, 78.0],
    }
    for seed, src in ((1, 70.0), (2, 71.0), (3, 74.0)):
        write_run(tmp_path, f"xd/train_imagenet/shots_16/coop/seed{seed}", train_log(src), mode="train")
        for target, values in targets.items():
            if values[seed - 1] is not None:
                write_run(
                    tmp_path,
                    f"xdomain/test/{target}/shots_16/coop/seed{seed}",
                    EVAL_LOG.format(acc=values[seed - 1]),
                    mode="eval",
                )
    assert pr.main([str(tmp_path)]) == 0
    assert (
        "missing target run: " + str(tmp_path / "xdomain/test/imagenet_sketch/shots_16/coop/seed2/log.txt")
        in capsys.readouterr().err
    )
    rows = read_csv(tmp_path / "tables" / "xdomain_shots16.csv")
    # seeds 1 and 3: per-seed target means (60+40+50+70)/4 = 55 and (64+44+46+78)/4 = 58
    assert float(rows[("coop", "target_average")]["mean"]) == pytest.approx(56.5, abs=1e-4)
    assert float(rows[("coop", "target_average")]["std"]) == pytest.approx(1.5, abs=1e-4)
    assert float(rows[("coop", "imagenet")]["mean"]) == pytest.approx(72.0, abs=1e-4)
    assert rows[("coop", "imagenet_a")]["seeds"] == "2" and float(rows[("coop", "imagenet_a")]["std"]) == pytest.approx(
        2.0
    )
