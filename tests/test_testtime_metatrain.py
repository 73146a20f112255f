"""``python -m meta train`` with ``META.MODE testtime`` (meta/metatrain/testtime_objective.py wired into the run):
θ* and R_φ meta-trained for test-time tuning on the tiny colour world, validated and exported; a killed run resumes
to the uninterrupted one bit for bit (the views of a task do not depend on what came before); visual prompts train
on view images; bad settings end in one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import flat_tensors
from helpers_metatrain import BASE, colour_hierarchy

from meta.finetune.init_io import load_gram_init
from meta.metatrain import build_cfg, main
from meta.metatrain.checkpoint import load_checkpoint
from meta.metatrain.runlog import read_log
from meta.metatrain.settings import read_train_settings
from meta.metatrain.testtime_objective import TestTimeObjective
from meta.metatrain.trainer import setup_run, train, validate

TESTTIME = ["META.MODE", "testtime", "META.TEST_TIME.VIEWS", "4", "META.TEST_TIME.CONFIDENT_SHARE", "0.5"]
COOP = ["META.PROMPT.N_CTX_TEXT", "4"]


@pytest.fixture(scope="module")
def hier():
    return colour_hierarchy()


def _cfg(out, *extra):
    return build_cfg(opts=BASE + TESTTIME + list(extra), output_dir=str(out))


def _quiet(_msg):
    pass


class Killed(Exception):
    pass


def test_the_run_builds_the_objective_and_the_query_views(tmp_path, hier):
    run = setup_run(read_train_settings(_cfg(tmp_path, *COOP)), hierarchy=hier)
    assert run.learner.objective == TestTimeObjective(kept=2)  # int(4 x 0.5)
    task = run.stream.next(1)[0]
    batch = run.batcher(task)
    views, features = batch.query["view_features"], torch.as_tensor(hier.image_features[task.query_index])
    assert batch.support is None and set(batch.query) == {"classnames", "label", "view_features"}  # nothing unused
    assert views.shape == (len(task.query_index), 4, features.shape[-1]) and not views.requires_grad
    torch.testing.assert_close(views[:, 0], features, rtol=1e-5, atol=1e-6)  # view 0: the image
    assert batch.query["label"].tolist() == list(task.query_label)
    again = run.batcher(task).query["view_features"]
    assert torch.equal(again, views)  # a task's views are a function of the task


def test_validation_steps_first_order_to_the_second_order_values(tmp_path, hier):
    run = setup_run(read_train_settings(_cfg(tmp_path, *COOP)), hierarchy=hier)
    unroll, asked, force = run.learner.unroll, [], {}

    def spy(loss_fn, batch, first_order=None):  # what validate() asks of each image's inner step
        asked.append(first_order)
        return unroll(loss_fn, batch, first_order=force.get("order", first_order))

    run.learner.unroll = spy
    got = validate(run)
    assert set(asked) == {True} and len(asked) == sum(len(t.query_index) for t in run.val_tasks)
    force["order"] = False
    second = validate(run)  # the values of a second-order step (other attention and LayerNorm kernels)
    assert got.keys() == second.keys() == {"entropy_before", "query_loss_after", "query_acc_after", "tasks"}
    for key in got:
        assert got[key] == pytest.approx(second[key], rel=1e-4), key


@pytest.mark.slow
def test_a_killed_testtime_run_resumes_to_the_uninterrupted_one_and_exports(tmp_path, hier):
    full = tmp_path / "full"
    result = train(_cfg(full, *COOP), hierarchy=hier, echo=_quiet)
    records = read_log(full / "log.jsonl")
    train_recs = [r for r in records if r["kind"] == "train"]
    assert len(train_recs) == 6
    for r in train_recs:
        assert (
            math.isfinite(r["query_loss_after"])
            and math.isfinite(r["entropy_before"])
            and 0 <= r["query_acc_after"] <= 1
        )
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, 3, 6] and all("query_acc_after" in r and "entropy_before" in r for r in val)
    init = load_gram_init(result["export"]["init"])
    assert init.metadata["provenance"]["mode"] == "testtime"
    assert init.regulators and any(float(t.abs().sum()) > 0 for reg in init.regulators.values() for t in reg.values())

    cut = tmp_path / "cut"

    def kill(step, _metrics):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        train(_cfg(cut, *COOP), hierarchy=hier, on_step=kill, echo=_quiet)
    resumed = train(_cfg(cut, *COOP), resume=True, hierarchy=hier, echo=_quiet)
    assert resumed["resumed_from"] == 2 and resumed["step"] == 6
    a = flat_tensors(load_checkpoint(full / "checkpoint.pt")["learner"])
    b = flat_tensors(load_checkpoint(cut / "checkpoint.pt")["learner"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_visual_prompts_meta_train_on_view_images(tmp_path, hier):
    opts = ["META.PROMPT.N_CTX_TEXT", "2", "META.PROMPT.N_CTX_VISION", "2", "META.STEPS", "2", "META.VAL_TASKS", "0"]
    run = setup_run(read_train_settings(_cfg(tmp_path / "probe", *opts)), hierarchy=hier)
    assert run.batcher(run.stream.next(1)[0]).query["view_images"].shape[1:] == (4, 3, 32, 32)
    result = train(_cfg(tmp_path / "run", *opts), hierarchy=hier, echo=_quiet)
    start = load_gram_init(result["export"]["init"]).prompt
    assert set(start) == {"ctx", "vpt"}
    assert all(
        math.isfinite(r["query_loss_after"]) for r in read_log(tmp_path / "run" / "log.jsonl") if r["kind"] == "train"
    )


def test_bad_testtime_settings_are_one_line_errors_naming_the_key(tmp_path, capsys):
    out = tmp_path / "r"
    for extra, start in (
        (["META.TEST_TIME.VIEWS", "0"], "error: META.TEST_TIME.VIEWS: expected an integer >= 1"),
        (
            ["META.TEST_TIME.CONFIDENT_SHARE", "1.5"],
            "error: META.TEST_TIME.CONFIDENT_SHARE: expected a share in (0, 1]",
        ),
        (
            ["META.REGULATOR.FORM", "gate"],
            "error: META.REGULATOR.FORM: expected residual or paper under META.MODE testtime",
        ),
    ):
        assert main(["train", "--output-dir", str(out), *BASE, *TESTTIME, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
    assert not out.exists()
