"""Bad input to an entry point ends in ONE ``error: ...`` line naming the flag, key or file, and exit status 2.

Each case called the entry point's ``main(argv)`` (or ran it) and met a traceback or silence before its rule.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import one_error_line, resave_tensors, tiny_chc_args
from helpers_chc import png_bytes
from safetensors.torch import load_file, save_file

from meta.finetune.init_io import CAST_TO_FLOAT32, InitMismatchError, load_gram_init

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- 1. gram_tools.plan numeric flags
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--pairs", "1e300"),  # was: OverflowError in the CHC growth law
        ("--pairs", "inf"),
        ("--gpu-memory-gib", "1e308"),  # was: OverflowError (float infinity to integer)
        ("--gpu-memory-gib", "-1"),
        ("--gpus", "100001"),
        ("--gpu-tflops", "1e-300"),
        ("--margin", "nan"),
    ],
)
def test_plan_numeric_flag_out_of_range(capsys, flag, value):
    from gram_tools.plan import main

    code = main(["--config-file", str(REPO / "configs/meta/train_vpt.yaml"), flag, value])
    line = one_error_line(capsys, flag)
    assert code == 2 and line.startswith(f"error: {flag}: expected ")


# ---------------------------------------------------------------- 2. gram_tools.bench --threads
@pytest.mark.parametrize("threads", ["0", "-3"])
def test_bench_threads_below_one(capsys, threads):
    from gram_tools.bench import main

    code = main(["--threads", threads])
    line = one_error_line(capsys, "--threads")
    assert code == 2 and line == f"error: --threads: expected an integer >= 1, got {threads}"


# ---------------------------------------------------------------- 3. --jobs of the demo and the study
@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_demo_jobs_below_one(capsys, jobs):
    from gram_world.demo.cli import main

    code = main(["--quick", "--jobs", jobs, "--out", "/nonexistent/never-written"])
    line = one_error_line(capsys, "--jobs")
    assert code == 2 and line.startswith("error: --jobs: expected an integer >= 1") and line.endswith(f"got {jobs}")


@pytest.mark.parametrize("jobs", ["0", "-3"])
def test_study_jobs_below_one(capsys, jobs):
    from gram_world.study import main

    code = main(["summary", "--quick", "--jobs", jobs, "--out", "/nonexistent/never-written"])
    line = one_error_line(capsys, "--jobs")
    assert code == 2 and line.startswith("error: --jobs: expected an integer >= 1") and line.endswith(f"got {jobs}")


def test_bench_threads_as_a_command():
    """The same rule through ``python -m`` (stderr is exactly one line, no traceback)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GRAM_DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-m", "gram_tools.bench", "--threads", "-3"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert one_error_line(done.stderr, "--threads") == "error: --threads: expected an integer >= 1, got -3"


# ---------------------------------------------------------------- 4. HDBSCAN finds no cluster
def test_cluster_without_any_cluster_names_min_cluster_size(tmp_path, capsys, monkeypatch):
    from meta.chc import topics as topics_mod
    from meta.chc.cli import main

    n = 24
    rows = ["image,caption"]
    for i in range(n):
        (tmp_path / f"{i}.png").write_bytes(png_bytes((10 * i % 256, 200 - 5 * i, 40)))
        rows.append(f"{i}.png,a picture of thing number {i} on a table")
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    # what hdbscan returns when MIN_CLUSTER_SIZE is too large for the corpus: every caption noise (-1);
    # (the real UMAP + HDBSCAN fit costs tens of seconds of numba compilation)
    monkeypatch.setattr(topics_mod, "fit_sample_clusters", lambda emb, *a, **k: np.full(len(emb), -1, np.int64))
    opts = ("CHC.INPUT.MANIFEST", str(tmp_path / "m.csv"), "CHC.TOPICS.MIN_CLUSTER_SIZE", "20")
    code = main(tiny_chc_args(tmp_path / "out", *opts, "CHC.TOPICS.PLOT_POINTS", "0"))
    line = one_error_line(capsys, "CHC.TOPICS.MIN_CLUSTER_SIZE", f"{n} unique captions", f"{n} pairs", progress=True)
    assert code == 2 and line.startswith("error: CHC.TOPICS.MIN_CLUSTER_SIZE: HDBSCAN found no cluster")


# ---------------------------------------------------------------- 5. init file dtypes
@pytest.mark.parametrize("dtype", CAST_TO_FLOAT32, ids=str)
def test_init_half_bf16_double_load_as_float32(init_file, tmp_path, dtype):
    path = resave_tensors(init_file, tmp_path / "init.safetensors", dtype)
    assert {v.dtype for v in load_file(str(path)).values()} == {dtype}
    loaded = load_gram_init(path)
    reference = load_gram_init(init_file)
    for name, t in loaded.prompt.items():
        assert t.dtype == torch.float32
        torch.testing.assert_close(t, reference.prompt[name].to(dtype).float())
    for pname, params in loaded.regulators.items():
        assert {t.dtype for t in params.values()} == {torch.float32}
    g = torch.randn(2, 64)
    regulated = loaded.regulator_modules()["ctx"](g)  # the step that used to fail on a dtype mismatch
    assert regulated.dtype == torch.float32 and torch.isfinite(regulated).all()


