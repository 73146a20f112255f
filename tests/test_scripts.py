"""Dispatch logic of scripts/base2new.sh, xd.sh and xdomain.sh against a fake train.py (no Dassl)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import recorded_calls, run_bench_script, run_methods_module

REPO = Path(__file__).resolve().parents[1]

FAKE_TRAIN = r"""
import argparse, json, os, sys
p = argparse.ArgumentParser()
for a in ("--root", "--seed", "--trainer", "--dataset-config-file", "--config-file", "--output-dir",
          "--model-dir", "--load-epoch"):
    p.add_argument(a, default="")
p.add_argument("--eval-only", action="store_true")
p.add_argument("opts", nargs=argparse.REMAINDER)
args = p.parse_args()
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:]}) + "\n")
os.makedirs(args.output_dir, exist_ok=True)
opts = dict(zip(args.opts[::2], args.opts[1::2]))
acc = float(os.environ.get("FAKE_ACC", "50")) + int(args.seed)
log = open(os.path.join(args.output_dir, "log.txt"), "w")
if os.environ.get("FAKE_CRASH"):
    log.write("epoch [1/5]\n")
    print("fake crash", file=sys.stderr)
    sys.exit(3)
if not args.eval_only:
    ep = opts.get("OPTIM.MAX_EPOCH", "7")
    os.makedirs(os.path.join(args.output_dir, "prompt_learner"), exist_ok=True)
    open(os.path.join(args.output_dir, "prompt_learner", "checkpoint"), "w").write(f"model.pth.tar-{ep}\n")
    log.write("Finish training\n")
