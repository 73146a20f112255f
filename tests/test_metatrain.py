"""Meta-training run: resume exactness, no-op resume, export round trip, baselines, one-line errors, logs."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_same_tensors, flat_tensors
from helpers_metatrain import BASE, MODEL, N_DOMAINS, N_TOPICS, NAMES, colour_hierarchy, colour_pixels, seeded_clip

from meta.finetune.init_io import InitMismatchError, load_gram_init
from meta.infra.hashing import file_sha256
from meta.metatrain import build_cfg, main, settings
from meta.metatrain.checkpoint import CheckpointError, load_checkpoint
from meta.metatrain.data import FeatureMismatchError
from meta.metatrain.runlog import read_log
from meta.metatrain.settings import read_train_settings
from meta.metatrain.trainer import RunExistsError, setup_run, train
from meta.method.prompts import PromptParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hier():
    return colour_hierarchy()


PROMPTS = {
    "coop": ["META.PROMPT.N_CTX_TEXT", "4"],
    "unigram": ["META.PROMPT.N_CTX_TEXT", "2", "META.PROMPT.N_CTX_VISION", "2"],
}


def _cfg(out, *extra):
    return build_cfg(opts=BASE + list(extra), output_dir=str(out))


def _quiet(_msg):
    pass


class Killed(Exception):
    pass


def _kill_at(step):
    def hook(s, _metrics):
        if s == step:
            raise Killed(f"simulated kill after step {s}")

    return hook


def _train_records(run_dir):
    return [{k: v for k, v in r.items() if k != "time_per_step"} for r in read_log(Path(run_dir) / "log.jsonl")]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, hier):
    """An uninterrupted 6-step CoOp run (shared by several tests)."""
    out = tmp_path_factory.mktemp("run") / "coop"
    result = train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, echo=_quiet)
    return out, result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["coop", "unigram"])
def test_resume_after_kill_reproduces_uninterrupted_run(tmp_path, hier, kind, finished):
    if kind == "coop":
        full_dir = finished[0]
    else:
        full_dir = tmp_path / "full"
        train(_cfg(full_dir, *PROMPTS[kind]), hierarchy=hier, echo=_quiet)
    cut = tmp_path / "cut"
    with pytest.raises(Killed):
        train(_cfg(cut, *PROMPTS[kind]), hierarchy=hier, on_step=_kill_at(3), echo=_quiet)
    assert load_checkpoint(cut / "checkpoint.pt")["step"] == 2  # step 3 is lost, at most CHECKPOINT_EVERY
    assert max(r["step"] for r in read_log(cut / "log.jsonl")) == 3
    assert not (cut / "gram_init.safetensors").exists()

    result = train(_cfg(cut, *PROMPTS[kind]), resume=True, hierarchy=hier, echo=_quiet)
    assert result["resumed_from"] == 2 and result["step"] == 6

    full, resumed = load_checkpoint(full_dir / "checkpoint.pt"), load_checkpoint(cut / "checkpoint.pt")
    a, b = flat_tensors(full["learner"]), flat_tensors(resumed["learner"])
    assert a.keys() == b.keys() and any("module.ctx" in k for k in a)
    for key in a:  # θ, φ and every Adam moment: bit-identical
        assert torch.equal(a[key], b[key]), key
    assert full["stream"] == resumed["stream"]
    # the log reads like one uninterrupted run: same records, no duplicated steps
    assert _train_records(full_dir) == _train_records(cut)


@pytest.mark.slow
def test_finished_run_resume_is_noop(finished, hier):
    out, _ = finished
    files = sorted(p for p in out.rglob("*") if p.is_file())
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    result = train(_cfg(out, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=_quiet)
    assert result["noop"] and result["step"] == 6
    assert sorted(p for p in out.rglob("*") if p.is_file()) == files
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before


@pytest.mark.slow
def test_export_round_trips_through_load_gram_init(finished, tmp_path, tiny_clip):
    out, result = finished
    _, dims = tiny_clip
    state = load_checkpoint(out / "checkpoint.pt")
    gbml = state["learner"]["gbml"]
    init = load_gram_init(
        result["export"]["init"],
        expect={
            "text_width": dims.text_width,
            "vision_width": dims.vision_width,
            "n_ctx_text": 4,
            "n_ctx_vision": 0,
            "model_name": MODEL,
        },
    )
    assert torch.equal(init.prompt["ctx"], gbml["module.ctx"]) and "vpt" not in init.prompt
    regs = init.regulator_modules()
    assert list(regs) == ["ctx"]
    for k, v in regs["ctx"].state_dict().items():
        assert torch.equal(v, gbml[f"compute_update.transforms_modules.0.{k}"])
    # meta-training moved θ away from its seeded init and φ away from the identity (zero) init
    fresh = torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(0)) * 0.02
    assert not torch.allclose(init.prompt["ctx"], fresh)
    assert regs["ctx"].gamma.weight.abs().max() > 0
    prov = init.metadata["provenance"]
    assert prov["step"] == 6 and prov["finished"] and prov["config_hash"] == state["config_hash"]
    assert prov["hierarchy"]["num_topics"] == N_TOPICS and prov["hierarchy"]["backbone"] == MODEL
    coop = torch.load(result["export"]["coop_ctx"], weights_only=True)
    assert torch.equal(coop["state_dict"]["ctx"], gbml["module.ctx"])

    # `python -m meta export --run-dir D --out F` writes the same tensors elsewhere
    target = tmp_path / "exported" / "init.safetensors"
    assert main(["export", "--run-dir", str(out), "--out", str(target)]) == 0
    again = load_gram_init(target)
    assert torch.equal(again.prompt["ctx"], init.prompt["ctx"])
    assert (tmp_path / "exported" / "init_coop_ctx_nctx4.pth").is_file()  # N_CTX stock CoOp needs, in the name
    assert Path(result["export"]["coop_ctx"]).name == "coop_ctx_nctx4.pth" and coop["n_ctx"] == 4


@pytest.mark.slow
def test_metric_keys_in_json_log(finished):
    out, _ = finished
    records = read_log(out / "log.jsonl")
    train_recs = [r for r in records if r["kind"] == "train"]
    val_recs = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in val_recs] == [0, 3, 6]
    for r in train_recs:
        for key in (
            "support_loss_before",
            "support_acc_before",
            "query_loss_after",
            "query_acc_after",
            "grad_norm",
            "time_per_step",
        ):
            assert np.isfinite(r[key]), key
        assert 0.0 <= r["query_acc_after"] <= 1.0 and r["time_per_step"] > 0
        detailed = r["step"] % 2 == 0  # META.LOG_DETAIL_EVERY 2
        assert ("grad_cosine" in r) == detailed
        if detailed:
            assert -1.0 <= r["grad_cosine"] <= 1.0
            assert {"query_loss_before", "query_acc_before", "support_loss_after", "support_acc_after"} <= r.keys()
    for r in val_recs:
        assert {"query_acc_before", "query_acc_after", "query_loss_before", "query_loss_after"} <= r.keys()
        assert r["tasks"] == 2
    # resolved config saved and re-loadable; run.json records hash, hierarchy and the feature check
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["META"]["STEPS"] == 6 and saved["TASKS"]["K_WAY"] == 3 and saved["OUTPUT_DIR"] == str(out)
    info = json.loads((out / "run.json").read_text())
    assert info["config_hash"] == load_checkpoint(out / "checkpoint.pt")["config_hash"]
    assert info["feature_check"]["images_checked"] == 4 and info["feature_check"]["min_cosine"] > 0.999
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_sigterm_during_export_exits_143_in_one_line_and_writes_nothing(finished, tmp_path, monkeypatch, capsys):
    """``python -m meta export`` stopped by SIGTERM (as a scheduler stops it) exits 143 with one ``error:`` line naming
    the run folder, as ``meta train`` does, instead of dying silently with -15; no file is written."""
    import os
    import signal
    import time

    from meta.metatrain import cli
    from meta.metatrain import export as export_mod

    run_dir, _ = finished
    real = export_mod.export_state

    def terminated_midway(state, run, out=None):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to this (main) thread at once
        time.sleep(5)  # never reached when the handler raises
        return real(state, run, out)

    monkeypatch.setattr(export_mod, "export_state", terminated_midway)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "late" / "gram_init.safetensors"
    out.parent.mkdir()
    code = cli.main(["export", "--run-dir", str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_STOPPED == 143
    assert len(err) == 1 and err[0].startswith(f"error: --run-dir {run_dir}: export stopped by SIGTERM")
    assert list(out.parent.iterdir()) == [] and signal.getsignal(signal.SIGTERM) is before


def test_pretrain_baseline_exports_without_regulator(tmp_path, hier):
    out = tmp_path / "pre"
    result = train(
        _cfg(out, "META.MODE", "pretrain", "META.PRETRAIN.BATCH_SIZE", "8", *PROMPTS["coop"]),
        hierarchy=hier,
        echo=_quiet,
    )
    init = load_gram_init(result["export"]["init"])
    assert init.regulators == {} and init.metadata["regulator"] is None
    assert init.metadata["provenance"]["mode"] == "pretrain"
    recs = [r for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
    assert len(recs) == 6 and all(np.isfinite(r["loss"]) and r["classes"] == 6 for r in recs)
    fresh = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    assert not torch.allclose(init.prompt["ctx"], fresh)


def test_switches_reach_the_loop(tmp_path, hier):
    run = setup_run(
        read_train_settings(_cfg(tmp_path, "TASKS.DOMAIN_SHIFT", "False", "META.REGULATE", "False")), hierarchy=hier
    )
    assert run.stream.sampler.domain_shift is False and run.learner.regulators() == {}
    assert len(run.train_topics) == 6 and len(run.val_topics) == 2
    assert not set(run.train_topics) & set(run.val_topics)
    assert all(set(t.topics) <= set(run.val_topics) for t in run.val_tasks)
    tasks = run.stream.next(3)
    assert all(set(t.topics) <= set(run.train_topics) for t in tasks)
    batch = run.batcher(tasks[0])
    assert (
        batch.support["features"].shape == (3 * 2, 64) and batch.query["label"].tolist() == [0] * 3 + [1] * 3 + [2] * 3
    )
    vis = setup_run(read_train_settings(_cfg(tmp_path, *PROMPTS["unigram"])), hierarchy=hier)
    assert vis.batcher(vis.stream.next(1)[0]).support["images"].shape == (6, 3, 32, 32)


def test_class_shift_tasks_reach_the_loop_and_the_init_file(tmp_path, hier):
    """``TASKS.QUERY_NEW_SHARE 1``: every training task's query topics are training topics outside its support,
    the query batch carries their names, meta-training runs, and the init file records the share."""
    share = ["TASKS.QUERY_NEW_SHARE", "1.0", "META.STEPS", "2", *PROMPTS["coop"]]
    run = setup_run(read_train_settings(_cfg(tmp_path / "setup", *share)), hierarchy=hier)
    assert run.stream.sampler.n_new == 3
    assert run.val_tasks == []  # 2 held-out topics cannot hold K >= 2 support plus as many new query classes
    for task in run.stream.next(4):
        assert not set(task.topics) & set(task.query_topics)
        assert set(task.query_topics) <= set(run.train_topics)
        assert run.batcher(task).query["classnames"] == task.query_names
    result = train(_cfg(tmp_path / "run", *share), hierarchy=hier, echo=_quiet)
    recs = [r for r in read_log(tmp_path / "run" / "log.jsonl") if r["kind"] == "train"]
    assert len(recs) == 2 and all(np.isfinite(r["query_loss_after"]) for r in recs)
    tasks = load_gram_init(result["export"]["init"]).metadata["provenance"]["tasks"]
    assert tasks["query_new_share"] == 1.0


def test_gate_form_meta_trains_validates_downstream_and_exports_a_gate(tmp_path, hier, capsys):
    """``META.REGULATOR.FORM gate`` with a text consistency weight: meta-training, downstream validation (the gate at
    test time) and export run; the file holds the gate; without a regulariser the config is refused in one line."""
    from meta.method.regulator import GradientGate

    gate = ["META.REGULATOR.FORM", "gate", "META.REGULATOR.GATE_GROUP", "4", "META.STEPS", "3", *PROMPTS["coop"]]
    msg = _one_error_line(capsys, ["train", "--output-dir", str(tmp_path / "refused"), *BASE, *gate])
    assert "META.REGULATOR.FORM" in msg and "META.CONSISTENCY.TEXT_WEIGHT" in msg
    result = train(_cfg(tmp_path / "run", *gate, "META.CONSISTENCY.TEXT_WEIGHT", "2.0"), hierarchy=hier, echo=_quiet)
    records = read_log(tmp_path / "run" / "log.jsonl")
    train_recs = [r for r in records if r["kind"] == "train"]
    val_recs = [r for r in records if r["kind"] == "val"]
    assert len(train_recs) == 3 and all(np.isfinite(r["query_loss_after"]) for r in train_recs)
    assert val_recs and all(0.0 <= r["query_acc_downstream"] <= 1.0 for r in val_recs)
    init = load_gram_init(result["export"]["init"])
    regs = init.regulator_modules()
    assert set(regs) == {"ctx"} and isinstance(regs["ctx"], GradientGate) and regs["ctx"].group == 4
    assert float(regs["ctx"].gate.weight.abs().max()) > 0  # φ moved from its zero start
    assert init.metadata["provenance"]["meta"]["regulator"]["form"] == "gate"


def test_features_from_another_clip_are_refused(tmp_path):
    with pytest.raises(FeatureMismatchError, match="cosine"):
        setup_run(read_train_settings(_cfg(tmp_path)), hierarchy=colour_hierarchy(clip_seed=1))
    with pytest.raises(FeatureMismatchError, match="MODEL.BACKBONE"):
        setup_run(read_train_settings(_cfg(tmp_path)), hierarchy=colour_hierarchy(backbone="ViT-B-16"))


@pytest.mark.slow
def test_existing_or_corrupt_or_mismatching_checkpoint_never_overwritten(finished, tmp_path, hier):
    out, _ = finished
    with pytest.raises(RunExistsError, match="--resume"):
        train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, echo=_quiet)
    with pytest.raises(CheckpointError, match="META.INNER_LR"):
        train(
            _cfg(out, *PROMPTS["coop"], "META.INNER_LR", "0.3", "META.STEPS", "8"),
            resume=True,
            hierarchy=hier,
            echo=_quiet,
        )
    moved = colour_hierarchy()
    moved.item_domain = (moved.item_domain + 1) % N_DOMAINS  # same images and features, other domains
    with pytest.raises(CheckpointError, match="hierarchy changed"):
        train(_cfg(out, *PROMPTS["coop"], "META.STEPS", "8"), resume=True, hierarchy=moved, echo=_quiet)
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 6
    bad = tmp_path / "bad"
    bad.mkdir()
    blob = (out / "checkpoint.pt").read_bytes()[:300]
    (bad / "checkpoint.pt").write_bytes(blob)
    with pytest.raises(CheckpointError, match="unreadable checkpoint"):
        train(_cfg(bad, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=_quiet)
    assert (bad / "checkpoint.pt").read_bytes() == blob and sorted(p.name for p in bad.iterdir()) == ["checkpoint.pt"]


def _one_error_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    return err


def test_bad_config_and_missing_hierarchy_give_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "r")
    assert "META.NO_SUCH_KEY" in _one_error_line(capsys, ["train", "--output-dir", out, "META.NO_SUCH_KEY", "1"])
    assert "META.MODE" in _one_error_line(capsys, ["train", "--output-dir", out, "META.MODE", "finetune"])
    assert "--config-file" in _one_error_line(capsys, ["train", "--config-file", str(tmp_path / "nope.yaml")])
    msg = _one_error_line(capsys, ["train", "--output-dir", out, *BASE, "META.HIERARCHY", str(tmp_path / "no_chc")])
    assert "META.HIERARCHY" in msg and "no_chc" in msg
    msg = _one_error_line(
        capsys,
        [
            "train",
            "--output-dir",
            out,
            *BASE,
            "TASKS.SOURCE",
            "image_folder",
            "TASKS.IMAGE_FOLDER",
            str(tmp_path / "missing"),
        ],
    )
    assert "TASKS.IMAGE_FOLDER" in msg
    assert "--run-dir" in _one_error_line(capsys, ["export", "--run-dir", str(tmp_path)])
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_cli_trains_from_an_image_folder(tmp_path):
    """`python -m meta train` end to end (Table 4 row 4 source), in a fresh process from the repo root."""
    from PIL import Image

    pixels, topic, _ = colour_pixels(n_topics=6)
    root = tmp_path / "folder"
    for i, (img, t) in enumerate(zip(pixels, topic)):
        (root / NAMES[t]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(root / NAMES[t] / f"{i:03d}.png")
    weights = tmp_path / "tiny_clip.pt"  # a weights file: its sha256 must be recorded and checked
    torch.save(seeded_clip(3)[0].state_dict(), weights)
    out = tmp_path / "run"
    # text prompts (train_coop.yaml): the cached image features are used, so they are checked
    cmd = [
        sys.executable,
        "-m",
        "meta",
        "train",
        "--config-file",
        str(ROOT / "configs/meta/train_coop.yaml"),
        "--output-dir",
        str(out),
        *BASE,
        "META.STEPS",
        "2",
        "TASKS.SOURCE",
        "image_folder",
        "TASKS.IMAGE_FOLDER",
        str(root),
        "MODEL.PRETRAINED",
        str(weights),
        "CHC.DOMAINS.MIN_PER_DOMAIN",
        "4",
        "META.TENSORBOARD",
        "False",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    init = load_gram_init(out / "gram_init.safetensors")
    assert init.metadata["provenance"]["tasks"]["source"] == "image_folder"
    assert init.metadata["provenance"]["hierarchy"]["num_topics"] == 6
    assert init.metadata["provenance"]["hierarchy"]["weights_sha256"] == file_sha256(weights)


@pytest.mark.slow
def test_resume_with_more_steps_continues_exactly(finished, tmp_path, hier):
    """A finished 6-step run extended to 8 steps equals an uninterrupted 8-step run."""
    import shutil

    extended = tmp_path / "extended"
    shutil.copytree(finished[0], extended)
    result = train(_cfg(extended, *PROMPTS["coop"], "META.STEPS", "8"), resume=True, hierarchy=hier, echo=_quiet)
    assert result["resumed_from"] == 6 and result["step"] == 8
    straight = tmp_path / "straight"
    train(_cfg(straight, *PROMPTS["coop"], "META.STEPS", "8"), hierarchy=hier, echo=_quiet)
    a = flat_tensors(load_checkpoint(extended / "checkpoint.pt")["learner"])
    b = flat_tensors(load_checkpoint(straight / "checkpoint.pt")["learner"])
    assert_same_tensors(a, b)
    assert load_gram_init(extended / "gram_init.safetensors").metadata["provenance"]["step"] == 8


@pytest.mark.slow
def test_kill_before_first_checkpoint_then_resume_starts_over(tmp_path, hier, finished):
    out = tmp_path / "early"
    with pytest.raises(Killed):
        train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, on_step=_kill_at(1), echo=_quiet)
    assert not (out / "checkpoint.pt").exists() and read_log(out / "log.jsonl")
    messages = []
    result = train(_cfg(out, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=messages.append)
    assert result["resumed_from"] is None and "starting from step 0" in messages[0]
    assert _train_records(out) == _train_records(finished[0])  # the stale records are gone


@pytest.mark.slow
@pytest.mark.statistical
def test_meta_training_lowers_the_query_loss(tmp_path, hier):
    """The outer loop descends: post-adaptation query loss falls well below its start (chance = ln 3)."""
    out = tmp_path / "learn"
    train(
        _cfg(
            out,
            *PROMPTS["coop"],
            "META.STEPS",
            "80",
            "META.CHECKPOINT_EVERY",
            "80",
            "META.VAL_TASKS",
            "0",
            "META.LOG_DETAIL_EVERY",
            "0",
            "META.TENSORBOARD",
            "False",
        ),
        hierarchy=hier,
        echo=_quiet,
    )
    losses = [r["query_loss_after"] for r in read_log(out / "log.jsonl") if r["kind"] == "train"]
    first, last = float(np.mean(losses[:15])), float(np.mean(losses[-15:]))
    print(f"query_loss_after first15 {first:.3f} last15 {last:.3f}")
    assert len(losses) == 80 and first > 0.9 and last < 0.85 * first, (first, last)


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_resume_matches(tmp_path, hier, finished):
    import os
    import signal

    out = tmp_path / "term"

    def term_at_3(step, _metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    result = train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, on_step=term_at_3, echo=_quiet)
    assert result["stopped"] and result["step"] == 3 and signal.getsignal(signal.SIGTERM) == previous
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 3  # nothing lost, although 3 % CHECKPOINT_EVERY != 0
    train(_cfg(out, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=_quiet)
    a = flat_tensors(load_checkpoint(out / "checkpoint.pt")["learner"])
    b = flat_tensors(load_checkpoint(finished[0] / "checkpoint.pt")["learner"])
    assert_same_tensors(a, b)


@pytest.mark.slow
def test_second_ctrl_c_interrupts_at_once_keeping_the_last_periodic_checkpoint(tmp_path, hier, finished):
    """Ctrl-C twice within step 3: KeyboardInterrupt right away (no stop checkpoint at step 3); the periodic
    checkpoint of step 2 holds, the handlers are restored, and --resume reproduces the uninterrupted run."""
    import os
    import signal

    out = tmp_path / "int2"

    def two_ctrl_c_at_3(step, _metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # first: stop after this step
            os.kill(os.getpid(), signal.SIGINT)  # second: interrupt now

    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, on_step=two_ctrl_c_at_3, echo=_quiet)
    assert signal.getsignal(signal.SIGINT) == previous
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2  # CHECKPOINT_EVERY 2: step 3 is lost
    assert not (out / "gram_init.safetensors").exists()
    result = train(_cfg(out, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=_quiet)
    assert result["resumed_from"] == 2 and result["step"] == 6
    assert_same_tensors(
        flat_tensors(load_checkpoint(out / "checkpoint.pt")["learner"]),
        flat_tensors(load_checkpoint(finished[0] / "checkpoint.pt")["learner"]),
    )
    assert _train_records(out) == _train_records(finished[0])


def test_second_ctrl_c_while_the_stop_checkpoint_is_written_keeps_the_previous_one(tmp_path, hier, monkeypatch):
    """The second Ctrl-C lands after the stop checkpoint's bytes are on disk but before the rename:
    the previous checkpoint (step 2) stays intact and readable, and no temporary file is left behind."""
    import os
    import signal

    out = tmp_path / "int2save"
    armed = []
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if armed and str(dst).endswith("checkpoint.pt"):
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)
        return real_replace(src, dst, *args, **kwargs)

    def ctrl_c_at_3(step, _metrics):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
            armed.append(True)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(out, *PROMPTS["coop"]), hierarchy=hier, on_step=ctrl_c_at_3, echo=_quiet)
    assert not armed  # the interrupt did hit the checkpoint write
    assert load_checkpoint(out / "checkpoint.pt")["step"] == 2
    assert [p.name for p in out.iterdir() if "checkpoint" in p.name] == ["checkpoint.pt"]


# ----------------------------------------------------------------------------- run safety
def _dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_second_writer_gets_one_line_error_naming_folder_and_holder_pid(tmp_path, capsys):
    """Two runs in one folder: the second (train or cluster) stops at once, naming the folder and PID."""
    import os

    from meta.__main__ import main as meta_main
    from meta.infra.runlock import RunLock

    out = tmp_path / "busy"
    code = (
        "import sys, time; from meta.infra.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('locked', flush=True); time.sleep(300)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        msg = _one_error_line(capsys, ["train", "--output-dir", str(out), *BASE])
        assert msg.startswith(f"error: {out}: already in use by PID {holder.pid} "), msg
        assert meta_main(["cluster", "CHC.OUTPUT_DIR", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {out}: already in use by PID {holder.pid} ") and "\n" not in err, err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing of the second writer's
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock with the process
        holder.wait()
    with RunLock(out) as lock:
        assert lock.held and (out / ".lock").read_text().strip() == str(os.getpid())
    assert not (out / ".lock").exists()


def test_kill_between_the_two_exports_is_repaired_by_resume(tmp_path, hier, monkeypatch):
    import meta.metatrain.export as export_mod

    out = tmp_path / "cut"
    cfg = _cfg(out, *PROMPTS["coop"], "META.STEPS", "2", "META.VAL_TASKS", "0", "META.TENSORBOARD", "False")

    def killed(*_args, **_kwargs):
        raise Killed("kill after gram_init.safetensors, before coop_ctx_nctx4.pth")

    monkeypatch.setattr(export_mod, "export_coop_context", killed)
    with pytest.raises(Killed):
        train(cfg, hierarchy=hier, echo=_quiet)
    monkeypatch.undo()
    assert (out / "gram_init.safetensors").is_file() and not (out / "coop_ctx_nctx4.pth").exists()
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    ctx = load_checkpoint(out / "checkpoint.pt")["learner"]["gbml"]["module.ctx"]

    messages = []
    result = train(cfg, resume=True, hierarchy=hier, echo=messages.append)
    assert not result["noop"] and "coop_ctx_nctx4.pth missing or unreadable" in messages[0]
    assert torch.equal(torch.load(out / "coop_ctx_nctx4.pth", weights_only=True)["state_dict"]["ctx"], ctx)
    (out / "coop_ctx_nctx4.pth").write_bytes(b"")  # what a full disk left with the old, non-atomic writer
    assert not train(cfg, resume=True, hierarchy=hier, echo=_quiet)["noop"]
    assert torch.equal(torch.load(out / "coop_ctx_nctx4.pth", weights_only=True)["state_dict"]["ctx"], ctx)
    assert train(cfg, resume=True, hierarchy=hier, echo=_quiet)["noop"]  # now verified: nothing to do


@pytest.mark.slow
def test_leftover_temp_files_are_removed_and_outputs_get_plain_file_mode(finished, tmp_path, hier):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    dead = _dead_pid()
    stale = [
        run / f".checkpoint.pt.tmp-{dead}",
        run / f".gram_init.safetensors.tmp-{dead}-0badc0de",
        run / ".coop_ctx_nctx4.pth.tmp-1-00000000",
    ]  # PID 1 is alive, but the folder's lock is ours
    for path in stale:
        path.write_bytes(b"partial")
    assert train(_cfg(run, *PROMPTS["coop"]), resume=True, hierarchy=hier, echo=_quiet)["noop"]
    assert not [p.name for p in stale if p.exists()]
    plain = (finished[0] / "log.jsonl").stat().st_mode & 0o777  # created by open(): 0666 & ~umask
    for name in ("gram_init.safetensors", "coop_ctx_nctx4.pth", "checkpoint.pt", "run.json", "config.yaml"):
        assert (finished[0] / name).stat().st_mode & 0o777 == plain, name


def test_bad_values_are_refused_naming_their_key(tmp_path, capsys):
    out = tmp_path / "r"
    for key, value in (
        ("META.INNER_LR", "-0.1"),
        ("META.OUTER_LR_PROMPT", "-0.002"),
        ("META.OUTER_LR_REGULATOR", "-0.001"),
        ("META.GRAD_CLIP", "-1.0"),
        ("MODEL.PRECISION", "fp8"),
        ("MODEL.BACKBONE", "NoSuchModel"),
        ("MODEL.DEVICE", "gpu"),
    ):
        msg = _one_error_line(capsys, ["train", "--output-dir", str(out), *BASE, key, value])
        assert msg.startswith(f"error: {key}: "), msg
    if not torch.cuda.is_available():
        msg = _one_error_line(capsys, ["train", "--output-dir", str(out), *BASE, "MODEL.DEVICE", "cuda:0"])
        assert msg.startswith("error: MODEL.DEVICE: 'cuda:0' asked for, but no CUDA GPU"), msg
    assert not out.exists()  # refused runs leave no folder behind
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    msg = _one_error_line(capsys, ["train", "--output-dir", str(a_file), *BASE])
    assert msg.startswith(f"error: OUTPUT_DIR: {a_file} is a file"), msg
    from meta.__main__ import main as meta_main

    assert meta_main(["cluster", "CHC.OUTPUT_DIR", str(a_file)]) == 2
    assert capsys.readouterr().err.strip() == f"error: CHC.OUTPUT_DIR: {a_file} is a file, expected a folder"


@pytest.mark.slow
def test_cli_errors_are_one_line_exit_2_and_debug_shows_the_traceback(finished, tmp_path, capsys, monkeypatch):
    import errno

    import meta.infra.fileio as fileio
    from meta.__main__ import main as meta_main

    bad = tmp_path / "bad.yaml"
    bad.write_text("META:\n  STEPS: [1,\n")
    assert _one_error_line(capsys, ["train", "--config-file", str(bad)]).startswith(
        f"error: {bad}: not valid YAML (line 3"
    )
    assert meta_main(["cluster", "--config-file", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}: not valid YAML")
    script = tmp_path / "cfg.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    assert "--config-file: expected a .yaml or .yml file" in _one_error_line(
        capsys, ["train", "--config-file", str(script)]
    )
    assert not (tmp_path / "cfg.py.ran").exists()  # never executed
    folder = tmp_path / "folder"
    folder.mkdir()
    assert _one_error_line(capsys, ["export", "--run-dir", str(finished[0]), "--out", str(folder)]).startswith(
        f"error: --out: {folder} is a folder"
    )

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    target = tmp_path / "disk" / "init.safetensors"
    msg = _one_error_line(capsys, ["export", "--run-dir", str(finished[0]), "--out", str(target)])
    assert msg.startswith(f"error: {target.parent}: no space left on device (writing init.safetensors)"), msg
    assert list(target.parent.iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not valid YAML"):
        main(["train", "--config-file", str(bad), "--debug"])
    monkeypatch.setenv("GRAM_DEBUG", "1")
    with pytest.raises(ValueError, match="not valid YAML"):
        main(["train", "--config-file", str(bad)])


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    from PIL import Image

    pixels, topic, _ = colour_pixels(n_topics=6)
    root = tmp_path_factory.mktemp("folder")
    for i, (img, t) in enumerate(zip(pixels, topic)):
        (root / NAMES[t]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(root / NAMES[t] / f"{i:03d}.png")
    return root


@pytest.mark.slow
def test_sigterm_stops_the_cli_with_exit_143_and_a_resumable_checkpoint(image_folder, tmp_path):
    import os
    import signal
    import threading
    import time

    out = tmp_path / "term"

    def term_after_first_step():
        deadline = time.time() + 240
        while time.time() < deadline:
            if any(r.get("kind") == "train" for r in read_log(out / "log.jsonl")):
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # a stray late signal must not end pytest
    try:
        thread = threading.Thread(target=term_after_first_step, daemon=True)
        thread.start()
        code = main(
            [
                "train",
                "--config-file",
                str(ROOT / "configs/meta/train_supervised.yaml"),
                "--output-dir",
                str(out),
                *BASE,
                "META.STEPS",
                "1000",
                "META.VAL_TASKS",
                "0",
                "TASKS.IMAGE_FOLDER",
                str(image_folder),
                "CHC.DOMAINS.MIN_PER_DOMAIN",
                "4",
                "META.TENSORBOARD",
                "False",
            ]
        )
        thread.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143
    assert 1 <= load_checkpoint(out / "checkpoint.pt")["step"] < 1000
    assert not (out / "gram_init.safetensors").exists() and not (out / ".lock").exists()


# ---------------------------------------------------------------- deep prompt learners (IVLP, MaPLe)
DEEP_RUNS = {  # example config, and what the tiny CLIP (2 text and 2 vision blocks) needs on top
    "ivlp": ("configs/meta/train_ivlp.yaml", [], {"ctx": (2, 64), "ctx_deep": (1, 2, 64), "vpt": (2, 2, 64)}),
    "maple": (
        "configs/meta/train_maple.yaml",
        ["META.PROMPT.TEXT_DEPTH", "0"],
        {"ctx": (2, 64), "ctx_deep": (1, 2, 64), "proj_weight": (2, 64, 64), "proj_bias": (2, 64)},
    ),
}


@pytest.mark.parametrize("kind", sorted(DEEP_RUNS))
def test_deep_prompt_learners_meta_train_and_export(tmp_path, hier, tiny_clip, kind):
    """`python -m meta train` with the example config: every θ tensor and its R_φ move, the export records the
    structure, loads back with the checkpoint's tensors and refuses a shallow model."""
    config, extra, shapes = DEEP_RUNS[kind]
    out = tmp_path / kind
    cfg = build_cfg(
        str(ROOT / config),
        BASE + ["META.STEPS", "2", "META.VAL_EVERY", "0", "META.LOG_DETAIL_EVERY", "0"] + extra,
        str(out),
    )
    result = train(cfg, hierarchy=hier, echo=_quiet)
    gbml = load_checkpoint(out / "checkpoint.pt")["learner"]["gbml"]
    init = load_gram_init(result["export"]["init"])
    assert {k: tuple(v.shape) for k, v in init.prompt.items()} == shapes
    want = {"text_depth": 2, "coupling": "maple" if kind == "maple" else "none"}
    assert {k: init.metadata["prompt"][k] for k in want} == want
    clip, dims = tiny_clip  # θ's start is the trainer's draw (seeded by SEED); no tensor here depends on the CLIP
    fresh = PromptParams.from_spec(
        settings.prompt_spec(cfg), clip, dims, generator=torch.Generator().manual_seed(int(cfg.SEED))
    )
    regs = init.regulator_modules()
    assert sorted(regs) == sorted(shapes)  # one R_φ per prompt tensor
    for name in shapes:
        assert torch.equal(init.prompt[name], gbml[f"module.{name}"]), name
        assert not torch.allclose(init.prompt[name], getattr(fresh, name).detach()), f"{name} did not move"
        assert regs[name].gamma.weight.abs().max() > 0, f"R_phi of {name} did not move"
    again = tmp_path / "again.safetensors"
    assert main(["export", "--run-dir", str(out), "--out", str(again)]) == 0
    for name, t in load_gram_init(again).prompt.items():
        assert torch.equal(t, init.prompt[name])
    with pytest.raises(InitMismatchError, match="text_depth: file has 2, model expects 1"):
        load_gram_init(again, expect={"text_depth": 1})


