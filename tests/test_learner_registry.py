"""Adding a prompt learner is one class and one registration (:mod:`meta.method.learners`): a learner that exists only
in the tests (``tests/helpers_learner.py``: text context ``ctx_factor [M, r] @ ctx_basis [r, d_t]``, tensor names and
shapes no built-in learner has) prompts the towers, meta-trains in both task loops with one R_φ per tensor, and travels
through an init file.  The evaluator and the Dassl trainer run it in ``tests/test_engine_agreement.py``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers_learner import RANK, low_rank_learner

from meta.finetune.engine import init_expectations
from meta.finetune.init_io import InitMismatchError, export_gram_init, load_gram_init
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch, double_backward_attention
from meta.method.learners import get_learner, learner_keys
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

NAMES = ["apple", "boat", "cat"]
INNER_LR = 0.5


@pytest.fixture
def toy():
    with low_rank_learner() as key:
        yield key


def _tasks(dims, n_tasks: int = 2) -> list[TaskBatch]:
    gen = torch.Generator().manual_seed(3)

    def part(shots: int) -> dict:
        feats = F.normalize(torch.randn(len(NAMES) * shots, dims.embed_dim, generator=gen), dim=-1)
        return {"classnames": NAMES, "features": feats, "label": torch.arange(len(NAMES)).repeat(shots)}

    return [TaskBatch(part(1), part(2)) for _ in range(n_tasks)]


def _theta(toy, clip, dims) -> tuple[PromptSpec, PromptParams]:
    spec = PromptSpec(n_ctx_text=4, learner=toy)
    return spec, PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))


def test_the_toy_prompts_the_text_tower_with_the_product_of_its_factors(tiny_clip, toy):
    clip, dims = tiny_clip
    _, theta = _theta(toy, clip, dims)
    assert toy in learner_keys() and theta.learner == toy
    assert [n for n, _ in theta.named_parameters()] == ["ctx_factor", "ctx_basis"]
    assert tuple(theta.ctx_factor.shape) == (4, RANK) and tuple(theta.ctx_basis.shape) == (RANK, dims.text_width)
    assert theta.n_ctx_text == 4 and theta.structure()["rank"] == RANK
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    got = pclip.text_features(theta, NAMES)
    # independent: the built-in learner handed the product as its context
    product = PromptParams(ctx=(theta.ctx_factor @ theta.ctx_basis).detach())
    torch.testing.assert_close(got, pclip.text_features(product, NAMES))
    with pytest.raises(ValueError, match="ranks differ"):
        PromptParams(toy, ctx_factor=torch.randn(4, 3), ctx_basis=torch.randn(2, dims.text_width))
    with pytest.raises(ValueError, match="unknown ctx"):
        PromptParams(toy, ctx=torch.randn(4, dims.text_width))
    with pytest.raises(ValueError, match="unknown prompt learner 'no_such'"):
        get_learner("no_such")


def test_meta_gradient_of_the_toy_matches_a_hand_unrolled_second_order_step(tiny_clip, toy):
    """Sequential loop, R_φ at its identity start: ∇_θ (1/B) Σ_b L_q(θ − α ∇L_s(θ)) by hand, on the two factors."""
    clip, dims = tiny_clip
    _, theta = _theta(toy, clip, dims)
    tasks = _tasks(dims)
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text)
    ml = GRAMMetaLearner(copy.deepcopy(theta), MetaSpec(inner_lr=INNER_LR, task_batching="off"))
    assert {n: r.dim for n, r in ml.regulators().items()} == {"ctx_factor": RANK, "ctx_basis": dims.text_width}
    ml.accumulate(tasks, classification_loss(pclip))
    got = {n: p.grad for n, p in ml.prompt_module.named_parameters()}

    f, b = (p.detach().clone().requires_grad_() for p in (theta.ctx_factor, theta.ctx_basis))

    def loss(f: torch.Tensor, b: torch.Tensor, batch: dict) -> torch.Tensor:
        view = SimpleNamespace(ctx=f @ b)  # read as the built-in learner's context
        logits = pclip.logits(view, batch["classnames"], image_features=batch["features"])
        return F.cross_entropy(logits, batch["label"])

    total = torch.zeros(())
    for task in tasks:
        with double_backward_attention():
            g_f, g_b = torch.autograd.grad(loss(f, b, task.support), [f, b], create_graph=True)
        total = total + loss(f - INNER_LR * g_f, b - INNER_LR * g_b, task.query) / len(tasks)
    want = dict(zip(["ctx_factor", "ctx_basis"], torch.autograd.grad(total, [f, b])))
    for name in want:
        assert want[name].abs().max() > 0
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7)


def test_the_stacked_task_loop_runs_the_toy_and_agrees_with_the_sequential_one(tiny_clip, toy):
    clip, dims = tiny_clip
    _, theta = _theta(toy, clip, dims)
    tasks = _tasks(dims, 3)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text))
    grads = {}
    for loop in ("off", "on"):
        torch.manual_seed(4)  # R_φ's normal start draws from the global RNG: the same φ for both loops
        spec = MetaSpec(inner_lr=INNER_LR, task_batching=loop)
        spec.regulator.init, spec.regulator.init_std = "normal", 0.2
        ml = GRAMMetaLearner(copy.deepcopy(theta), spec)
        if loop == "on":
            assert (
                ml.task_batching.accumulate(ml, tasks, loss_fn) is not None
            )  # the stacked pass ran (not the fallback)
        else:
            ml.accumulate(tasks, loss_fn)
        grads[loop] = {n: p.grad.clone() for n, p in ml.named_parameters() if p.grad is not None}
    assert sorted(grads["on"]) == sorted(grads["off"]) and len(grads["off"]) == 2 + 2 * 4  # θ: 2, R_φ: 2 x 4
    for name, g in grads["off"].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads["on"][name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


def test_init_file_round_trip_and_refusals_name_the_learner(tmp_path, tiny_clip):
    with low_rank_learner() as toy:
        clip, dims = tiny_clip
        spec, theta = _theta(toy, clip, dims)
        ml = GRAMMetaLearner(theta, MetaSpec(inner_lr=INNER_LR))
        path = export_gram_init(tmp_path / "toy.safetensors", ml.prompt_module, ml.regulators(), dims)
        init = load_gram_init(path, expect=init_expectations(spec, dims))
        assert init.metadata["prompt"]["learner"] == toy and init.metadata["prompt"]["rank"] == RANK
        loaded = init.prompt_module()
        assert loaded.learner == toy
        for name, p in ml.prompt_module.named_parameters():
            assert torch.equal(getattr(loaded, name), p.detach())
        assert {n: r.dim for n, r in init.regulator_modules().items()} == {"ctx_factor": RANK, "ctx_basis": 64}
        with pytest.raises(InitMismatchError, match="n_ctx_text: file has 4, model expects 5"):
            load_gram_init(path, expect=init_expectations(PromptSpec(n_ctx_text=5, learner=toy), dims))
        with pytest.raises(InitMismatchError, match="learner: file has"):
            load_gram_init(path, expect=init_expectations(PromptSpec(n_ctx_text=4), dims) | {"learner": "clip"})
    with pytest.raises(InitMismatchError, match="prompt.learner: expected one of the registered prompt learners"):
        load_gram_init(path)  # the learner is gone: the file is refused by name, not half-read


def test_meta_training_exports_the_toy_and_its_checkpoint_rebuilds_it(tmp_path):
    """``META.PROMPT.LEARNER`` names the toy: the trainer meta-trains it, exports its init file (no CoOp context
    file: it holds no ``ctx``), and the checkpoint rebuilds the same θ* (the path of ``python -m meta export``)."""
    from helpers_metatrain import BASE, colour_hierarchy

    from meta.metatrain import build_cfg
    from meta.metatrain.checkpoint import CHECKPOINT_NAME, load_checkpoint
    from meta.metatrain.export import learner_from_state
    from meta.metatrain.trainer import train

    opts = BASE + ["META.STEPS", "2", "META.PROMPT.N_CTX_TEXT", "4"]
    with low_rank_learner() as toy:
        cfg = build_cfg(opts=opts + ["META.PROMPT.LEARNER", toy], output_dir=str(tmp_path / "run"))
        result = train(cfg, hierarchy=colour_hierarchy(), echo=lambda _msg: None)
        init = load_gram_init(result["export"]["init"])
        assert init.metadata["prompt"]["learner"] == toy and sorted(init.prompt) == ["ctx_basis", "ctx_factor"]
        assert result["export"]["coop_ctx"] is None
        rebuilt, _ = learner_from_state(load_checkpoint(tmp_path / "run" / CHECKPOINT_NAME))
        assert rebuilt.prompt_module.learner == toy
        for name, p in rebuilt.prompt_module.named_parameters():
            assert torch.equal(p.detach(), init.prompt[name])
        assert result["step"] == 2
    with pytest.raises(ValueError, match="META.PROMPT.LEARNER: expected a registered prompt learner"):
        train(build_cfg(opts=opts + ["META.PROMPT.LEARNER", toy], output_dir=str(tmp_path / "gone")))


def test_learner_modules_keys_import_a_users_module_so_the_command_line_finds_its_learner(tmp_path, monkeypatch):
    """``META.PROMPT.LEARNER_MODULES`` imports a module that registers a learner at import, before the learner key is
    checked; a module that cannot be imported is one error naming the key (the Dassl key: test_trainers_config)."""
    from meta.metatrain import build_cfg, settings
    from meta.method.learners import unregister_learner

    (tmp_path / "user_learners_for_test.py").write_text(
        "from helpers_learner import LowRankContext\n"
        "from meta.method.learners import register_learner\n\n"
        "class Plugged(LowRankContext):\n"
        "    key = 'plugged_by_module'\n\n"
        "register_learner(Plugged())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    named = ["META.PROMPT.LEARNER", "plugged_by_module"]
    with pytest.raises(ValueError, match="META.PROMPT.LEARNER"):
        settings.check_meta_cfg(build_cfg(opts=named, output_dir=str(tmp_path / "a")))
    with pytest.raises(ValueError, match="META.PROMPT.LEARNER_MODULES: cannot import 'no_such_module_here'"):
        settings.check_meta_cfg(
            build_cfg(opts=[*named, "META.PROMPT.LEARNER_MODULES", "['no_such_module_here']"], output_dir=str(tmp_path))
        )
    try:
        cfg = build_cfg(
            opts=[*named, "META.PROMPT.LEARNER_MODULES", "['user_learners_for_test']"], output_dir=str(tmp_path)
        )
        settings.check_meta_cfg(cfg)
        assert "plugged_by_module" in learner_keys() and settings.prompt_spec(cfg).learner == "plugged_by_module"
    finally:
        unregister_learner("plugged_by_module")
