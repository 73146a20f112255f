"""The planner's arithmetic (gram_tools.plan) against hand-computed cases on small fake figures files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gram_tools import plan
from gram_tools.realsize import fit_line, fit_points, learner_of, tensor_kind

REPO = Path(__file__).resolve().parents[1]


def _line(a, *b):
    return {"intercept": a, "slopes": list(b)}


def _figures(tmp_path, meta_batch_gpu=4):
    figures = {
        "settings": {"model": "ViT-B-16", "model_mib": 512.0},  # the configs' MODEL.BACKBONE
        "fits": {
            "unigram": {
                "second": {
                    "variables": ["support", "query"],
                    "points": 4,
                    "peak_mib": _line(1000.0, 100.0, 50.0),
                    "gflops": _line(10.0, 2.0, 1.0),
                    "seconds": _line(1.0, 0.5, 0.25),
                    "seconds_per_gflop": 0.5,
                    "load_avg_1min_range": [1, 2],
                }
            },
            "coop": {
                "encode": {
                    "variables": ["batch"],
                    "points": 2,
                    "peak_mib": _line(0.0, 1.0),
                    "gflops": _line(0.0, 35.0),
                    "seconds": _line(0.0, 1.0),
                }
            },
        },
    }
    gpu = {
        "settings": {
            "way": 5,
            "support_shots": 4,
            "query_shots": 8,
            "meta_batch": meta_batch_gpu,
            "gpu": "fake",
            "autocast": "none",
        },
        "variants": {"unigram": {"second_order_step_s": 0.9}},
        "chc_images_per_s": 1000.0,
    }
    chc = {
        "growth": {
            "text_embeddings": {
                "items": [1, 2],
                "seconds": [0.01, 0.02],
                "items_per_pair": 0.5,
                "seconds_law": {"c": 0.01, "p": 1.0},
                "rss_law": {"intercept": 512.0, "slope": 1 / 1024},
            },
            "umap_hdbscan_fit": {
                "items": [1, 2],
                "seconds": [0.002, 0.004],
                "items_per_pair": 1.0,
                "seconds_law": {"c": 0.002, "p": 1.0},
                "rss_law": None,
            },
        }
    }
    paths = {}
    for name, obj in (("figures", figures), ("gpu", gpu), ("chc", chc)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    return paths


def _run(capsys, paths, *extra, gpu=False):
    argv = [
        "--config-file",
        "configs/meta/train_unigram.yaml",
        "--figures",
        str(paths["figures"]),
        "--gpu-figures",
        str(paths["gpu"]) if gpu else str(paths["gpu"]) + ".absent",
        "--chc-figures",
        str(paths["chc"]),
        *extra,
    ]
    assert plan.main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_memory_fit_and_largest_sizes(tmp_path, capsys):
    # train_unigram: K 5, N_SUPPORT 4, N_QUERY 8 -> s = 20, q = 40 images
    out = _run(capsys, _figures(tmp_path), "--gpu-memory-gib", "8", "--margin", "0.1")["meta_training"]
    assert out["learner"] == "unigram" and out["mode"] == "second"
    assert out["images"] == {"support": 20.0, "query": 40.0}
    assert out["task_peak_gib"]["value"] == round(5000 / 1024, 3)  # 1000 + 100*20 + 50*40
    assert out["peak_gib"]["value"] == round(5512 / 1024, 3)  # + 512 MiB weights
    assert out["fits"] is True
    # budget 8 * 1024 * 0.9 - 512 = 6860.8 MiB; support: (6860.8 - 3000) / (100 * 5) -> 7; query: / (50 * 5) -> 15
    assert out["largest_n_support"] == 7 and out["largest_n_query"] == 15
    assert out["task_peak_gib"]["how"].startswith("estimated") and "measured" in out["weights_gib"]["how"]


def test_does_not_fit(tmp_path, capsys):
    out = _run(capsys, _figures(tmp_path), "--gpu-memory-gib", "4", "--margin", "0")["meta_training"]
    # budget 4096 - 512 = 3584 < 5000; support alone (1000 + 2000 + 0) fits -> (3584 - 3000) / 500 = 1; query (3584 -
    # 3000) / 250 = 2
    assert out["fits"] is False and out["largest_n_support"] == 1 and out["largest_n_query"] == 2


def test_hours_from_flops_and_from_gpu_figures(tmp_path, capsys):
    paths = _figures(tmp_path)
    out = _run(capsys, paths, "--gpus", "2", "--gpu-tflops", "100")["meta_training"]
    # 4 tasks x (10 + 2*20 + 1*40) GFLOP = 360 GFLOP per step; 10,000 steps / (100 TFLOP/s x 2) = 18 s
    assert out["step_gflop"]["value"] == 360.0
    assert out["hours"]["value"] == round(18 / 3600, 3)
    assert "assumed" in out["hours"]["how"]
    assert out["cpu_step_seconds"]["value"] == 360 * 0.5  # step GFLOP x s per GFLOP
    out = _run(capsys, paths, "--gpus", "2", gpu=True)["meta_training"]
    assert out["hours"]["value"] == 1.25 and out["hours"]["how"].startswith("measured")  # 10,000 x 0.9 s / 2
    # 8 GPUs for 4 tasks: one task per GPU, the other 4 wait -> 10,000 x 90 GFLOP / 100 TFLOP/s = 9 s
    out = _run(capsys, paths, "--gpus", "8", "--gpu-tflops", "100")["meta_training"]
    assert out["hours"]["value"] == round(9 / 3600, 3)
    out = _run(capsys, paths, "--gpus", "3", gpu=True)["meta_training"]
    assert out["hours"]["value"] == round(10000 * 0.9 * 2 / 4 / 3600, 3)  # ceil(4 / 3) = 2 tasks on the slowest GPU
    # GPU figures for another task size are not used
    paths = _figures(tmp_path, meta_batch_gpu=8)
    out = _run(capsys, paths, "--gpus", "2", "--gpu-tflops", "100", gpu=True)["meta_training"]
    assert out["hours"]["how"].startswith("estimated")


def test_chc_stages(tmp_path, capsys):
    paths = _figures(tmp_path)
    chc = _run(capsys, paths, "--pairs", "1e6", "--gpus", "2", "--gpu-tflops", "100")["chc"]
    assert chc["text_embeddings"]["items"] == 1000000 and chc["text_embeddings"]["cpu_hours"] == round(10000 / 3600, 3)
    assert chc["text_embeddings"]["peak_rss_gib"] == round((512 + 1000000 / 1024) / 1024, 2)
    # the fitting stage stops at FIT_SAMPLE (200 k in the defaults): 0.002 x 2e5 = 400 s
    assert chc["umap_hdbscan_fit"]["items"] == 200000 and chc["umap_hdbscan_fit"]["cpu_hours"] == round(400 / 3600, 3)
    # 1e6 images x 35 GFLOP / (100 TFLOP/s x 2) = 175 s
    assert chc["image_features"]["gpu_hours"] == round(175 / 3600, 3)
    chc = _run(capsys, paths, "--pairs", "1e6", "--gpus", "2", gpu=True)["chc"]
    assert chc["image_features"]["gpu_hours"] == round(1e6 / 1000 / 3600 / 2, 3)


def test_errors_are_one_line(tmp_path, capsys):
    paths = _figures(tmp_path)
    argv = [
        "--config-file",
        "configs/meta/train_vpt.yaml",
        "--figures",
        str(paths["figures"]),
        "--gpu-figures",
        "absent.json",
        "--chc-figures",
        "absent.json",
    ]
    assert plan.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(paths["figures"]) in err and "'vpt'" in err
    assert plan.main(argv[:2] + ["--figures", str(tmp_path / "none.json")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err


def test_realsize_fits_and_learner_table():
    xs = np.array([[1, 1], [3, 1], [1, 3], [2, 2]], dtype=float)
    y = 7.0 + 3.0 * xs[:, 0] + 0.5 * xs[:, 1]
    fit = fit_line(xs, y)
    assert fit["intercept"] == pytest.approx(7.0) and fit["slopes"] == pytest.approx([3.0, 0.5])
    points = [
        {
            "learner": "vpt",
            "mode": "second",
            "support": s,
            "query": q,
            "peak_mib": 10 + 2 * s + q,
            "flops": int(1e9 * (5 * s + 4 * q)),
            "seconds": 1.0 + s,
            "load_avg_1min": [1.0],
            "repeats": 1,
        }
        for s, q in [(1, 1), (3, 1), (1, 3)]
    ]
    f = fit_points(points)["vpt"]["second"]
    assert f["peak_mib"]["slopes"] == pytest.approx([2.0, 1.0]) and f["gflops"]["slopes"] == pytest.approx([5.0, 4.0])
    assert [learner_of(4, 0, 1), learner_of(0, 4, 1), learner_of(0, 4, 12), learner_of(2, 2, 1)] == [
        "coop",
        "vpt",
        "vpt_deep",
        "unigram",
    ]
    assert tensor_kind((2, 12, 197, 197), 197, 768).startswith("attention")
    assert tensor_kind((2, 197, 3072), 197, 768).startswith("mlp")
    assert tensor_kind((2, 197, 768), 197, 768).startswith("tokens")


# ----------------------------------------------------------------------------- scripts/gpu_check.sh
def _gpu_check(tmp_path, python):
    env = {**os.environ, "PYTHON": str(python), "FIGURES_DIR": str(tmp_path / "figs")}
    return subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=REPO
    )


def test_gpu_check_without_cuda_stops_in_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$*" in *cuda.is_available*) exit 1;; esac\necho unexpected; exit 0\n')
    fake.chmod(0o755)
    proc = _gpu_check(tmp_path, fake)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: scripts/gpu_check.sh: CUDA is not available on this machine (torch.cuda.is_available() is False "
        f"with {fake})"
    ]


def test_gpu_check_writes_the_planner_figures(tmp_path):
    """With CUDA (faked), the script runs the gpu tests, both benches, and copies each bench's JSON line."""
    fake = tmp_path / "python"
    calls = tmp_path / "calls.txt"
    fake.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in\n'
        "  *cuda.is_available*) exit 0;;\n"
        "  '-m pytest'*) echo '3 passed'; exit 0;;\n"
        '  \'-m gram_tools.bench\'*) echo \'coop: ...\'; echo "{\\"autocast\\": \\"$6\\"}"; exit 0;;\n'
        '  \'-m gram_tools.profile_gpu\'*) echo \'{"finished": ["bf16"]}\' > "$5"; exit 0;;\n'
        f'  *) exec {sys.executable} "$@";;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    proc = _gpu_check(tmp_path, fake)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "figs" / "gpu_figures.json").read_text()) == {"autocast": "none"}
    assert json.loads((tmp_path / "figs" / "gpu_figures_bf16.json").read_text()) == {"autocast": "bf16"}
    lines = calls.read_text().splitlines()
    assert "-m pytest -q -rs -m gpu tests" in lines
    # fp32: no task-scaling table and no CHC batch sweep (empty lists); bf16: both, at the bench's defaults
    assert "-m gram_tools.bench --device cuda --autocast none --scaling-tasks  --chc-batches " in lines
    assert "-m gram_tools.bench --device cuda --autocast bf16" in lines
    # the step profile and CHC rates (profile_gpu), its JSON copied beside the planner's figures
    assert f"-m gram_tools.profile_gpu --bf16-weights --out {tmp_path / 'out' / 'profile.json'}" in lines
    assert json.loads((tmp_path / "figs" / "gpu_profile.json").read_text()) == {"finished": ["bf16"]}