def test_init_double_out_of_float32_range_is_refused(init_file, tmp_path):
    path = tmp_path / "big.safetensors"
    tensors = {k: v.double() for k, v in load_file(str(init_file)).items()}
    tensors["prompt.ctx"][0, 0] = 1e300
    from safetensors import safe_open

    with safe_open(str(init_file), framework="pt") as f:
        save_file(tensors, str(path), metadata=f.metadata())
    with pytest.raises(InitMismatchError, match=r"tensor prompt.ctx: holds NaN or infinite values once cast"):
        load_gram_init(path)


@pytest.mark.parametrize(
    "dtype",
    [getattr(torch, "float8_e4m3fn", None), torch.int64, torch.int8],
    ids=["float8_e4m3fn", "int64", "int8"],
)
def test_init_other_dtypes_are_refused_by_name(init_file, tmp_path, dtype):
    if dtype is None:
        pytest.skip("this torch has no float8")
    path = resave_tensors(init_file, tmp_path / "init.safetensors", dtype, only="prompt.vpt")
    with pytest.raises(InitMismatchError) as err:
        load_gram_init(path, config_key="TRAINER.GRAM.INIT")
    msg = str(err.value)
    name = str(dtype).removeprefix("torch.")
    assert msg.startswith(f"TRAINER.GRAM.INIT: {path}: tensor prompt.vpt: dtype {name} is not accepted")
    assert "expected float32" in msg and "\n" not in msg


def test_init_float8_through_an_entry_point(init_file, tmp_path, capsys):
    """``python -m trainers.gram.export`` on a float8 file: one line naming the file, tensor and dtype, exit 2."""
    from trainers.gram.export import main

    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        pytest.skip("this torch has no float8")
    path = resave_tensors(init_file, tmp_path / "f8.safetensors", dtype)
    code = main([str(path), str(tmp_path / "out.pth")])
    one_error_line(capsys, str(path), "tensor prompt.", "float8_e4m3fn", "expected float32")
    assert code == 2 and not (tmp_path / "out_nctx2.pth").exists()


# ---------------------------------------------------------------- 6. train.py (the repository's Dassl entry point)
def _train_py(tmp_path: Path, *opts: str) -> subprocess.CompletedProcess:
    """``python train.py`` on GRAM_CoOp's config with the tiny CLIP options; no dataset is needed to fail."""
    pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")
    argv = [
        sys.executable,
        "train.py",
        "--root",
        str(tmp_path / "data"),
        "--trainer",
        "GRAM_CoOp",
        "--dataset-config-file",
        "configs/datasets/dtd.yaml",
        "--config-file",
        "configs/trainers/gram_coop.yaml",
        "--output-dir",
        str(tmp_path / "out"),
        "TRAINER.GRAM.MODEL_NAME",
        "GRAM-Test-Tiny",
        "TRAINER.GRAM.WEIGHTS",
        "none",
        *opts,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GRAM_DEBUG", None)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.dassl
def test_train_py_misspelled_key_is_one_line(tmp_path):
    proc = _train_py(tmp_path, "TRAINER.GRAM.INITT", "x.safetensors")
    line = one_error_line(proc.stderr, "TRAINER.GRAM.INITT")
    assert proc.returncode == 2 and line.startswith("error: command-line options: Non-existent key")
    # the same key misspelled in a yaml file: the line names the file
    config = tmp_path / "gram_coop_typo.yaml"
    config.write_text((REPO / "configs/trainers/gram_coop.yaml").read_text() + "\nTRAINER:\n  GRAM:\n    INITT: x\n")
    argv = [sys.executable, "train.py", "--trainer", "GRAM_CoOp", "--config-file", str(config)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    line = one_error_line(proc.stderr, str(config), "TRAINER.GRAM.INITT")
    assert proc.returncode == 2


@pytest.mark.dassl
@pytest.mark.parametrize("content", ["text", "fifo", "float8"])
def test_train_py_bad_init_is_one_line_naming_the_key(tmp_path, init_file, content):
    path = tmp_path / "init.safetensors"
    if content == "text":
        path.write_text("not a safetensors file")
    elif content == "fifo":
        os.mkfifo(path)
    else:
        dtype = getattr(torch, "float8_e4m3fn", None)
        if dtype is None:
            pytest.skip("this torch has no float8")
        resave_tensors(init_file, path, dtype)
    from gram_tools.synthetic import write_synthetic_dtd

    write_synthetic_dtd(tmp_path / "data", 4, {"train": 2, "val": 1, "test": 1}, size=(32, 32))
    proc = _train_py(tmp_path, "TRAINER.GRAM.INIT", str(path), "INPUT.SIZE", "(32, 32)", "DATASET.NUM_SHOTS", "1")
    one_error_line(proc.stderr, str(path), warnings=True)  # the random-weights note comes first, on one line
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
