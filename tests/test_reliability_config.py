"""Hostile-but-realistic inputs to meta-training, the planner, the init/checkpoint readers and the demo's
workers, built on the fly: each is refused in one line naming its key or file before any work, or (workers,
partial world folders) cleaned up after a killed parent."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tiny_meta_opts, tiny_task_opts

from meta.chc.hierarchy import Hierarchy
from meta.metatrain import build_cfg, main, settings

ROOT = Path(__file__).resolve().parents[1]
MODEL = "GRAM-Test-Tiny"
BASE = tiny_meta_opts(
    "META.STEPS",
    "2",
    *tiny_task_opts(),
    "META.VAL_TASKS",
    "2",
    "META.FEATURE_CHECK",
    "0",
)


def _one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def _hierarchy(n_topics=8, n_domains=3, per_domain=6, width=16, image_size=32) -> Hierarchy:
    """Random features; topic t holds n_domains x per_domain items."""
    topic = np.repeat(np.arange(n_topics), n_domains * per_domain)
    domain = np.tile(np.repeat(np.arange(n_domains), per_domain), n_topics)
    feats = np.random.default_rng(0).normal(size=(len(topic), width)).astype(np.float32)
    return Hierarchy(
        topic_names=[f"topic{t}" for t in range(n_topics)],
        item_topic=topic,
        item_domain=domain,
        image_features=feats,
        meta={"backbone": MODEL, "image_size": image_size},
        image_loader=lambda idx: np.zeros((len(idx), image_size, image_size, 3), np.uint8),
    )


# ----------------------------------------------------------------------------- META / TASKS sizes (5)
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("META.STEPS", "0", "an integer >= 1"),
        ("META.META_BATCH", "1000000000000", "at most"),
        ("META.VAL_TASKS", "1000000000000", "at most"),
        ("META.PRETRAIN.BATCH_SIZE", "1000000000000000", "at most"),
        ("TASKS.N_QUERY", "1000000000000", "at most"),
        ("OUTPUT_DIR", "", "a folder path"),
        ("META.PROMPT.N_CTX_TEXT", "100", "at most 72 context tokens"),
        ("TASKS.QUERY_NEW_SHARE", "1.5", "a share in [0, 1]"),
    ],
)
def test_sizes_that_cannot_work_are_refused_before_any_work(tmp_path, capsys, monkeypatch, key, value, expected):
    # no hierarchy exists at the default CHC.OUTPUT_DIR: a refusal that names the key comes from the config alone
    monkeypatch.chdir(tmp_path)
    opts = BASE + [key, value] + (["META.MODE", "pretrain"] if key.startswith("META.PRETRAIN") else [])
    t0 = time.perf_counter()
    if key == "OUTPUT_DIR":
        msg = _one_error_line(capsys, ["train", "--output-dir", "", *opts[:-2]])
    else:
        msg = _one_error_line(capsys, ["train", "--output-dir", str(tmp_path / "run"), *opts])
    assert msg.startswith(f"error: {key}: expected "), msg
    got = repr(value) if key == "OUTPUT_DIR" else value
    assert expected in msg and msg.endswith(f"got {got}"), msg
    assert time.perf_counter() - t0 < 30
    assert sorted(os.listdir(tmp_path)) == []  # nothing written: no run folder, nothing in the current folder


def test_a_120_word_ctx_init_is_one_line_naming_the_key(tmp_path, capsys):
    words = " ".join(["photo"] * 120)
    msg = _one_error_line(capsys, ["train", "--output-dir", str(tmp_path / "r"), *BASE, "META.PROMPT.CTX_INIT", words])
    # CLIP's 77-token context: start + context + class name + full stop + end -> at most 72 context tokens
    assert msg.startswith("error: META.PROMPT.CTX_INIT: expected at most 72 BPE tokens"), msg
    assert msg.endswith("got 120 tokens ('photo photo photo photo photo photo p...')"), msg
    settings.check_text_context(build_cfg(opts=["META.PROMPT.CTX_INIT", " ".join(["photo"] * 72)]))  # fits
    with pytest.raises(ValueError, match="at most 72 BPE tokens"):
        settings.check_text_context(build_cfg(opts=["META.PROMPT.CTX_INIT", " ".join(["photo"] * 73)]))
    with pytest.raises(ValueError, match="at most 12 context tokens"):  # a model with a 17-token context
        settings.check_text_context(build_cfg(opts=["META.PROMPT.N_CTX_TEXT", "13"]), context_length=17)


def test_step_memory_limit_is_the_arithmetic_of_one_step(monkeypatch):
    # one step builds B tasks x K x (S + Q) images at once: with 1 MiB "of memory" and 16-d fp32 features
    # (64 + 16 bytes per image), 15 images per task hold 1200 bytes -> at most 873 tasks
    h = _hierarchy(width=16)
    monkeypatch.setattr(settings, "memory_bytes", lambda device="cpu": 2**20)
    ok = build_cfg(opts=BASE + ["META.META_BATCH", "873"], output_dir="x")
    settings.check_task_sizes(settings.read_train_settings(ok), h)
    bad = build_cfg(opts=BASE + ["META.META_BATCH", "874"], output_dir="x")
    with pytest.raises(
        ValueError,
        match=r"^META\.META_BATCH: expected at most 873 tasks .* 16-d cached image "
        r"feature .* got 874$",
    ):
        settings.check_task_sizes(settings.read_train_settings(bad), h)
    # visual prompts take 32 x 32 RGB pixels instead (3 * 32 * 32 * 4 + 16 bytes): 1 MiB / (15 * 12304) -> 5
    vis = ["META.PROMPT.N_CTX_VISION", "2"]
    settings.check_task_sizes(
        settings.read_train_settings(build_cfg(opts=BASE + vis + ["META.META_BATCH", "5"], output_dir="x")), h
    )
    with pytest.raises(ValueError, match="at most 5 tasks"):
        settings.check_task_sizes(
            settings.read_train_settings(build_cfg(opts=BASE + vis + ["META.META_BATCH", "6"], output_dir="x")), h
        )


@pytest.mark.parametrize(
    "opts, key, expected",
    [
        (["TASKS.K_WAY", "7"], "TASKS.K_WAY", "at most 6: 6 training topics of the hierarchy's 8"),
        # 4 support + 4 new query topics > 6; K = 3 needs 3 + 3
        (["TASKS.K_WAY", "4", "TASKS.QUERY_NEW_SHARE", "1.0"], "TASKS.K_WAY", "at most 3: 6 training topics"),
        (["TASKS.N_SUPPORT", "10", "TASKS.N_QUERY", "9"], "TASKS.N_QUERY", "N_SUPPORT + N_QUERY <= 18"),
        (["TASKS.N_SUPPORT", "7", "TASKS.N_QUERY", "1"], "TASKS.N_SUPPORT", "at most 6 (TASKS.DOMAIN_SHIFT"),
    ],
)
def test_task_sizes_the_hierarchy_cannot_supply_are_refused_before_the_clip_is_built(
    tmp_path, monkeypatch, opts, key, expected
):
    from meta.metatrain import trainer

    def no_clip(*_a, **_k):
        raise AssertionError("the CLIP was built before the sizes were checked")

    monkeypatch.setattr(trainer, "build_clip", no_clip)
    cfg = build_cfg(opts=BASE + opts, output_dir=str(tmp_path / "r"))
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: expected .*{re.escape(expected)}") as info:
        trainer.setup_run(settings.read_train_settings(cfg), hierarchy=_hierarchy())
    assert "\n" not in str(info.value)


def test_steps_zero_never_exports_an_untrained_init(tmp_path, capsys):
    out = tmp_path / "r"
    msg = _one_error_line(capsys, ["train", "--output-dir", str(out), *BASE, "META.STEPS", "0"])
    assert msg.startswith("error: META.STEPS: expected an integer >= 1"), msg
    assert not out.exists()


# ----------------------------------------------------------------------------- the planner (7)
def _plan(capsys, *argv):
    from gram_tools import plan

    code = plan.main(["--config-file", str(ROOT / "configs/meta/train_unigram.yaml"), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def test_plan_runs_from_any_folder_with_the_checkout_figures(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "gram_tools.plan", "--config-file", str(ROOT / "configs/meta/train_unigram.yaml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(ROOT / "docs" / "realsize_cpu.json") in out["meta_training"]["task_peak_gib"]["how"]
    assert "chc" in out  # docs/chc_growth_cpu.json found too
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--gpu-memory-gib", "nan", "a finite number 0 < GiB <= 1e+06, got nan"),
        ("--gpu-memory-gib", "inf", "a finite number 0 < GiB <= 1e+06, got inf"),
        ("--gpu-tflops", "nan", "a finite number 0.001 <= TFLOP/s <= 1e+06, got nan"),
        ("--pairs", "-10", "a finite number of pairs 1 <= pairs <= 1e+12, got -10"),
        ("--pairs", "inf", "a finite number of pairs 1 <= pairs <= 1e+12, got inf"),
        ("--margin", "nan", "a fraction 0 <= margin < 1, got nan"),
    ],
)
def test_plan_refuses_numbers_that_are_not_sizes(capsys, flag, value, expected):
    code, out, err = _plan(capsys, flag, value)
    assert code == 2 and out == "" and err == f"error: {flag}: expected {expected}"


@pytest.mark.parametrize(
    "which, content, expected",
    [
        ("--gpu-figures", "[1, 2]", "expected a JSON object of figures, got a JSON list"),
        ("--gpu-figures", '{"settings": [], "variants": {}}', "settings: expected a JSON object, got list"),
        ("--figures", '"text"', "expected a JSON object of figures, got a JSON str"),
        ("--figures", '{"fits": {"unigram": {"second": {"peak_mib": 3}}}}', "not the layout this planner reads"),
        ("--chc-figures", '{"growth": {"text_embeddings": {"seconds_law": {"c": 1}}}}', "not the layout"),
        ("--gpu-figures", "[" * 100000, "not a readable JSON file"),
    ],
)
def test_plan_names_a_figures_file_of_the_wrong_layout(tmp_path, capsys, which, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code, out, err = _plan(capsys, which, str(bad))
    assert code == 2 and out == "", (out, err)
    assert err.startswith(f"error: {bad}") and expected in err and "\n" not in err, err


@pytest.mark.parametrize(
    "key, value",
    [
        ("TASKS.N_SUPPORT", "0"),
        ("TASKS.K_WAY", "0"),
        ("TASKS.K_WAY", "1"),
        ("META.STEPS", "0"),
        ("META.META_BATCH", "1000000000000"),
        ("META.PROMPT.CTX_INIT", " ".join(["photo"] * 120)),
    ],
)
def test_plan_refuses_what_train_refuses(capsys, key, value):
    code, out, err = _plan(capsys, key, value)
    cfg = build_cfg(str(ROOT / "configs/meta/train_unigram.yaml"), [key, value])
    with pytest.raises(ValueError) as refused:
        settings.check_meta_cfg(cfg)
    assert code == 2 and out == "" and err == f"error: {refused.value}" and err.startswith(f"error: {key}: expected")


# ----------------------------------------------------------------------------- init and checkpoint readers (8)
def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def _init_file(path: Path, gram_metadata: str) -> Path:
    from safetensors.torch import save_file

    save_file({"prompt.ctx": torch.zeros(4, 8)}, str(path), metadata={"gram": gram_metadata})
    return path


@pytest.mark.parametrize("depth", [100000, 65])
def test_load_gram_init_refuses_deeply_nested_metadata_in_one_line(tmp_path, depth):
    from meta.finetune.init_io import InitMismatchError, load_gram_init

    path = _init_file(tmp_path / "deep.safetensors", _deep_json(depth))
    with pytest.raises(InitMismatchError) as info:
        load_gram_init(path, config_key="MODEL.GRAM_INIT")
    msg = str(info.value)
    assert msg == f"MODEL.GRAM_INIT: {path}: metadata 'gram': JSON nested deeper than 64 levels", msg
    # a provenance nested 65 levels deep inside otherwise valid metadata is refused the same way
    meta = {"format_version": 1, "provenance": json.loads(_deep_json(64))}
    path2 = _init_file(tmp_path / "deep2.safetensors", json.dumps(meta))
    with pytest.raises(InitMismatchError, match="JSON nested deeper than 64 levels"):
        load_gram_init(path2)


def _torch_zip_with_pickle(path: Path, body: bytes) -> Path:
    """A torch.save zip archive whose data.pkl is replaced by ``body`` (protocol-2 opcodes)."""
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for info in source.infolist():
            data = source.read(info.filename)
            zf.writestr(info, body if info.filename.endswith("data.pkl") else data)
    path.write_bytes(out.getvalue())
    return path


def _unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + len(raw).to_bytes(4, "little") + raw


def test_load_checkpoint_refuses_deeply_nested_state_in_one_line(tmp_path):
    from meta.metatrain.checkpoint import FORMAT, CheckpointError, load_checkpoint

    depth = 100000
    nested = pickle.EMPTY_LIST * depth + pickle.APPEND * (depth - 1)
    head = pickle.PROTO + bytes([2]) + pickle.EMPTY_DICT
    for key, value in (("format", nested), ("config", nested)):  # a deep "format" or a deep field of a valid one
        body = head + (_unicode("format") + _unicode(FORMAT) + pickle.SETITEM if key == "config" else b"")
        path = _torch_zip_with_pickle(
            tmp_path / f"deep_{key}.pt", body + _unicode(key) + value + pickle.SETITEM + pickle.STOP
        )
        blob = path.read_bytes()
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        msg = str(info.value)
        assert msg.startswith(f"{path}: not a meta-training checkpoint (containers nested deeper than 64"), msg
        assert "\n" not in msg and path.read_bytes() == blob  # left untouched


def test_run_log_and_run_info_readers_skip_or_name_hostile_lines(tmp_path):
    from meta.metatrain.runlog import read_log, truncate_log
    from meta.metatrain.trainer import _read_run_info

    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"kind": "train", "step": 1}\n'
        + _deep_json(100000)
        + "\n[1, 2]\n"
        + '{"step": "x"}\n'
        + '{"kind": "train", "step": 2}\n{"kind": "tr'
    )
    assert [r["step"] for r in read_log(log)] == [1, 2]
    assert truncate_log(log, 1) == 1 and [r["step"] for r in read_log(log)] == [1]
    info = tmp_path / "run.json"
    for text, expected in (
        (_deep_json(100000), "JSON nested deeper than 64 levels"),
        ("[]", "expected a JSON object"),
        ("{", "not valid JSON"),
    ):
        info.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"{info}: ") + ".*" + re.escape(expected)):
            _read_run_info(info)


# ----------------------------------------------------------------------------- demo workers, partial folders (9)
def _running(pid: int) -> bool:
    """A process that exists and is not a zombie (a reparented zombie may wait for a non-reaping init)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        from meta.infra.fileio import pid_alive

        return pid_alive(pid)