def test_chc_growth_laws():
    from gram_tools.chc_growth import fit_growth, predict

    runs = [
        {
            "pairs": n,
            "stages": {
                "text_embeddings": {"items": n // 2, "seconds": 0.02 * (n // 2), "peak_rss_mib": 1000 + (n // 2) / 100},
                "umap_hdbscan_fit": {"items": n, "seconds": 1e-4 * n**1.5, "peak_rss_mib": 1200.0},
            },
        }
        for n in (10000, 40000, 100000)
    ]
    runs[0]["stages"]["umap_hdbscan_fit"]["seconds"] = 1e6  # 500 UMAP epochs at <= 10,000 points: not fitted
    g = fit_growth(runs, fit_sample=200000, target=3.1e6)
    text, fit = g["text_embeddings"], g["umap_hdbscan_fit"]
    assert text["seconds_law"]["p"] == pytest.approx(1.0) and text["items_per_pair"] == 0.5
    assert text["target_items"] == 3100000 and text["target_seconds"] == pytest.approx(0.02 * 3100000, rel=1e-6)
    assert text["rss_law"]["slope"] == pytest.approx(0.01) and text["rss_law"]["intercept"] == pytest.approx(1000)
    assert fit["seconds_law"]["p"] == pytest.approx(1.5) and fit["items"] == [40000, 100000]
    assert fit["target_items"] == 200000  # capped by FIT_SAMPLE
    assert fit["target_seconds"] == pytest.approx(1e-4 * 200000**1.5, rel=1e-4)
    assert text["time"] == "seconds"
    for r in runs:  # CPU seconds, when every run has them, are what the law fits
        r["stages"]["text_embeddings"]["cpu_seconds"] = 1e-3 * r["stages"]["text_embeddings"]["items"] ** 1.1
    text = fit_growth(runs, fit_sample=200000)["text_embeddings"]
    assert text["time"] == "cpu_seconds" and text["seconds_law"]["p"] == pytest.approx(1.1)
    assert predict({"c": 2.0, "p": 2.0}, 3.0) == 18.0 and predict({"intercept": 1.0, "slope": 2.0}, 3.0) == 7.0


def test_cost_tables_compute_the_task_total(tmp_path):
    from gram_tools.cost_tables import realsize_table

    figures = json.loads(_figures(tmp_path)["figures"].read_text())
    figures["fits"]["unigram"]["second"]["load_avg_1min_range"] = [5.0, 6.0]
    table = realsize_table(figures, 5, 4, 8).splitlines()
    assert len(table) == 3  # header, rule, the one meta-task row
    # 1000 + 100*20 + 50*40 = 5000 MiB = 4.88 GiB; 10 + 2*20 + 40 = 90 GFLOP; x 0.5 s/GFLOP = 45 s
    assert table[2] == (
        "| unigram | second order | 1,000 | 100 | 50 | 2.0 / 1.0 | 4.88 GiB, 0.09 TFLOP | 45 (5.0-6.0) |"
    )


def test_first_order_peak_follows_the_larger_pass(tmp_path, capsys):
    paths = _figures(tmp_path)
    figures = json.loads(paths["figures"].read_text())
    figures["fits"]["unigram"]["first"] = {
        "variables": ["support", "query"],
        "points": 4,
        "load_avg_1min_range": [1, 2],
        "peak_mib": {"intercept": 100.0, "slopes": [70.0], "variables": ["max(support, query)"]},
        "gflops": _line(0.0, 1.0, 1.0),
        "seconds": _line(0.0, 1.0, 1.0),
    }
    paths["figures"].write_text(json.dumps(figures))
    out = _run(capsys, paths, "--gpu-memory-gib", "4", "--margin", "0", "META.FIRST_ORDER", "True")["meta_training"]
    assert out["mode"] == "first"
    assert out["task_peak_gib"]["value"] == round((100 + 70 * 40) / 1024, 3)  # max(20, 40) query images
    # budget 4096 - 512 = 3584: a pass of n * 5 images fits while 100 + 350 n <= 3584 -> n = 9
    assert out["largest_n_support"] == 9 and out["largest_n_query"] == 9
    from gram_tools.realsize import fit_points

    pts = [
        {
            "learner": "vpt",
            "mode": "first",
            "support": s,
            "query": q,
            "peak_mib": 5 + 70 * max(s, q),
            "flops": int(1e9 * (s + q)),
            "seconds": 0.1 * (s + q) * (1 + (s == 3)),
            "load_avg_1min": [1.0],
            "repeats": 1,
        }
        for s, q in [(1, 1), (3, 1), (1, 3), (2, 2)]
    ]
    f = fit_points(pts)["vpt"]["first"]["peak_mib"]
    assert f["variables"] == ["max(support, query)"] and f["slopes"] == pytest.approx([70.0])
    assert f["intercept"] == pytest.approx(5.0)
    assert fit_points(pts)["vpt"]["first"]["seconds_per_gflop"] == pytest.approx(0.1)  # median of 0.1, 0.2, 0.1, 0.1


def test_chc_table_prints_the_measured_file():
    from gram_tools.chc_growth import fit_growth
    from gram_tools.cost_tables import chc_table

    runs = [
        {
            "pairs": n,
            "stages": {"index": {"items": n, "seconds": 9.0, "cpu_seconds": 1e-3 * n, "peak_rss_mib": 1000 + n / 100}},
        }
        for n in (10000, 100000)
    ]
    table = chc_table({"runs": runs, "growth": fit_growth(runs, fit_sample=200000)}).splitlines()
    assert table[0].startswith("| stage | 10,000 pairs: s (peak RSS MiB) | 100,000 pairs: s (peak RSS MiB) |")
    # 1e-3 x 3.1e6 = 3100 s = 0.86 h; 1000 + 31000 MiB = 31.2 GiB
    assert table[2] == (
        "| index | 10.00 (1,100) | 100.00 (2,000) | CPU s = 0.001 x items^1.00 | 1,000 + 0.0100 x items "
        "| 3,100,000 | 0.86 h | 31.2 GiB |"
    )


def test_chc_extrapolation_is_never_below_linear_growth():
    from gram_tools.chc_growth import fit_growth

    # a fixed cost of 20 s plus 1 ms per item: the fitted exponent is below 1, the largest run scaled linearly wins
    runs = [
        {
            "pairs": n,
            "stages": {
                "index": {"items": n, "seconds": 20 + 1e-3 * n, "cpu_seconds": 20 + 1e-3 * n, "peak_rss_mib": 1000.0},
                "assign_nearest_centroid": {"items": n, "seconds": 0.5, "cpu_seconds": 9.0, "peak_rss_mib": 1000.0},
            },
        }
        for n in (10000, 100000)
    ]
    g = fit_growth(runs, fit_sample=200000, target=1e6)
    index = g["index"]
    assert index["seconds_law"]["p"] < 1 and index["extrapolation"].startswith("largest run")
    assert index["target_seconds"] == pytest.approx(120.0 * 10)  # 120 s at 1e5 items, x 10
    short = g["assign_nearest_centroid"]  # under 1 s of wall time: wall seconds
    assert short["time"] == "seconds" and short["seconds"] == [0.5, 0.5] and short["target_seconds"] == 5.0


def test_unmeasured_prompt_shapes_are_refused(tmp_path, capsys):
    # IVLP (deep text and vision prompts) and MaPLe (coupled prompts) have no real-size row: one line, exit 2,
    # never another learner's figures
    from gram_tools.realsize import learner_of

    assert learner_of(2, 2, 0, 0, "none") == "ivlp" and learner_of(2, 0, 1, 9, "maple") == "maple"
    assert learner_of(4, 0, 1) == "coop" and learner_of(2, 2, 1) == "unigram" and learner_of(0, 2, 0) == "vpt_deep"
    paths = _figures(tmp_path)
    for config, name in (("configs/meta/train_ivlp.yaml", "'ivlp'"), ("configs/meta/train_maple.yaml", "'maple'")):
        argv = [
            "--config-file",
            config,
            "--figures",
            str(paths["figures"]),
            "--gpu-figures",
            "absent.json",
            "--chc-figures",
            "absent.json",
        ]
        assert plan.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and name in err and "META.PROMPT" in err


def test_deep_learners_are_planned_from_gpu_figures_at_their_task_size(tmp_path, capsys):
    # with GPU figures measured at the config's task size (bench --device cuda measures ivlp and maple), the
    # planner answers from them: measured peak and step seconds, no fitted line hence no largest sizes
    paths = _figures(tmp_path)
    gpu = json.loads(paths["gpu"].read_text())
    gpu["variants"]["maple"] = {"second_order_step_s": 0.5, "second_order_peak_mb": 6144.0}
    paths["gpu"].write_text(json.dumps(gpu))
    argv = [
        "--config-file",
        "configs/meta/train_maple.yaml",
        "--figures",
        str(paths["figures"]),
        "--gpu-figures",
        str(paths["gpu"]),
        "--chc-figures",
        "absent.json",
        "--gpu-memory-gib",
        "8",
        "--margin",
        "0.2",
        "--gpus",
        "2",
    ]
    assert plan.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["meta_training"]
    assert out["learner"] == "maple" and out["peak_gib"]["value"] == 6.0 and out["fits"] is True  # 6 <= 8 x 0.8
    assert out["hours"]["value"] == round(10000 * 0.5 * 2 / 4 / 3600, 3)  # META.STEPS x s x ceil(4 / 2) / 4
    assert "largest_n_support" not in out
    assert plan.main(argv[:-6] + ["--gpu-memory-gib", "6", "--margin", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["meta_training"]["fits"] is False
    for other in ("first", "ivlp"):  # another mode or learner than measured: refused as before
        argv2 = (
            argv + ["META.FIRST_ORDER", "True"]
            if other == "first"
            else [a.replace("train_maple", "train_ivlp") for a in argv]
        )
        assert plan.main(argv2) == 2
        assert "gpu_check.sh" in capsys.readouterr().err


def test_memory_of_the_stacked_meta_batch_follows_task_batching(tmp_path, capsys):
    """On a GPU ``META.TASK_BATCHING auto`` stacks a rank's tasks and halves the stack until it fits
    (meta.method.batched.TaskBatching); ``on`` keeps the stack, ``off`` and several GPUs hold fewer."""
    paths = _figures(tmp_path)  # one task 5000 MiB, weights 512 MiB, META_BATCH 4

    def meta(*extra):
        return _run(capsys, paths, "--margin", "0", *extra)["meta_training"]

    out = meta("--gpu-memory-gib", "30")  # budget 30720 - 512: 4 x 5000 fits
    assert out["task_batching"]["chunk"] == 4 and out["peak_gib"]["value"] == round(20512 / 1024, 3) and out["fits"]
    out = meta("--gpu-memory-gib", "16")  # budget 15872: 4 tasks do not fit, 2 do
    assert out["task_batching"]["chunk"] == 2 and out["peak_gib"]["value"] == round(10512 / 1024, 3) and out["fits"]
    assert "settles on 2" in out["task_batching"]["how"]
    assert (out["largest_n_support"], out["largest_for_tasks_per_pass"]) == (25, 1)  # (15872 - 3000) / 500
    out = meta("--gpu-memory-gib", "16", "META.TASK_BATCHING", "on")  # the whole stack must fit: it does not
    assert out["task_batching"]["chunk"] == 4 and out["fits"] is False
    # per task 15872 / 4 = 3968 MiB: support (3968 - 3000) / 500 -> 1, query (3968 - 3000) / 250 -> 3
    assert (out["largest_n_support"], out["largest_n_query"], out["largest_for_tasks_per_pass"]) == (1, 3, 4)
    for extra in (["META.TASK_BATCHING", "off"], ["--gpus", "4"]):
        out = meta("--gpu-memory-gib", "30", *extra)
        assert out["task_batching"]["chunk"] == 1 and out["peak_gib"]["value"] == round(5512 / 1024, 3)
    out = meta("--gpu-memory-gib", "30", "--gpus", "2")  # 2 tasks per GPU
    assert out["task_batching"]["chunk"] == 2 and out["task_batching"]["tasks_per_gpu"] == 2


def test_gpu_figures_are_read_for_the_configs_autocast_and_named_once(tmp_path, capsys):
    paths = _figures(tmp_path)  # GPU figures measured in fp32 ("autocast": "none") on the card "fake"
    out = _run(capsys, paths, "--gpus", "2", gpu=True)["meta_training"]
    assert out["hours"]["how"].startswith("measured: fake, fp32 (gpu figures)")
    out = _run(capsys, paths, "--gpus", "2", "META.AUTOCAST", "bf16", gpu=True)["meta_training"]
    assert out["hours"]["how"].startswith("estimated")  # fp32 step times are not bf16 ones
    assert "upper bound for META.AUTOCAST bf16" in out["peak_gib"]["how"]
    assert plan.card_label({"gpu": "NVIDIA H200", "autocast": "bf16"}) == "NVIDIA H200, bf16 autocast"
    assert plan.default_gpu_figures("bf16").endswith("docs/gpu_figures_bf16.json")
    assert plan.default_gpu_figures("none").endswith("docs/gpu_figures.json")
    assert plan.default_gpu_figures("fp16").endswith("docs/gpu_figures.json")  # none measured: compared, not used


def test_realsize_doc_shows_the_planners_table_of_the_committed_figures():
    """docs/realsize.md's planner table is what the planner says today on the committed figures (no number by hand)."""
    from gram_tools.cost_tables import backbone_table, planner_table

    doc = (REPO / "docs" / "realsize.md").read_text()
    table = planner_table()
    assert table.count("\n") >= 3 and table in doc
    assert "MODEL.BACKBONE RN50" in table and "| train_cocoop | cocoop, 2nd order |" in table
    backbones = backbone_table(5, 4, 8)
    assert backbones in doc and backbones.count("\n") == 6  # header, rule and the five backbones


def test_each_backbone_is_planned_from_its_own_measured_figures(tmp_path, capsys):
    """One figures file per backbone (gram_tools.realsize --model); the planner reads the config's, and refuses a file
    measured on another backbone in one line that says how to measure this one."""
    from gram_tools.backbone_table import BACKBONES
    from gram_tools.realsize import DEFAULT_OUT, figures_path

    assert figures_path("ViT-B-16") == DEFAULT_OUT and figures_path("RN50") == "docs/realsize_cpu_RN50.json"
    for backbone in BACKBONES:  # every backbone CoOp ships configs for, and ViT-L/14: text learners measured
        figures = json.loads((REPO / figures_path(backbone)).read_text())
        assert figures["settings"]["model"] == backbone
        assert {"second", "first", "finetune"} <= set(figures["fits"]["coop"]) and "encode" in figures["fits"]["coop"]
        assert "second" in figures["fits"]["cocoop"] and "finetune" in figures["fits"]["cocoop"]
    rn50 = json.loads((REPO / figures_path("RN50")).read_text())
    argv = ["--config-file", "configs/meta/train_coop.yaml", "--chc-figures", str(tmp_path / "absent.json")]
    assert plan.main([*argv, "MODEL.BACKBONE", "RN50"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["meta_training"]
    assert out["learner"] == "coop" and "RN50 random weights" in out["task_peak_gib"]["how"]
    assert figures_path("RN50") in out["task_peak_gib"]["how"]
    assert out["weights_gib"]["value"] == pytest.approx(rn50["settings"]["model_mib"] / 1024, abs=1e-3)
    # the ViT-B/16 figures answer a ViT-B/16 config, not a ResNet one
    vit = plan.default_path(DEFAULT_OUT)
    assert plan.main([*argv, "--figures", vit, "MODEL.BACKBONE", "RN101"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: MODEL.BACKBONE RN101: ")
    assert "measured on ViT-B-16" in err and "gram_tools.realsize --model RN101" in err
    # a backbone nobody measured: the missing file is named with the command that writes it
    assert plan.main([*argv, "MODEL.BACKBONE", "ViT-B-32-quickgelu"]) == 2
    err = capsys.readouterr().err
    assert "realsize_cpu_ViT-B-32-quickgelu.json: no such file" in err and "--model ViT-B-32-quickgelu" in err


# ----------------------------------------------------------------------------- --test-time (one TPT image)
def _with_testtime(paths, tflops_achieved=None):
    """The fake figures with a UNIGRAM test-time plane measured at views 8-32, classes 10-40."""
    figures = json.loads(paths["figures"].read_text())
    figures["fits"]["unigram"]["testtime"] = {
        "variables": ["views", "classes", "views x classes"],
        "points": 6,
        "peak_mib": {**_line(100.0, 50.0, 2.0), "variables": ["views", "classes"]},
        "gflops": _line(10.0, 60.0, 2.0, 0.001),
        "seconds": {**_line(0.0, 1.0, 0.1), "variables": ["views", "classes"]},
        "seconds_per_gflop": 0.5,
        "load_avg_1min_range": [1, 2],
    }
    figures["points"] = [
        {"learner": "unigram", "mode": "testtime", "views": v, "classes": c} for v in (8, 16, 32) for c in (10, 40)
    ]
    paths["figures"].write_text(json.dumps(figures))
    if tflops_achieved is not None:
        gpu = json.loads(paths["gpu"].read_text())
        gpu["variants"]["unigram"]["first_order_tflops_achieved"] = tflops_achieved
        paths["gpu"].write_text(json.dumps(gpu))
    return paths


def test_test_time_line_is_the_fitted_planes_at_tpts_size(tmp_path, capsys):
    paths = _with_testtime(_figures(tmp_path), tflops_achieved=40.0)
    out = _run(capsys, paths, "--gpu-tflops", "30", "--test-time")["test_time"]  # default: 64 views, 1000 classes
    assert (out["learner"], out["views"], out["classes"], out["kept_views"]) == ("unigram", 64, 1000, 6)
    # peak 100 + 50 x 64 + 2 x 1000 = 5300 MiB, + 512 MiB weights; GFLOP 10 + 60 x 64 + 2 x 1000 + 0.001 x 64000
    assert out["image_peak_gib"]["value"] == round(5300 / 1024, 3)
    assert out["peak_gib"]["value"] == round(5812 / 1024, 3)
    assert out["gflop"]["value"] == 5914.0 and out["cpu_seconds"]["value"] == 2957.0
    assert "extrapolated beyond the measured grid" in out["image_peak_gib"]["how"]
    assert out["gpu_seconds"]["value"] == round(5914 / 30e3, 3) and "FLOP estimate" in out["gpu_seconds"]["how"]
    # the GPU figures' measured first-order rate of the same learner (forward + backward through the image tower)
    out = _run(capsys, paths, "--test-time", "16", "40", gpu=True)["test_time"]
    assert out["gflop"]["value"] == round(10 + 60 * 16 + 2 * 40 + 0.001 * 640, 1)
    assert "inside the measured grid" in out["gflop"]["how"]
    assert out["gpu_seconds"]["value"] == round(out["gflop"]["value"] / 40e3, 3)
    assert "40 TFLOP/s" in out["gpu_seconds"]["how"] and "first-order" in out["gpu_seconds"]["how"]
    assert all(row["source"].startswith("https://github.com/") for row in out["published_tpt"])
    assert plan.main(_plan_argv(paths, "--test-time", "16", "40")) == 0
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  test-time prompt tuning, one image: learner unigram, 16 views") for line in printed)
    assert sum(line.startswith("    published TPT: ") for line in printed) == len(plan.PUBLISHED_TPT)


def _plan_argv(paths, *extra):
    return [
        "--config-file",
        "configs/meta/train_unigram.yaml",
        "--figures",
        str(paths["figures"]),
        "--gpu-figures",
        str(paths["gpu"]) + ".absent",
        "--chc-figures",
        str(paths["chc"]),
        *extra,
    ]


def test_test_time_refuses_figures_without_a_testtime_plane(tmp_path, capsys):
    paths = _figures(tmp_path)
    assert plan.main(_plan_argv(paths, "--test-time")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(paths["figures"]) in err and "fits.unigram.testtime" in err
    assert "--modes testtime" in err
    for bad in (["64"], ["64", "0"], ["64", "x"], ["1", "2", "3"]):
        assert plan.main(_plan_argv(_with_testtime(paths), "--test-time", *bad)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: --test-time: expected nothing")


def test_test_time_on_the_committed_figures(tmp_path, capsys):
    """The committed ViT-B/16 figures answer --test-time for CoOp and UNIGRAM: the planes at 64 x 1000 as the file
    holds them, GPU seconds at the rates the committed GPU figures measured, TPT's published figures beside."""
    from gram_tools.realsize import DEFAULT_OUT

    figures = json.loads((REPO / DEFAULT_OUT).read_text())
    for config, learner in (("train_coop", "coop"), ("train_unigram", "unigram")):
        argv = ["--config-file", f"configs/meta/{config}.yaml", "--chc-figures", str(tmp_path / "absent.json")]
        assert plan.main([*argv, "--test-time"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["test_time"]
        fit = figures["fits"][learner]["testtime"]
        assert out["gflop"]["value"] == round(plan.line_value(fit["gflops"], [64, 1000, 64000]), 1)
        step = plan.line_value(fit["peak_mib"], [64, 1000])
        encode = plan.line_value(fit["views_peak_mib"], [64]) if "views_peak_mib" in fit else 0.0
        assert out["image_peak_gib"]["value"] == round(max(step, encode) / 1024, 3)
        assert out["gpu_seconds"]["how"].startswith("estimated: ") and out["gpu_seconds"]["value"] > 0
        assert ("images/s" if learner == "coop" else "first-order meta-step") in out["gpu_seconds"]["how"]
        sources = " ".join(row["source"] for row in out["published_tpt"])
        assert "https://github.com/azshue/TPT" in sources and "https://github.com/kdiAAA/TDA" in sources


def test_realsize_doc_shows_the_test_time_tables_of_the_committed_figures():
    """docs/realsize.md's test-time tables (measured points, fitted planes, the planner at 64 x 1000) are what
    gram_tools.cost_tables prints from the committed figures today."""
    from gram_tools.cost_tables import testtime_fit_table, testtime_plan_table, testtime_points_table
    from gram_tools.realsize import DEFAULT_OUT

    doc = (REPO / "docs" / "realsize.md").read_text()
    figures = json.loads((REPO / DEFAULT_OUT).read_text())
    points = testtime_points_table(figures)
    assert points.count("\n") >= 2 + 12 and points in doc  # header, rule, CoOp's 12 points and UNIGRAM's
    fits = testtime_fit_table(figures)
    assert "| coop |" in fits and "| unigram |" in fits and fits in doc
    planned = testtime_plan_table()
    assert planned.count("\n") == 3 and planned in doc
