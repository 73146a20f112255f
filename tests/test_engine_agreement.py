"""``train.py``'s trainers and the standalone evaluator are one engine: same data, seed, init file and
transform give the same θ after one epoch and the same base and new accuracy (needs Dassl).

Both paths build θ, R_φ, the window and the launch step with ``meta.finetune.engine.build_start`` and step with
``meta.finetune.engine.RegulatedStepper``; what each keeps of its own is aligned here through real options:
the few-shot sample (Dassl's ``random`` draws = the evaluator's ``random.Random(seed)``), the batch order
(Dassl's ``SequentialSampler`` = ``TrainSpec(order="sequential")``), the transform (``INPUT.TRANSFORMS
["normalize"]`` on images already at the model's size = ``TrainSpec(augment="none")``) and the frozen CLIP
(one weights file).  The baseline starts from words (``CTX_INIT``), the GRAM rows from one init file
(θ*, R_φ, the support-size window of 4 images = 2 batches, and the launch step).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.dassl
pytest.importorskip("dassl", reason="Dassl not installed: the agreement test runs the Dassl trainers")

import torch  # noqa: E402
from helpers_dassl import PROVENANCE, SEED, SHOTS, agreement_world, dassl_run, evaluator_train_spec  # noqa: E402
from helpers_learner import KEY as TOY  # noqa: E402
from helpers_learner import RANK, low_rank_learner  # noqa: E402

from meta.evaluation import DatasetRef, evaluate_base_to_new, method_preset  # noqa: E402
from meta.finetune.init_io import export_gram_init  # noqa: E402
from meta.method import methods  # noqa: E402
from meta.method.prompts import PromptParams  # noqa: E402
from meta.method.regulator import GradientGate, GradientRegulator, RegulatorSpec  # noqa: E402

SHAPES = {"GRAM_CoOp": {"ctx": (4, 64)}, "UNIGRAM": {"ctx": (2, 64), "vpt": (1, 2, 64)}}
WORDS = "a photo of a"


@pytest.fixture(scope="module")
def toy_learner():
    """The low-rank-context learner of the tests (``helpers_learner``), registered while this module runs."""
    with low_rank_learner() as key:
        yield key


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_clip, toy_learner):
    """The dataset, the frozen CLIP's weights file and one GRAM init file per learner (the toy's under its key)."""
    root = tmp_path_factory.mktemp("agreement")
    clip, dims = tiny_clip
    inits = agreement_world(root, clip, dims, SHAPES)
    g = torch.Generator().manual_seed(6)  # the toy's and the gate's tensors
    tensors = {"ctx_factor": torch.randn(4, RANK, generator=g), "ctx_basis": torch.randn(RANK, 64, generator=g) * 0.02}
    regs = {k: GradientRegulator(t.shape[-1], RegulatorSpec(init="normal", init_std=0.2)) for k, t in tensors.items()}
    theta = PromptParams(toy_learner, **tensors)
    inits[toy_learner] = export_gram_init(root / "toy.safetensors", theta, regs, dims, provenance=PROVENANCE)
    # UNIGRAM with R_φ as a gate on the consistency terms' gradient (a non-trivial gate: random weights)
    tensors = {k: torch.randn(*s, generator=g) * 0.02 for k, s in SHAPES["UNIGRAM"].items()}
    gates = {k: GradientGate(64, RegulatorSpec(form="gate", init="normal", init_std=0.5)) for k in tensors}
    inits["UNIGRAM_gate"] = export_gram_init(
        root / "unigram_gate.safetensors", PromptParams(**tensors), gates, dims, provenance=PROVENANCE
    )
    return root, inits


CONSISTENCY = {"consistency_text": 8.0, "consistency_image": 10.0}  # KgCoOp's and PromptSRC's weights
CONSISTENCY_OPTS = ["TRAINER.GRAM.CONSISTENCY_TEXT", "8.0", "TRAINER.GRAM.CONSISTENCY_IMAGE", "10.0"]


@pytest.mark.parametrize(
    "key, opts, overrides, init_name",
    [
        ("coop", ["TRAINER.GRAM.CTX_INIT", WORDS], {}, None),
        ("gram_coop", [], {}, None),
        ("unigram", [], {}, None),
        ("unigram", CONSISTENCY_OPTS, CONSISTENCY, None),  # zero-shot consistency terms in both fine-tuning losses
        ("gram_coop", ["TRAINER.GRAM.LEARNER", TOY], {"learner": TOY}, TOY),  # a learner registered by the tests only
        ("unigram", CONSISTENCY_OPTS, CONSISTENCY, "UNIGRAM_gate"),  # R_φ gates the consistency terms' gradient
    ],
    ids=["coop", "gram_coop", "unigram", "unigram_consistency", "gram_coop_toy_learner", "unigram_gate"],
)
def test_train_py_and_the_evaluator_give_the_same_theta_and_accuracies(
    world, tiny_clip, tmp_path, key, opts, overrides, init_name
):
    root, inits = world
    row = methods.get(key)
    init = str(inits[init_name or row.trainer]) if row.gram_file else ""
    gram = ["TRAINER.GRAM.INIT", init] if init else []
    trainer, cfg = dassl_run(root, key, opts + gram, "base", tmp_path / "base")
    trainer.train()  # one epoch (launch step first for the GRAM rows), then the base test
    theta_dassl = {k: v.detach().clone() for k, v in trainer.model.prompt_learner.named_parameters()}
    base_dassl = trainer.test()
    new_trainer, _ = dassl_run(root, key, opts + gram, "new", tmp_path / "new")
    new_trainer.model.prompt_learner.load_state_dict(trainer.model.prompt_learner.state_dict())
    new_trainer.model.reset_cache()
    new_dassl = new_trainer.test()
    if row.gram_file:
        assert trainer.window.size == 2 and trainer.launch_step is not None  # 4 support images, batches of 2
        assert trainer.stepper.wants_parts == (init_name == "UNIGRAM_gate")

    clip, dims = tiny_clip
    method = method_preset(row.preset, init_path=init, ctx_init=WORDS if not init else "", **overrides)
    spec = evaluator_train_spec(cfg)
    dataset = DatasetRef.from_dir(root / "data" / "dtd")
    sample = dataset.load(SHOTS, SEED, "base", False, lambda msg: None).train  # the same images, in the same order
    assert [r.impath for r in sample] == [d.impath for d in trainer.dm.dataset.train_x]
    assert len(sample) == SHOTS * 2

    def evaluate(method_spec) -> tuple[dict, dict]:
        """The evaluator's record and the θ it trained (by name)."""
        trained: dict = {}
        out = evaluate_base_to_new(
            dataset,
            clip,
            dims,
            method_spec,
            SEED,
            SHOTS,
            spec,
            use_split_cache=False,
            log=lambda msg: None,
            on_trained=lambda p: trained.update(p.named_parameters()),
        )
        return out, trained

    record, kept = evaluate(method)
    if row.gram_file:
        assert record["init"]["reg_window"] == 4 and "launch" in record["init"]
    assert sorted(kept) == sorted(theta_dassl)
    start = dict(PromptParams.from_spec(method.prompt_spec(), clip, dims).named_parameters()) if not init else None
    for name, value in theta_dassl.items():
        torch.testing.assert_close(kept[name].detach(), value, rtol=1e-4, atol=1e-6)
        if start is not None:  # θ moved in the epoch: the comparison is not of two untouched starts
            assert (value - start[name].detach()).abs().max() > 1e-4
    assert (record["base"], record["new"]) == (pytest.approx(base_dassl), pytest.approx(new_dassl))
    if "consistency_text" in overrides:  # the terms changed the training: without them the evaluator ends at another θ
        assert trainer.model.consistency is not None
        if init_name == "UNIGRAM_gate":  # a gate without the regulariser it gates is refused, not run as θ* alone
            with pytest.raises(ValueError, match="CONSISTENCY_TEXT"):
                evaluate(method_preset(row.preset, init_path=init))
        else:
            _, plain = evaluate(method_preset(row.preset, init_path=init))
            assert max((plain[n].detach() - kept[n].detach()).abs().max() for n in kept) > 1e-5
