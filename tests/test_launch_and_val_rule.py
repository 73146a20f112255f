"""The step launched at test time is the inner step that was meta-trained (weight decay, support split), and
downstream meta-validation fine-tunes every prompt tensor of the learner (IVLP's deep text prompts, MaPLe's
coupling), not only ``ctx`` / ``vpt``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meta.evaluation.spec import TrainSpec
from meta.finetune.engine import StartPoint, StartSpec, build_start
from meta.finetune.regulated import LaunchStep, launch_
from meta.method.prompts import PROMPT_TENSORS, PromptedCLIP, PromptParams, PromptSpec

NAMES = ["cat", "dog", "bird"]


def test_launch_step_carries_the_inner_weight_decay_and_support_split():
    meta = {"inner_lr": 0.1, "inner_steps": 2, "inner_momentum": 0.5, "inner_weight_decay": 0.01}
    step = LaunchStep.from_metadata({"provenance": {"meta": {**meta, "inner_support": "repeat"}}})
    assert step == LaunchStep(0.1, 2, 0.5, weight_decay=0.01)
    with pytest.raises(ValueError, match=r"f\.safetensors: .*inner_support split.*TRAINER.GRAM.LAUNCH"):
        LaunchStep.from_metadata({"provenance": {"meta": {**meta, "inner_support": "split"}}}, "f.safetensors")
    # one inner step: split and repeat are the same rule
    one = {**meta, "inner_steps": 1, "inner_support": "split"}
    assert LaunchStep.from_metadata({"provenance": {"meta": one}}).steps == 1


def test_launch_applies_weight_decay_as_the_inner_loop_does():
    """Two launched steps against the inner rule by hand: d = g + λθ, v = μ v + d, θ <- θ − α v."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(3, 4, generator=gen)
    prompts = PromptParams(ctx=torch.randn(3, 4, generator=gen))

    def mean_loss(p):
        return ((p.ctx - target) ** 2).sum()

    alpha, mu, wd = 0.1, 0.5, 0.2
    theta = prompts.ctx.detach().clone()
    d0 = 2 * (theta - target) + wd * theta
    theta1 = theta - alpha * d0
    d1 = 2 * (theta1 - target) + wd * theta1
    expected = theta1 - alpha * (mu * d0 + d1)
    launch_(prompts, None, mean_loss, LaunchStep(alpha, steps=2, momentum=mu, weight_decay=wd))
    torch.testing.assert_close(prompts.ctx.detach(), expected)


def _start_of(prompts: PromptParams, spec: PromptSpec, clip, dims):
    """The engine's start from an in-memory θ (what meta-validation builds from the live meta-learner)."""
    return build_start(StartSpec(prompt=spec), clip, dims, point=StartPoint(prompts))


def test_meta_validation_start_is_the_engines_view_of_the_val_keys():
    """META.VAL_REG_WINDOW / META.VAL_LAUNCH read once into a StartSpec; the launched step is read from the meta
    record by the same reader as an init file's provenance."""
    from meta.metatrain import settings
    from meta.method.gram import MetaSpec

    cfg = settings.get_meta_cfg_default()
    cfg.META.VAL_REG_WINDOW = 7
    cfg.META.VAL_LAUNCH = True
    view = settings.val_start_spec(cfg)
    assert (view.reg_window, view.launch, view.regulate, view.init_path) == (7, True, True, "")
    assert view.prompt == settings.prompt_spec(cfg)
    assert view.naming.full("reg_window") == "META.VAL_REG_WINDOW"
    cfg.META.MODE = "pretrain"
    assert not settings.val_start_spec(cfg).launch  # prompt pre-training meta-trains no inner step
    record = MetaSpec(inner_lr=0.3, inner_steps=2, inner_momentum=0.5, inner_weight_decay=0.01).as_dict()
    assert LaunchStep.from_meta_record(record) == LaunchStep(0.3, 2, 0.5, weight_decay=0.01)
    assert LaunchStep.from_meta_record(record) == LaunchStep.from_metadata({"provenance": {"meta": record}})


@pytest.mark.parametrize(
    "fields",
    [
        {"n_ctx_text": 2, "n_ctx_vision": 2, "text_depth": 0, "vision_depth": 0, "vpt_init": "normal"},  # IVLP
        {"n_ctx_text": 2, "n_ctx_vision": 0, "text_depth": 0, "coupling": "maple"},  # MaPLe
    ],
    ids=["ivlp", "maple"],
)
def test_downstream_validation_fine_tunes_every_prompt_tensor(tiny_clip, fields, monkeypatch):
    """The validation copy of θ holds the learner's tensors, and its score is the one of θ as a whole."""
    from meta.metatrain import downstream_val

    clip, dims = tiny_clip
    spec = PromptSpec(**fields)
    prompts = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(0))
    pclip = PromptedCLIP(clip, dims, prompts.n_ctx_text, template=spec.template)
    gen = torch.Generator().manual_seed(4)

    def mk(n):
        return {
            "classnames": NAMES,
            "label": torch.arange(3).repeat(n),
            "images": torch.randn(3 * n, 3, dims.image_size, dims.image_size, generator=gen),
        }

    support, query = mk(1), mk(2)
    seen = []
    real = downstream_val.PromptTuner

    def spy(pclip_, theta, *args, **kwargs):
        seen.append(theta)
        return real(pclip_, theta, *args, **kwargs)

    monkeypatch.setattr(downstream_val, "PromptTuner", spy)
    train = TrainSpec(epochs=1, batch_size=1, augment="none", aug_views=1, eval_every_epoch=False)
    downstream_val.downstream_accuracy(pclip, _start_of(prompts, spec, clip, dims), support, query, train, seed=1)
    (theta,) = seen
    for name in PROMPT_TENSORS:
        mine, theirs = getattr(prompts, name), getattr(theta, name)
        assert (mine is None) == (theirs is None), name
    # with no epochs to train, the score is θ's own query accuracy (all tensors used)
    zero = TrainSpec(epochs=0, batch_size=1, augment="none", aug_views=1, eval_every_epoch=False)
    acc = downstream_val.downstream_accuracy(pclip, _start_of(prompts, spec, clip, dims), support, query, zero, seed=1)
    with torch.no_grad():
        logits = pclip.logits(prompts, NAMES, images=query["images"])
    expected = 100.0 * float((logits.argmax(-1) == query["label"]).float().mean())
    assert acc == pytest.approx(expected)
    assert F is not None
