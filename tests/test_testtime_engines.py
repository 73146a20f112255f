"""Test-time tuning in both engines: ``TRAINER.GRAM.TEST_TIME`` in the Dassl trainers and ``--test-time`` in the
evaluator give the same predictions on the same images and the same accuracies, from words, from θ* with R_φ, and
with visual prompts; both refuse bad settings in one line naming the key.

The alignment of the two paths (sample, order, transform, weights) is the engine agreement test's
(tests/test_engine_agreement.py); here each run trains one epoch, then TPT tunes a fresh copy of the trained θ on
every test image (4 views, so the tiny test stays fast)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

pytestmark = pytest.mark.dassl
pytest.importorskip("dassl", reason="Dassl not installed: the test runs the Dassl trainers")

import torch  # noqa: E402
from helpers_dassl import SEED, SHOTS, agreement_world, dassl_run, evaluator_train_spec  # noqa: E402

from meta.evaluation import DatasetRef, evaluate_base_to_new, method_preset  # noqa: E402
from meta.evaluation.images import ImageLoader  # noqa: E402
from meta.finetune.testtime import TestTimeSpec, tune_and_predict  # noqa: E402
from meta.method import methods  # noqa: E402
from meta.method.prompts import PromptedCLIP  # noqa: E402

SHAPES = {"GRAM_CoOp": {"ctx": (4, 64)}, "UNIGRAM": {"ctx": (2, 64), "vpt": (1, 2, 64)}}
WORDS = "a photo of a"
SPEC = SPEC_ADAMW = TestTimeSpec(views=4, confident_share=0.5, steps=2, lr=0.05)
OPTS = [
    "TRAINER.GRAM.TEST_TIME.ENABLED",
    "True",
    "TRAINER.GRAM.TEST_TIME.VIEWS",
    str(SPEC.views),
    "TRAINER.GRAM.TEST_TIME.CONFIDENT_SHARE",
    str(SPEC.confident_share),
    "TRAINER.GRAM.TEST_TIME.STEPS",
    str(SPEC.steps),
    "TRAINER.GRAM.TEST_TIME.LR",
    str(SPEC.lr),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_clip):
    root = tmp_path_factory.mktemp("testtime_engines")
    clip, dims = tiny_clip
    inits = agreement_world(root, clip, dims, SHAPES)
    return root, {**inits, "GRAM_CoOp+prototypes": _with_prototypes(inits["GRAM_CoOp"], dims)}


def _with_prototypes(path, dims):
    """A copy of init file ``path`` whose R_φ reads a context (random context maps) and holds random prototypes."""
    from meta.finetune.init_io import export_gram_init, load_gram_init
    from meta.method.prototypes import Prototypes
    from meta.method.regulator import GradientRegulator, RegulatorSpec

    init, g = load_gram_init(path), torch.Generator().manual_seed(11)
    regs = {}
    for name, reg in init.regulator_modules().items():
        regs[name] = GradientRegulator(reg.dim, RegulatorSpec(**{**reg.spec.as_dict(), "context": 2}))
        extra = {
            k: torch.randn(v.shape, generator=g) * 0.5 for k, v in regs[name].state_dict().items() if "context" in k
        }
        regs[name].load_state_dict({**reg.state_dict(), **extra})
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, dims.embed_dim, generator=g), dim=1)  # noqa: E731
    protos = Prototypes(unit(3), unit(4), torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.2]))
    out = path.with_name("GRAM_CoOp_prototypes.safetensors")
    prov = init.metadata["provenance"]
    return export_gram_init(out, init.prompt_module(), regs, dims, provenance=prov, prototypes=protos.tensors())


def _dassl_logits(trainer) -> tuple[float, torch.Tensor]:
    """``(accuracy, logits [n, C])`` of one ``trainer.test()``, the logits caught as Dassl's evaluator gets them."""
    caught = []
    inference = trainer.model_inference

    def catch(images):
        out = inference(images)
        caught.append(out.detach().clone())
        return out

    trainer.model_inference = catch
    try:
        accuracy = trainer.test()
    finally:
        trainer.model_inference = inference
    return accuracy, torch.cat(caught)