@pytest.mark.slow  # three interpreters import torch (seconds each, a minute on a loaded 2-core machine)
def test_demo_pool_workers_die_with_a_killed_parent(tmp_path):
    (tmp_path / "orphan_job.py").write_text(
        textwrap.dedent("""
        import os, time
        def work(folder):
            open(os.path.join(folder, f"worker-{os.getpid()}"), "w").close()
            time.sleep(300)
    """)
    )
    (tmp_path / "parent.py").write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import orphan_job
        from gram_world.demo.pool import run_with_progress
        if __name__ == "__main__":
            run_with_progress(orphan_job.work, [{str(tmp_path)!r}] * 2, jobs=2, total=2, done=lambda: 0,
                              desc="orphans", unit="job")
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "parent.py")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 180
        while len(list(tmp_path.glob("worker-*"))) < 2:
            assert proc.poll() is None and time.time() < deadline, "the workers never started"
            time.sleep(0.2)
        workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
        assert all(_running(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.time() + 5
        while any(_running(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.1)
        alive = [pid for pid in workers if _running(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in alive:  # clean up before failing
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"workers {alive} outlived their killed parent"


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_world_build_removes_partial_folders_of_killed_builds_only(tmp_path):
    from dataclasses import replace

    fcntl = pytest.importorskip("fcntl")
    from gram_world import build_world, world_settings

    s = replace(
        world_settings(quick=True, seed=0),
        pretrain_size=40,
        chc_size=20,
        chc_shard_size=25,
        labelled_per_class=1,
        val_per_class=1,
        test_per_class=1,
    )
    name = s.checksum()
    dead = tmp_path / f".{name}.partial-{_dead_pid()}-0badf00d"  # its build was killed
    reused = tmp_path / f".{name}.partial-{os.getpid()}-0000abcd"  # a live id that holds no lock: reused
    live = tmp_path / f".{name}.partial-{os.getpid()}-1111abcd"  # a live build, lock held
    creating = tmp_path / f".{name}.partial-{os.getpid()}-2222abcd"  # a live build before its lock exists
    other = tmp_path / f".{name}.partial-notours"  # not this naming: left alone
    for folder in (dead, reused, live, creating, other):
        (folder / "pretrain").mkdir(parents=True)
        (folder / "pretrain" / "images.npy").write_bytes(b"x" * 1000)
    (reused / ".building").write_text("")
    held = open(live / ".building", "w")  # what a live build holds (gram_world.lifeline.lock_partial)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        world = build_world(root=tmp_path, settings=s, workers=1)
    finally:
        held.close()
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([name, live.name, creating.name, other.name]), left
    assert not (world.root / ".building").exists() and (world.root / "world.json").is_file()
    # a cached world: the call that finds it cleans up too
    dead2 = tmp_path / f".{name}.partial-{_dead_pid()}-0badf00e"
    dead2.mkdir()
    assert build_world(root=tmp_path, settings=s, workers=1).root == world.root and not dead2.exists()


def test_support_and_query_sizes_that_only_fail_together_are_named():
    # topics 0-3: three domains of 2 images (6 in all); topics 4-7: one domain of 4.  With K_WAY 2, N_SUPPORT 3,
    # N_QUERY 3 the largest totals (6) and the largest domains (4) each suffice, but no topic has both
    topic = np.concatenate([np.repeat(np.arange(4), 6), np.repeat(np.arange(4, 8), 4)])
    domain = np.concatenate([np.tile(np.repeat(np.arange(3), 2), 4), np.zeros(16, int)])
    h = Hierarchy(
        topic_names=[f"t{i}" for i in range(8)],
        item_topic=topic,
        item_domain=domain,
        image_features=np.zeros((40, 4), np.float32),
        meta={"image_size": 32},
        image_loader=lambda idx: np.zeros((len(idx), 32, 32, 3), np.uint8),
    )
    opts = ["TASKS.K_WAY", "2", "TASKS.N_SUPPORT", "3", "TASKS.N_QUERY", "3", "TASKS.VAL_FRACTION", "0.0"]
    with pytest.raises(ValueError) as info:
        settings.check_task_sizes(settings.read_train_settings(build_cfg(opts=BASE + opts, output_dir="x")), h)
    msg = str(info.value)
    assert msg.startswith(
        "TASKS.N_SUPPORT: expected a support size that 2 training topics can supply together "
        "with N_QUERY 3 (TaskSampler: only 0 topics"
    ) and msg.endswith("got 3"), msg
    fits = ["TASKS.K_WAY", "2", "TASKS.N_SUPPORT", "2", "TASKS.N_QUERY", "2", "TASKS.VAL_FRACTION", "0.0"]
    settings.check_task_sizes(
        settings.read_train_settings(build_cfg(opts=BASE + fits, output_dir="x")), h
    )  # 2 + 2: every topic can
