"""Initialisations of the visual prompt tokens (PromptSpec.vpt_init) and the switches that reach them."""

import pytest
import torch

from meta.evaluation import method_preset
from meta.evaluation.training import build_prompts
from meta.method.prompts import VPT_INITS, PromptParams, PromptSpec, initial_visual_prompts


def _vpt(clip, dims, how, depth=1, n=4, std=0.02, seed=0):
    spec = PromptSpec(n_ctx_text=0, n_ctx_vision=n, vision_depth=depth, init_std=std, vpt_init=how)
    return PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(seed)).vpt.detach()


@pytest.mark.parametrize("how", VPT_INITS)
@pytest.mark.parametrize("depth", [1, 2])
def test_every_init_has_the_prompt_shape(tiny_clip, how, depth):
    clip, dims = tiny_clip
    vpt = _vpt(clip, dims, how, depth=depth, n=3)
    assert vpt.shape == (depth, 3, dims.vision_width) and vpt.dtype == torch.float32
    assert torch.isfinite(vpt).all()


def test_normal_is_the_previous_draw(tiny_clip):
    """``normal`` draws exactly what the code drew before the switch existed (same seed, same numbers)."""
    clip, dims = tiny_clip
    expected = torch.randn(2, 4, dims.vision_width, generator=torch.Generator().manual_seed(3)) * 0.02
    torch.testing.assert_close(_vpt(clip, dims, "normal", depth=2, seed=3), expected, rtol=0, atol=0)


def test_zeros_and_cls_are_deterministic_and_built_from_the_frozen_tower(tiny_clip):
    clip, dims = tiny_clip
    visual = clip.visual
    assert torch.equal(_vpt(clip, dims, "zeros", seed=0), _vpt(clip, dims, "zeros", seed=1))
    assert not _vpt(clip, dims, "zeros").any()
    cls_token = (visual.class_embedding + visual.positional_embedding[0]).detach()
    exact = _vpt(clip, dims, "cls", depth=2, std=0.0, seed=0)
    assert torch.equal(exact, _vpt(clip, dims, "cls", depth=2, std=0.0, seed=5))
    torch.testing.assert_close(exact[0], cls_token.expand(4, -1))
    torch.testing.assert_close(exact[1], visual.ln_pre(cls_token).detach().expand(4, -1))  # deep: after ln_pre
    noisy = _vpt(clip, dims, "cls", std=0.02, seed=0)
    assert torch.equal(noisy, _vpt(clip, dims, "cls", std=0.02, seed=0))  # seeded
    spread = (noisy[0] - cls_token).std()
    assert 0.01 < float(spread) < 0.04  # N(0, 0.02²) around it
    patch = _vpt(clip, dims, "patch_mean", std=0.0)
    torch.testing.assert_close(patch[0], visual.positional_embedding[1:].mean(0).detach().expand(4, -1))


def test_unknown_init_is_refused_by_every_surface():
    with pytest.raises(ValueError, match="vpt_init"):
        PromptSpec(vpt_init="xavier")
    with pytest.raises(ValueError, match="vpt_init"):
        method_preset("vpt", vpt_init="xavier")
    with pytest.raises(ValueError, match="vpt_init"):
        initial_visual_prompts(torch.nn.Module(), "xavier", 1, 1, 0.02)


def test_the_evaluator_builds_the_requested_init_and_records_it(tiny_clip):
    clip, dims = tiny_clip
    prompts, _, info = build_prompts(method_preset("vpt", vpt_init="zeros"), clip, dims, seed=1)
    assert not prompts.vpt.any() and info["vpt_init"] == "zeros"
    _, _, info = build_prompts(method_preset("coop"), clip, dims, seed=1)
    assert info["vpt_init"] == ""  # no visual prompts: nothing to record


def test_a_run_saved_before_the_switch_resumes_only_with_the_init_it_used():
    """Runs saved before ``META.PROMPT.VPT_INIT`` existed drew N(0, σ²) tokens: resuming one under another
    init is a difference; without visual tokens the key changes nothing."""
    from meta.metatrain.cli import build_cfg
    from meta.metatrain.settings import cfg_differences, result_defining_cfg

    def saved_before_the_key(opts):
        old = result_defining_cfg(build_cfg(opts=opts))
        del old["META.PROMPT.VPT_INIT"]
        return old

    vpt = ["META.PROMPT.N_CTX_TEXT", "0", "META.PROMPT.N_CTX_VISION", "4"]
    old = saved_before_the_key(vpt)
    assert cfg_differences(old, result_defining_cfg(build_cfg(opts=vpt + ["META.PROMPT.VPT_INIT", "normal"]))) == []
    diffs = cfg_differences(old, result_defining_cfg(build_cfg(opts=vpt + ["META.PROMPT.VPT_INIT", "cls"])))
    assert diffs == ["META.PROMPT.VPT_INIT: '<absent>' -> 'cls'"]
    coop = saved_before_the_key([])
    assert cfg_differences(coop, result_defining_cfg(build_cfg(opts=["META.PROMPT.VPT_INIT", "cls"]))) == []
    with pytest.raises(ValueError, match="META.PROMPT.VPT_INIT"):
        from meta.metatrain.settings import check_meta_cfg

        cfg = build_cfg(opts=vpt)
        cfg.defrost()
        cfg.META.PROMPT.VPT_INIT = "xavier"
        check_meta_cfg(cfg)


def test_the_dassl_keys_and_the_evaluator_flag_reach_the_prompt_spec():
    from helpers import minimal_cfg

    from meta.evaluation import TrainSpec
    from meta.evaluation.cli import _methods, _parser, _train_spec
    from trainers.gram.config import gram_settings

    cfg = minimal_cfg("GRAM_VPT")
    assert gram_settings(cfg).vpt_init == PromptSpec.vpt_init
    cfg.TRAINER.GRAM.VPT_INIT = "cls"
    assert gram_settings(cfg).vpt_init == "cls"
    cfg.TRAINER.GRAM.VPT_INIT = "xavier"
    with pytest.raises(ValueError, match="TRAINER.GRAM.VPT_INIT"):
        gram_settings(cfg)
    args = _parser().parse_args(["base2new", "--dataset", "d", "--methods", "vpt", "joint", "--vpt-init", "zeros"])
    assert [m.vpt_init for m in _methods(args)] == ["zeros", "zeros"]
    args = _parser().parse_args(["base2new", "--dataset", "d", "--methods", "vpt"])
    assert _methods(args)[0].vpt_init == PromptSpec.vpt_init
    assert _train_spec(args).rrcrop_scale == TrainSpec().rrcrop_scale
    args = _parser().parse_args(["base2new", "--dataset", "d", "--rrcrop-scale", "0.5", "1"])
    assert _train_spec(args).rrcrop_scale == (0.5, 1.0)  # the demo's crop, for reproducing its runs