@pytest.mark.parametrize(
    "key, optimizer, prototypes",
    [
        ("coop", "adamw", "none"),
        ("gram_coop", "adamw", "none"),
        ("unigram", "adamw", "none"),
        ("gram_coop", "meta", "none"),
        ("gram_coop", "meta", "nearest"),
    ],
)
def test_the_dassl_option_and_the_evaluator_give_the_same_predictions(
    world, tiny_clip, tmp_path, key, optimizer, prototypes
):
    root, inits = world
    row = methods.get(key)
    init = str(inits[row.trainer + ("+prototypes" if prototypes != "none" else "")]) if row.gram_file else ""
    opts = (["TRAINER.GRAM.INIT", init] if init else ["TRAINER.GRAM.CTX_INIT", WORDS]) + OPTS
    opts += ["TRAINER.GRAM.TEST_TIME.OPTIMIZER", optimizer]  # meta: the init file's step (its launch step is on)
    opts += ["TRAINER.GRAM.TEST_TIME.PROTOTYPES", prototypes]  # nearest: R_φ reads the file's prototypes
    SPEC = replace(SPEC_ADAMW, optimizer=optimizer, prototypes=prototypes)
    trainer, cfg = dassl_run(root, key, opts, "base", tmp_path / "base")
    assert trainer.gram.test_time == SPEC and (optimizer == "adamw" or trainer.launch_step is not None)
    trainer.train()  # one epoch; Dassl's final test already runs through the test-time path
    accuracy, logits = _dassl_logits(trainer)
    again, logits_again = _dassl_logits(trainer)
    assert torch.equal(logits, logits_again) and accuracy == again  # each test() restarts the views' generators
    theta = trainer.model.prompt_learner

    clip, dims = tiny_clip
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=trainer.gram.template)
    loader = ImageLoader(dims.image_size, (0.08, 1.0))
    images = torch.stack([loader.test_view(d.impath) for d in trainer.dm.dataset.test])
    regulation = trainer.regulation
    names, rule = trainer.dm.dataset.classnames, trainer.launch_step
    tuned = tune_and_predict(pclip, theta, images, names, SPEC, regulation, seed=SEED, rule=rule)
    torch.testing.assert_close(logits, tuned.logits, rtol=1e-4, atol=1e-4)  # the same prediction on each image
    if prototypes != "none":  # the prototypes reach the prediction: without them it differs
        plain_spec = replace(SPEC, prototypes="none")
        without = tune_and_predict(pclip, theta, images, names, plain_spec, regulation, seed=SEED, rule=rule)
        assert (without.logits - logits).abs().max() > 1e-5
    with torch.no_grad():
        plain = pclip.logits(theta, trainer.dm.dataset.classnames, images=images)
    assert (plain - logits).abs().max() > 1e-3  # the tuning changed the predictions: not a comparison of no-ops

    method = method_preset(row.preset, init_path=init, ctx_init=WORDS if not init else "")
    spec = evaluator_train_spec(cfg)
    dataset = DatasetRef.from_dir(root / "data" / "dtd")
    record = evaluate_base_to_new(
        dataset, clip, dims, method, SEED, SHOTS, spec, use_split_cache=False, log=lambda m: None, test_time=SPEC
    )
    tt = record["test_time"]
    assert record["base"] == pytest.approx(accuracy) and tt["sets"]["base"]["accuracy"] == record["base"]
    assert tt["regulated"] is bool(row.gram_file) and tt["spec"]["views"] == SPEC.views
    for row_ in tt["sets"].values():
        assert 0.0 <= row_["ece"] <= 100.0 and 0.0 <= row_["ece_before"] <= 100.0 and row_["seconds_per_image"] > 0
    # the plain numbers the record keeps are the run without test-time tuning
    plain_record = evaluate_base_to_new(
        dataset, clip, dims, method, SEED, SHOTS, spec, use_split_cache=False, log=lambda m: None
    )
    assert "test_time" not in plain_record
    assert tt["before"]["base"] == plain_record["base"] and tt["before"]["new"] == plain_record["new"]
    assert tt["sets"]["base"]["accuracy_before"] == plain_record["base"]


