"""Meta-training under torchrun: 2 gloo processes on CPU equal 1 process; resume; rank 0 alone writes files."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_tensors, flat_tensors, tiny_meta_opts, tiny_task_opts
from PIL import Image

from meta.finetune.init_io import load_gram_init
from meta.metatrain.checkpoint import load_checkpoint
from meta.metatrain.runlog import read_log

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["apple", "bridge", "cactus", "drum", "eagle", "fern"]
# UNIGRAM (2 text + 2 visual tokens) on the tiny test CLIP, tasks from an image folder (3-way, 2 + 3 shots)
ARGS = [
    "--config-file",
    str(ROOT / "configs/meta/train_supervised.yaml"),
    *tiny_meta_opts(),
    "META.STEPS",
    "4",
    "META.CHECKPOINT_EVERY",
    "2",
    *tiny_task_opts(meta_batch=4, val_fraction=0.34),
    "META.VAL_EVERY",
    "2",
    "META.VAL_TASKS",
    "3",
    "META.LOG_DETAIL_EVERY",
    "2",
    "META.INNER_LR",
    "0.5",
    "CHC.DOMAINS.MIN_PER_DOMAIN",
    "4",
]
RTOL, ATOL = 1e-4, 1e-6  # float summation order differs between 1 and 2 processes; nothing else does


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out, *extra, nproc=1, resume=False):
    """``python -m meta train`` (nproc 1) or ``torchrun --nproc_per_node nproc -m meta train``."""
    launch = (
        [sys.executable, "-m", "meta"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            "-m",
            "meta",
        ]
    )
    cmd = launch + ["train", *ARGS, "--output-dir", str(out), *(["--resume"] if resume else []), *extra]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _files(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in Path(run_dir).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """root/<class>/<png>: 6 classes x 3 styles x 6 images of 32 px."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("folder")
    for t, name in enumerate(NAMES):
        (root / name).mkdir()
        colour = np.array([(37 * t) % 256, (91 * t + 60) % 256, (151 * t + 120) % 256], dtype=np.float64)
        for i in range(18):
            img = np.tile(colour, (32, 32, 1))
            if i % 3 == 1:
                img[::4] = 255 - img[::4]
            elif i % 3 == 2:
                img = img + rng.normal(0, 60, img.shape)
            Image.fromarray(np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)).save(
                root / name / f"{i:03d}.png"
            )
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, folder):
    """The same 4-step run with 1 process and with 2 gloo processes."""
    base = tmp_path_factory.mktemp("runs")
    one, two = base / "one", base / "two"
    _ok(_train(one, "TASKS.IMAGE_FOLDER", str(folder)))
    proc = _ok(_train(two, "TASKS.IMAGE_FOLDER", str(folder), nproc=2))
    return one, two, proc


def test_two_processes_equal_one(runs):
    one, two, _ = runs
    a, b = load_checkpoint(one / "checkpoint.pt"), load_checkpoint(two / "checkpoint.pt")
    assert a["step"] == b["step"] == 4 and a["stream"] == b["stream"]
    ta, tb = flat_tensors(a["learner"]), flat_tensors(b["learner"])
    assert ta.keys() == tb.keys()
    assert any("module.ctx" in k for k in ta) and any("module.vpt" in k for k in ta)
    assert any("optimizer/state" in k and k.endswith("exp_avg_sq") for k in ta)
    for key in ta:  # θ, φ and both Adam moments after 4 steps
        torch.testing.assert_close(tb[key], ta[key], rtol=RTOL, atol=ATOL, msg=key)
    ia, ib = load_gram_init(one / "gram_init.safetensors"), load_gram_init(two / "gram_init.safetensors")
    for name in ("ctx", "vpt"):
        torch.testing.assert_close(ib.prompt[name], ia.prompt[name], rtol=RTOL, atol=ATOL)
    for name, reg in ia.regulator_modules().items():
        other = ib.regulator_modules()[name].state_dict()
        for k, v in reg.state_dict().items():
            torch.testing.assert_close(other[k], v, rtol=RTOL, atol=ATOL)
    assert ia.metadata["provenance"]["config_hash"] == ib.metadata["provenance"]["config_hash"]
    # the logged metrics are the whole meta-batch's (reduced over ranks), validation over all 3 tasks
    la, lb = read_log(one / "log.jsonl"), read_log(two / "log.jsonl")
    assert [(r["kind"], r["step"]) for r in la] == [(r["kind"], r["step"]) for r in lb]
    for ra, rb in zip(la, lb):
        assert ra.keys() == rb.keys()
        for k in ra:
            if k not in ("time_per_step", "kind", "step"):
                assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (ra["kind"], ra["step"], k)