def test_run_json_and_init_file_record_what_computed_them(tmp_path, hier, monkeypatch):
    """META.FINGERPRINT (on by default): run.json and the exported init file carry computed_by (commit, numerics
    fingerprint, CPU and pins) from the recorder the caller wires in (``python -m meta train`` passes
    meta.fingerprint.record.computed_by); a resume under another fingerprint is listed. The golden run itself is
    replaced by fixed digests here (its own tests are tests/test_numerics.py)."""
    from meta.fingerprint import record

    monkeypatch.setitem(record._FINGERPRINT, "digest", "a" * 64)
    out = tmp_path / "run"
    opts = [*PROMPTS["coop"], "META.FINGERPRINT", "True", "META.VAL_TASKS", "0"]
    result = train(_cfg(out, *opts, "META.STEPS", "2"), hierarchy=hier, echo=_quiet, recorder=record.computed_by)
    info = json.loads((out / "run.json").read_text())
    assert info["computed_by"]["fingerprint"] == "a" * 64 and "fingerprint_changes" not in info
    assert set(info["computed_by"]) == {"commit", "fingerprint", "golden", "numerics"}
    assert info["computed_by"]["numerics"]["cpu_model"] == info["numerics"]["cpu_model"]
    prov = load_gram_init(result["export"]["init"]).metadata["provenance"]
    assert prov["computed_by"]["fingerprint"] == "a" * 64
    monkeypatch.setitem(record._FINGERPRINT, "digest", "b" * 64)
    train(_cfg(out, *opts, "META.STEPS", "4"), resume=True, hierarchy=hier, echo=_quiet, recorder=record.computed_by)
    info = json.loads((out / "run.json").read_text())
    assert info["fingerprint_changes"] == [{"at_step": 2, "before": "a" * 64, "now": "b" * 64}]
    assert info["computed_by"]["fingerprint"] == "b" * 64


def test_a_run_given_no_recorder_says_it_recorded_no_fingerprint(tmp_path, hier):
    """The recorder is wired by the caller, not by an import somewhere in the process: importing
    meta.fingerprint.record changes nothing, and train() without a recorder writes computed_by with
    ``fingerprint`` None and says so in one line."""
    import meta.fingerprint.record  # noqa: F401  (imported: it must not register anything)

    said = []
    out = tmp_path / "run"
    opts = [*PROMPTS["coop"], "META.FINGERPRINT", "True", "META.VAL_TASKS", "0", "META.STEPS", "1"]
    train(_cfg(out, *opts), hierarchy=hier, echo=said.append)
    info = json.loads((out / "run.json").read_text())
    assert info["computed_by"]["fingerprint"] is None and info["computed_by"]["commit"]
    assert [m for m in said if "no numerics fingerprint recorded" in m and "run.json" in m]