@pytest.mark.parametrize(
    "key, value",
    [("VIEWS", "0"), ("CONFIDENT_SHARE", "0.0"), ("STEPS", "-1"), ("LR", "0.0")],
)
def test_bad_dassl_test_time_settings_end_in_one_line_naming_the_key(world, tmp_path, key, value):
    root, _ = world
    opts = ["TRAINER.GRAM.CTX_INIT", WORDS, "TRAINER.GRAM.TEST_TIME.ENABLED", "True"]
    opts += [f"TRAINER.GRAM.TEST_TIME.{key}", value]
    with pytest.raises(ValueError, match=f"^TRAINER.GRAM.TEST_TIME.{key}: expected") as err:
        dassl_run(root, "coop", opts, "base", tmp_path / "bad")
    assert "\n" not in str(err.value)


def test_prototypes_asked_of_an_init_file_without_them_end_in_one_line_in_both_engines(world, tmp_path):
    root, inits = world
    opts = ["TRAINER.GRAM.INIT", str(inits["GRAM_CoOp"]), "TRAINER.GRAM.TEST_TIME.ENABLED", "True"]
    opts += ["TRAINER.GRAM.TEST_TIME.PROTOTYPES", "nearest"]
    wanted = "nearest: the init file holds no CHC prototypes"
    with pytest.raises(ValueError, match=f"^TRAINER.GRAM.TEST_TIME.PROTOTYPES {wanted}") as err:
        dassl_run(root, "gram_coop", opts, "base", tmp_path / "bad")
    assert "\n" not in str(err.value)
    flags = ["--methods", "gram_coop", "--init", str(inits["GRAM_CoOp"]), "--test-time"]
    done = _evaluator(root, *flags, "--test-time-prototypes", "nearest", "--output", str(tmp_path / "x.jsonl"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-1].startswith(f"error: --test-time-prototypes {wanted}"), done.stderr
    assert (tmp_path / "x.jsonl").read_text() == ""  # refused before any record


def _evaluator(root, *flags: str) -> subprocess.CompletedProcess:
    argv = ["base2new", "--dataset", str(root / "data" / "dtd"), "--model", "GRAM-Test-Tiny", "--seeds", "1"]
    argv += ["--shots", "2", "--epochs", "0", "--no-progress", "--no-split-cache", *flags]
    cmd = [sys.executable, "-m", "meta.evaluation", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})


def test_the_evaluator_command_writes_test_time_records_and_refuses_bad_flags(world, tmp_path):
    root, _ = world
    out = tmp_path / "tt.jsonl"
    flags = ["--methods", "coop", "--ctx-init", WORDS, "--test-time", "--test-time-views", "3", "--output", str(out)]
    done = _evaluator(root, *flags)
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    tt = record["test_time"]
    assert tt["spec"]["views"] == 3 and sorted(tt["sets"]) == ["base", "new"]
    assert record["new"] == tt["sets"]["new"]["accuracy"] and not record["trained"]
    cached = tmp_path / "cache.jsonl"  # zero-shot CLIP with TDA's caches: nothing tuned, a record all the same
    done = _evaluator(root, "--methods", "zsclip", "--test-time", "--test-time-adapt", "cache", "--output", str(cached))
    assert done.returncode == 0, done.stderr
    (record,) = [json.loads(line) for line in cached.read_text().splitlines()]
    tt = record["test_time"]
    assert tt["spec"]["adapt"] == "cache" and record["new"] == tt["sets"]["new"]["accuracy"]
    assert all(0.0 <= tt["sets"][s]["ece"] <= 100.0 and tt["sets"][s]["seconds_per_image"] > 0 for s in tt["sets"])
    for flags, wanted in [
        (["--methods", "coop", "--test-time", "--test-time-views", "0"], "--test-time-views: expected"),
        (["--methods", "coop", "--test-time", "--test-time-lr", "-1"], "--test-time-lr: expected"),
        (["--methods", "zsclip", "--test-time"], "--test-time: zero-shot CLIP has no prompts to tune"),
    ]:
        done = _evaluator(root, *flags)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and lines[-1].startswith(f"error: {wanted}"), done.stderr