log.write(f"=> result\n* total: 10\n* accuracy: {acc}%\n")
"""


@pytest.fixture()
def env(tmp_path):
    fake = tmp_path / "fake" / "train.py"
    fake.parent.mkdir()
    fake.write_text(FAKE_TRAIN)
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs" / "datasets", configs / "datasets")
    (configs / "trainers").mkdir()
    for key in ("coop", "gram_coop", "vpt", "gram_vpt", "joint", "unigram", "zsclip"):
        (configs / "trainers" / f"{key}.yaml").write_text(f"# {key}\nOPTIM:\n  MAX_EPOCH: 5\n")
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "PYTHON": sys.executable,
        "TRAIN_PY": str(fake),
        "CONFIGS": str(configs),
        "DATA": str(tmp_path / "data"),
        "OUTPUT": str(tmp_path / "out"),
        "FAKE_RECORD": str(tmp_path / "calls.jsonl"),
    }


def run(script, args, env, **extra):
    return run_bench_script(script, args, env, timeout=120, **extra)


calls = recorded_calls


def test_base2new_argument_lists(env):
    r = run("base2new.sh", ["gram_coop", "dtd", "1", "2", "TRAINER.GRAM.N_CTX", "4"], env, EPOCHS=3)
    assert r.returncode == 0, r.stderr
    got = calls(env)
    assert [c["cwd"] for c in got] == [str(REPO)] * 4
    out, cfg = env["OUTPUT"], env["CONFIGS"]
    common = [
        "--root",
        env["DATA"],
        "--seed",
        "1",
        "--trainer",
        "GRAM_CoOp",
        "--dataset-config-file",
        f"{cfg}/datasets/dtd.yaml",
        "--config-file",
        f"{cfg}/trainers/gram_coop.yaml",
    ]
    train_dir = f"{out}/base2new/train_base/dtd/shots_16/gram_coop/seed1"
    assert got[0]["argv"] == common + [
        "--output-dir",
        train_dir,
        "DATASET.NUM_SHOTS",
        "16",
        "DATASET.SUBSAMPLE_CLASSES",
        "base",
        "OPTIM.MAX_EPOCH",
        "3",
        "TRAINER.GRAM.N_CTX",
        "4",
    ]
    assert got[1]["argv"] == common + [
        "--output-dir",
        f"{out}/base2new/test_new/dtd/shots_16/gram_coop/seed1",
        "--model-dir",
        train_dir,
        "--load-epoch",
        "3",
        "--eval-only",
        "DATASET.NUM_SHOTS",
        "16",
        "DATASET.SUBSAMPLE_CLASSES",
        "new",
        "TRAINER.GRAM.N_CTX",
        "4",
    ]
    assert got[2]["argv"][3] == "2" and got[3]["argv"][3] == "2"
    info = Path(train_dir, "gram_run.txt").read_text()
    assert "mode train" in info and "arg OPTIM.MAX_EPOCH" in info


def test_load_epoch_from_checkpoint_shots_and_default_seeds(env):
    r = run("base2new.sh", ["vpt", "eurosat"], env, SHOTS=4)
    assert r.returncode == 0, r.stderr
    got = calls(env)
    assert [c["argv"][3] for c in got] == ["1", "1", "2", "2", "3", "3"]
    ev = got[1]["argv"]
    assert ev[ev.index("--load-epoch") + 1] == "7"  # from prompt_learner/checkpoint written by training
    assert ev[ev.index("--trainer") + 1] == "GRAM_VPT"
    assert ev[ev.index("DATASET.NUM_SHOTS") + 1] == "4"
    assert "/base2new/test_new/eurosat/shots_4/vpt/seed1" in ev[ev.index("--output-dir") + 1]


def test_identical_rerun_is_skipped_and_changed_config_is_refused(env):
    assert run("base2new.sh", ["coop", "dtd", "1"], env).returncode == 0
    assert len(calls(env)) == 2
    again = run("base2new.sh", ["coop", "dtd", "1"], env)
    assert again.returncode == 0 and calls(env) == []
    assert again.stdout.count("same configuration, so skip") == 2
    # different yacs options -> refused, nothing run
    diff = run("base2new.sh", ["coop", "dtd", "1", "OPTIM.LR", "0.01"], env)
    assert diff.returncode != 0 and calls(env) == []
    assert "Refusing to reuse" in diff.stderr and "different arguments" in diff.stderr
    # changed config file content -> refused too
    cfg = Path(env["CONFIGS"], "trainers", "coop.yaml")
    cfg.write_text(cfg.read_text() + "  LR: 0.5\n")
    assert run("base2new.sh", ["coop", "dtd", "1"], env).returncode != 0 and calls(env) == []
    # REDO=1 moves both folders aside (eval depends on the retrained model) and reruns
    redo = run("base2new.sh", ["coop", "dtd", "1"], env, REDO=1)
    assert redo.returncode == 0, redo.stderr
    assert len(calls(env)) == 2
    parent = Path(env["OUTPUT"], "base2new", "train_base", "dtd", "shots_16", "coop")
    assert sorted(p.name.split(".old-")[0] for p in parent.iterdir()) == ["seed1", "seed1"]


def test_crashed_run_is_rerun_and_unknown_runs_are_not_reused(env):
    crash = run("base2new.sh", ["joint", "dtd", "1"], env, FAKE_CRASH=1)
    assert crash.returncode != 0
    train_dir = Path(env["OUTPUT"], "base2new", "train_base", "dtd", "shots_16", "joint", "seed1")
    # the hint names files that exist: the fake wrote log.txt, and stderr is kept
    assert f"FAILED (train): {train_dir} (see {train_dir}/log.txt and {train_dir}/stderr.txt)" in crash.stderr
    assert "fake crash" in (train_dir / "stderr.txt").read_text()
    assert len(calls(env)) == 1  # no evaluation after a failed training
    again = run("base2new.sh", ["joint", "dtd", "1"], env)  # same configuration, crashed: simply rerun
    assert again.returncode == 0, again.stderr
    assert "did not finish and its process is gone" in again.stdout and len(calls(env)) == 2
    aside = [p.name for p in train_dir.parent.iterdir() if ".crashed-" in p.name]
    assert len(aside) == 1 and (train_dir.parent / aside[0] / "log.txt").read_text() == "epoch [1/5]\n"
    assert "Finish training" in (train_dir / "log.txt").read_text()
    third = run("base2new.sh", ["joint", "dtd", "1"], env)
    assert third.returncode == 0 and third.stdout.count("so skip this job") == 2 and calls(env) == []
    foreign = Path(env["OUTPUT"], "base2new", "train_base", "food101", "shots_16", "joint", "seed1")
    foreign.mkdir(parents=True)
    (foreign / "log.txt").write_text("Finish training\n=> result\n* accuracy: 99.0%\n")
    r = run("base2new.sh", ["joint", "food101", "1"], env)
    assert r.returncode != 0 and "configuration is unknown" in r.stderr and calls(env) == []


def test_zero_shot_evaluates_both_halves_without_training(env):
    r = run("base2new.sh", ["zsclip", "dtd,eurosat", "1"], env)
    assert r.returncode == 0, r.stderr
    got = [c["argv"] for c in calls(env)]
    assert len(got) == 4
    for argv, sub in zip(got, ("base", "new", "base", "new")):
        assert "--eval-only" in argv and "--model-dir" not in argv
        assert argv[argv.index("DATASET.SUBSAMPLE_CLASSES") + 1] == sub
    assert "mode eval" in Path(env["OUTPUT"], "base2new/train_base/dtd/shots_16/zsclip/seed1/gram_run.txt").read_text()


def test_xd_then_xdomain_share_the_imagenet_model(env):
    r = run("xd.sh", ["unigram", "1"], env, EPOCHS=2)
    assert r.returncode == 0, r.stderr
    got = [c["argv"] for c in calls(env)]
    assert len(got) == 11
    train = got[0]
    assert train[train.index("--dataset-config-file") + 1].endswith("/datasets/imagenet.yaml")
    assert "DATASET.SUBSAMPLE_CLASSES" not in train and train[train.index("DATASET.NUM_SHOTS") + 1] == "16"
    targets = [Path(a[a.index("--dataset-config-file") + 1]).stem for a in got[1:]]
    assert targets == [
        "caltech101",
        "oxford_pets",
        "stanford_cars",
        "oxford_flowers",
        "food101",
        "fgvc_aircraft",
        "sun397",
        "dtd",
        "eurosat",
        "ucf101",
    ]
    for a in got[1:]:
        assert a[a.index("--model-dir") + 1].endswith("/xd/train_imagenet/shots_16/unigram/seed1")
        assert a[a.index("--load-epoch") + 1] == "2" and "--eval-only" in a
    r2 = run("xdomain.sh", ["unigram", "1"], env, EPOCHS=2)
    assert r2.returncode == 0, r2.stderr
    got2 = [c["argv"] for c in calls(env)]
    assert [Path(a[a.index("--dataset-config-file") + 1]).stem for a in got2] == [
        "imagenetv2",
        "imagenet_sketch",
        "imagenet_a",
        "imagenet_r",
    ]
    assert "same configuration, so skip" in r2.stdout


def test_bad_method_and_missing_config_are_one_line_errors(env):
    r = run("base2new.sh", ["no_such_method", "dtd"], env)
    assert r.returncode == 2 and "unknown method 'no_such_method'" in r.stderr
    os.remove(Path(env["CONFIGS"], "trainers", "vpt.yaml"))
    r = run("xd.sh", ["vpt"], env)
    assert r.returncode == 2 and f"missing trainer config {env['CONFIGS']}/trainers/vpt.yaml" in r.stderr
    r = run("base2new.sh", ["coop", "nosuchset", "1"], env)
    assert r.returncode != 0 and "unknown dataset 'nosuchset'" in r.stderr and calls(env) == []


def test_scripts_then_parser_end_to_end(env, tmp_path):
    assert run("base2new.sh", ["gram_coop", "dtd,eurosat", "1", "2"], env, FAKE_ACC=60).returncode == 0
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "parse_results.py"), env["OUTPUT"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    rows = (Path(env["OUTPUT"]) / "tables" / "base2new_shots16.csv").read_text().splitlines()
    dtd = next(line.split(",") for line in rows if ",dtd," in line)
    assert float(dtd[3]) == pytest.approx(61.5) and float(dtd[6]) == pytest.approx(61.5)  # seeds 1,2 -> 61, 62


def test_init_file_is_passed_and_its_content_hashed(env, tmp_path):
    init = tmp_path / "inits" / "gram_init.safetensors"
    init.parent.mkdir()
    init.write_bytes(b"first")
    r = run("base2new.sh", ["gram_coop", "dtd", "1"], env, INIT=init)
    assert r.returncode == 0, r.stderr
    for c in calls(env):
        argv = c["argv"]
        assert argv[argv.index("TRAINER.GRAM.INIT") + 1] == str(init)
    init.write_bytes(b"second")  # a new meta-learned init must not reuse the old results
    r = run("base2new.sh", ["gram_coop", "dtd", "1"], env, INIT=init)
    assert r.returncode != 0 and "Refusing to reuse" in r.stderr and calls(env) == []
    r = run("base2new.sh", ["coop", "dtd", "1"], env, INIT=init)  # GRAM off: ignored with a warning
    assert r.returncode == 0 and "INIT is ignored" in r.stderr
    assert all("TRAINER.GRAM.INIT" not in c["argv"] for c in calls(env))


def test_crash_before_any_log_names_stderr_and_a_running_job_is_not_touched(env, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "import sys\nprint(\"ModuleNotFoundError: No module named 'torch'\", file=sys.stderr)\nsys.exit(1)\n"
    )
    r = run("base2new.sh", ["coop", "dtd", "1"], env, TRAIN_PY=broken)
    run_dir = Path(env["OUTPUT"], "base2new", "train_base", "dtd", "shots_16", "coop", "seed1")
    assert r.returncode != 0 and f"(see {run_dir}/stderr.txt)" in r.stderr and not (run_dir / "log.txt").exists()
    assert "No module named 'torch'" in (run_dir / "stderr.txt").read_text()
    info = run_dir / "gram_run.txt"  # pretend a live benchmark script owns the folder
    sleeper = subprocess.Popen(["bash", "-c", "sleep 60; true", "scripts/base2new.sh"])
    try:
        info.write_text(re.sub(r"(?m)^pid .*$", f"pid {sleeper.pid}", info.read_text()))
        r = run("base2new.sh", ["coop", "dtd", "1"], env)
        assert r.returncode != 0 and f"still running (process {sleeper.pid})" in r.stderr and calls(env) == []
    finally:
        sleeper.kill()
        sleeper.wait()


def _methods_python(env, tmp_path, repo_has_venv: bool, **extra) -> tuple[str, Path]:
    """PYTHON as scripts/methods.sh resolves it, in a copy of scripts/ whose repo may have a .venv."""
    repo = tmp_path / f"repo{len(list(tmp_path.iterdir()))}"
    shutil.copytree(REPO / "scripts", repo / "scripts")
    if repo_has_venv:
        (repo / ".venv" / "bin").mkdir(parents=True)
        os.symlink(sys.executable, repo / ".venv" / "bin" / "python")
    e = {k: v for k, v in env.items() if k != "PYTHON"}
    e.update(extra)
    out = subprocess.run(
        ["bash", "-c", f"source {repo}/scripts/methods.sh && gram_setup_env && echo $PYTHON"],
        env=e,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), repo


def test_scripts_use_the_project_venv_python_unless_python_is_set(env, tmp_path):
    got, repo = _methods_python(env, tmp_path, True)
    assert got == f"{repo}/.venv/bin/python"  # not PATH's python, which may lack torch
    got, _ = _methods_python(env, tmp_path, False)
    assert got == "python3"
    got, _ = _methods_python(env, tmp_path, True, PYTHON="/opt/other/python")
    assert got == "/opt/other/python"


# ------------------------------------------------------------------ the Python runner behind the scripts
# The hash function of the former bash runner (scripts/methods.sh before the port), kept here so
# that folders it wrote keep being skipped rather than refused.
BASH_RUN_HASH = r"""
h() {
    local mode="$1"; shift
    { echo "mode $mode"; local skip="" a
      for a in "$@"; do
        if [[ -n "$skip" ]]; then skip=""; continue; fi
        case "$a" in --root | --output-dir) skip=1; continue ;; esac
        echo "arg $a"
        if [[ -f "$a" ]]; then echo "file-sha256 $(sha256sum "$a" | cut -d' ' -f1)"
        elif [[ -f "$a/gram_run.txt" ]]; then echo "model-run $(sed -n 's/^hash //p' "$a/gram_run.txt")"; fi
      done; } | sha256sum | cut -d' ' -f1
}
h "$@"
"""


def test_run_hash_equals_the_former_bash_runners(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("OPTIM:\n  LR: 0.1\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "gram_run.txt").write_text("hash 0123abcd\nmode train\npid 1\n")
    args = [
        "--root",
        "/data",
        "--seed",
        "2",
        "--trainer",
        "GRAM_CoOp",
        "--config-file",
        str(cfg),
        "--output-dir",
        str(tmp_path / "out"),
        "--model-dir",
        str(model),
        "--load-epoch",
        "3",
        "--eval-only",
        "configs/trainers/coop.yaml",
        "DATASET.SUBSAMPLE_CLASSES",
        "new",
    ]
    for mode in ("train", "eval"):
        bash = subprocess.run(
            ["bash", "-c", BASH_RUN_HASH, "h", mode, *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert run_methods_module().run_hash(mode, args) == bash and len(bash) == 64
    assert run_methods_module().run_hash("train", args) != run_methods_module().run_hash("train", args[:-1] + ["base"])


def test_runner_reads_logs_as_the_parser_does(env):
    """A log with Dassl's end markers but no accuracy line is unfinished for both the runner and the parser
    (the bash runner only looked for the markers): the run is redone, not skipped."""
    assert run("base2new.sh", ["coop", "dtd", "1"], env).returncode == 0 and len(calls(env)) == 2
    train_dir = Path(env["OUTPUT"], "base2new", "train_base", "dtd", "shots_16", "coop", "seed1")
    (train_dir / "log.txt").write_text("Finish training\n=> result\n* total: 10\n")
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "parse_results.py"), env["OUTPUT"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"no result: {train_dir}/log.txt" in r.stderr
    again = run("base2new.sh", ["coop", "dtd", "1"], env)
    assert again.returncode == 0, again.stderr
    assert "did not finish and its process is gone" in again.stdout
    # only training reruns: its arguments (so the eval's model-run hash) are unchanged, the eval is skipped
    assert [c["argv"][c["argv"].index("--output-dir") + 1] for c in calls(env)] == [str(train_dir)]
    assert again.stdout.count("so skip this job") == 1


def test_bad_input_is_exit_2_with_one_error_line_and_usage(env):
    for args, extra, message in (
        (["unigram_no_shift", "dtd"], {}, "method 'unigram_no_shift' has no Dassl trainer: expected one of zsclip"),
        (
            ["coop", "dtd", "1", "OPTIM.LR"],
            {},
            "extra options must be yacs KEY VALUE pairs, got an odd count: OPTIM.LR",
        ),
        (["coop", "dtd"], {"EPOCHS": "ten"}, "EPOCHS must be a positive integer, got 'ten'"),
        (["gram_coop", "dtd"], {"INIT": "/no/such.safetensors"}, "INIT file not found: /no/such.safetensors"),
        ([], {}, "missing METHOD"),
    ):
        r = run("base2new.sh", args, env, **extra)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 2 and lines[0].startswith(message), r.stderr
        assert lines[1] == "usage: bash scripts/base2new.sh METHOD [DATASET|all|a,b,c] [SEEDS...] [--] [KEY VALUE ...]"
    assert calls(env) == []
    help_text = run("xd.sh", ["--help"], env)
    assert help_text.returncode == 0 and help_text.stdout.startswith("usage: bash scripts/xd.sh METHOD")


def test_dry_run_prints_the_commands_and_writes_nothing(env):
    r = run("xdomain.sh", ["gram_vpt", "4"], env, DRY_RUN=1)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
    assert len(lines) == 5 and calls(env) == [] and not Path(env["OUTPUT"]).exists()
    assert "--load-epoch LAST" in lines[1] and lines[1].endswith("--eval-only")
    assert [line.split("--dataset-config-file ")[1].split()[0].rsplit("/", 1)[1] for line in lines] == [
        "imagenet.yaml",
        "imagenetv2.yaml",
        "imagenet_sketch.yaml",
        "imagenet_a.yaml",
        "imagenet_r.yaml",
    ]


def test_methods_sh_prints_the_method_table(env):
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "methods.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "gram_coop           GRAM_CoOp" in r.stdout and "CoOp + GRAM" in r.stdout