def test_rank_zero_alone_writes(runs):
    one, two, proc = runs
    assert _files(two) == _files(one)  # no per-rank or temporary files
    steps = [r["step"] for r in read_log(two / "log.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4]  # each step logged once, not once per rank
    assert json.loads((two / "run.json").read_text())["world_size"] == 2
    assert proc.stdout.count("exported") == 1
    ckpt = load_checkpoint(two / "checkpoint.pt")
    assert ckpt["world_size"] == 2 and len(ckpt["rng_ranks"]) == 2
    assert "rng_ranks" not in load_checkpoint(one / "checkpoint.pt")


def test_resume_under_torchrun_continues_exactly(runs, folder, tmp_path):
    _, two, _ = runs
    out = tmp_path / "cut"
    _ok(_train(out, "TASKS.IMAGE_FOLDER", str(folder), "META.STEPS", "2", nproc=2))
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2
    proc = _ok(_train(out, "TASKS.IMAGE_FOLDER", str(folder), nproc=2, resume=True))
    assert "finished at step 4" in proc.stdout
    a, b = (
        flat_tensors(load_checkpoint(two / "checkpoint.pt")["learner"]),
        flat_tensors(load_checkpoint(out / "checkpoint.pt")["learner"]),
    )
    assert_same_tensors(a, b)  # same processes, same order of sums: bit-identical
    assert [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4]
    assert json.loads((out / "run.json").read_text())["resumed_at_steps"] == [2]


def test_meta_batch_not_divisible_is_one_line(folder, tmp_path):
    proc = _train(tmp_path / "bad", "TASKS.IMAGE_FOLDER", str(folder), "META.META_BATCH", "3", nproc=2)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "META.META_BATCH: 3" in lines[0] and "2 processes" in lines[0]
    assert not (tmp_path / "bad").exists()


def _worker_pids(launcher_pid: int) -> dict:
    """{rank: pid} of torchrun's worker processes (children of the launcher, RANK from their environment)."""
    out = {}
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    for pid in children:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(pid)
    return out


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs /proc to find torchrun's workers")
def test_sigterm_to_one_rank_stops_all_after_the_same_step(folder, tmp_path):
    import os
    import signal
    import time

    out = tmp_path / "term"
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        "-m",
        "meta",
        "train",
        *ARGS,
        "--output-dir",
        str(out),
        "TASKS.IMAGE_FOLDER",
        str(folder),
        "META.STEPS",
        "400",
        "META.CHECKPOINT_EVERY",
        "1000",
        "META.VAL_TASKS",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(launch, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(read_log(out / "log.jsonl")) < 2:
            time.sleep(0.5)
        assert len(read_log(out / "log.jsonl")) >= 2, "training did not start"
        os.kill(_worker_pids(proc.pid)[1], signal.SIGTERM)  # rank 1 only: rank 0 must stop with it
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
    stopped = load_checkpoint(out / "checkpoint.pt")
    assert 2 <= stopped["step"] == steps[-1] < 400  # nothing lost, though CHECKPOINT_EVERY is 1000
    assert steps == list(range(1, stopped["step"] + 1))
    assert not (out / "gram_init.safetensors").exists()
    more = stopped["step"] + 2
    _ok(
        _train(
            out,
            "TASKS.IMAGE_FOLDER",
            str(folder),
            "META.STEPS",
            str(more),
            "META.CHECKPOINT_EVERY",
            "1000",
            "META.VAL_TASKS",
            "0",
            nproc=2,
            resume=True,
        )
    )
    assert [r["step"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"] == list(range(1, more + 1))
    assert load_gram_init(out / "gram_init.safetensors").metadata["provenance"]["step"] == more
