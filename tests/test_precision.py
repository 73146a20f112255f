"""Autocast keys: CPU fallback in one log line, and the second-order meta-gradient under autocast vs fp32.

Tolerance of the meta-gradient (θ and φ together, 2 tasks, second order, tiny CLIP): cosine to fp32
>= 0.99 and relative L2 error <= 0.2 under bf16; >= 0.999 and <= 0.03 under fp16.  Measured on CPU
with bf16 autocast over 5 seeds: relative error 0.047 mean / 0.079 max (CoOp), 0.063 / 0.101
(UNIGRAM), cosine >= 0.9976; fp16 (CoOp): 0.007 / 0.011.  bf16 keeps 8 mantissa bits, so errors of
a few per cent after the inner step's double backward are its expected size, not a bug.
"""

import logging
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meta.metatrain.outer import OuterStep
from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import RegulatorSpec
from meta.model import precision

NAMES = ["circle", "square", "triangle"]
SPECS = {
    "coop": PromptSpec(n_ctx_text=4),
    "unigram": PromptSpec(n_ctx_text=2, n_ctx_vision=2),
    # the deep prompt learners (IVLP: per-layer text and visual prompts; MaPLe: coupled by projections)
    "ivlp": PromptSpec(n_ctx_text=2, text_depth=2, n_ctx_vision=2, vision_depth=2, vpt_init="normal"),
    "maple": PromptSpec(n_ctx_text=2, text_depth=2, coupling="maple"),
}
# (min cosine, max relative L2 error).  bf16 keeps 8 significant bits: a relative error of 0.2 allows a cosine
# of about 0.98 (cos ≈ 1 − rel²/2), which the first CUDA run reached on UNIGRAM's second-order gradient (0.988).
TOL = {"bf16": (0.98, 0.2), "fp16": (0.999, 0.03)}
FP16_SCALE = 256.0  # GradScaler's first scale in these comparisons: 2^16 overflows the second-order fp16 backward


def _batch(n, size, gen, device):
    return {
        "classnames": NAMES,
        "label": torch.arange(3, device=device).repeat(n),
        "images": torch.randn(3 * n, 3, size, size, generator=gen).to(device),
    }


def _learner(clip, dims, spec, autocast, seed=0, lowp=False):
    gen = torch.Generator().manual_seed(seed)
    device = next(clip.parameters()).device
    prompts = PromptParams.from_spec(spec, clip, dims, generator=gen)
    meta = MetaSpec(inner_lr=0.5, autocast=autocast, regulator=RegulatorSpec(), support_attention_lowp=lowp)
    ml = GRAMMetaLearner(prompts, meta)
    with torch.no_grad():  # a non-identity regulator, so φ's gradient is exercised too
        for p in ml.gbml.compute_update.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return ml.to(device)


def _outer(ml):
    """The learner's outer step; under fp16 with a first scale that does not overflow (the default one does:
    NaN, a skipped step; see the test below)."""
    outer = OuterStep(ml)
    if outer.scaler is not None:
        outer.scaler = torch.amp.GradScaler("cuda", init_scale=FP16_SCALE)
    return outer


def _meta_grad(clip, dims, spec, autocast, seed=0, lowp=False):
    """Flat ∇(θ, φ) of the 2-task meta-batch loss (unscaled under fp16); ``lowp``: ``META.SUPPORT_ATTENTION_LOWP``."""
    device = next(clip.parameters()).device
    ml = _learner(clip, dims, spec, autocast, seed, lowp)
    gen = torch.Generator().manual_seed(100 + seed)
    tasks = [
        TaskBatch(_batch(2, dims.image_size, gen, device), _batch(3, dims.image_size, gen, device)) for _ in range(2)
    ]
    outer = _outer(ml)
    loss_fn = classification_loss(PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text))
    ml.accumulate(tasks, loss_fn, backward=outer.backward)
    scale = outer.scaler.get_scale() if outer.scaler is not None else 1.0
    return torch.cat([p.grad.flatten() for p in outer.params()]).float() / scale


def _compare(clip, dims, kind, mode, lowp=False):
    ref = _meta_grad(clip, dims, SPECS[kind], "none")
    got = _meta_grad(clip, dims, SPECS[kind], mode, lowp=lowp)
    cos = float(F.cosine_similarity(ref, got, dim=0))
    rel = float((got - ref).norm() / ref.norm())
    min_cos, max_rel = TOL[mode]
    assert torch.isfinite(got).all()
    assert cos >= min_cos and rel <= max_rel, (kind, mode, cos, rel)
    assert rel > 0  # autocast really ran in lower precision
    return cos, rel


# ----------------------------------------------------------------------------- CPU
def test_cpu_falls_back_to_fp32_in_one_log_line(caplog):
    precision._said.clear()
    with caplog.at_level(logging.WARNING, logger="meta.model.precision"):
        for _ in range(3):
            assert precision.resolve_autocast("fp16", "cpu", "META.AUTOCAST") == "none"
            assert precision.resolve_weights("fp16", "cpu") == "fp32"
        assert precision.resolve_autocast("none", "cpu", "META.AUTOCAST") == "none"
        assert precision.resolve_weights("bf16", "cpu") == "bf16"
        assert precision.resolve_autocast("bf16", "cuda:0", "META.AUTOCAST") == "bf16"
    lines = [r.getMessage() for r in caplog.records if r.name == "meta.model.precision"]
    assert lines == [
        "META.AUTOCAST fp16: no CUDA device (cpu); running fp32",
        "MODEL.PRECISION fp16: no CUDA device (cpu); running fp32",
    ]
    with pytest.raises(ValueError, match="CHC.IMAGES.AUTOCAST: expected none | bf16 | fp16, got 'fp8'"):
        precision.resolve_autocast("fp8", "cpu", "CHC.IMAGES.AUTOCAST")


@pytest.fixture
def tf32_flag():
    """The process's CUDA matmul TF32 flag, off for the test and restored after it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_the_tf32_key_sets_cudas_matmul_flag_and_keeps_fp32_on_a_cpu(caplog, tf32_flag):
    from meta.config import get_meta_cfg_default
    from meta.model.clip_config import clip_from_cfg

    precision._said.clear()
    assert precision.apply_tf32(True, "cuda:0") is True and torch.backends.cuda.matmul.allow_tf32
    assert precision.apply_tf32(False, "cuda") is False and not torch.backends.cuda.matmul.allow_tf32
    with caplog.at_level(logging.WARNING, logger="meta.model.precision"):
        cfg = get_meta_cfg_default()
        cfg.MODEL.BACKBONE, cfg.MODEL.TF32 = "GRAM-Test-Tiny", True
        clip_from_cfg(cfg, "cpu", warn_random=False)  # the builder every command uses applies the key
        clip_from_cfg(cfg, "cpu", warn_random=False)
    assert not torch.backends.cuda.matmul.allow_tf32  # a CPU run leaves the process's CUDA flag alone
    lines = [r.getMessage() for r in caplog.records if r.name == "meta.model.precision"]
    assert lines == ["MODEL.TF32 True: TF32 is a CUDA feature; this CPU run keeps full fp32 matmuls"]
    with pytest.raises(ValueError, match="^MODEL.TF32: expected True or False, got 'yes'$"):
        precision.apply_tf32("yes", "cuda")


def test_meta_config_key_resolves_per_device():
    from meta.metatrain import build_cfg
    from meta.metatrain.settings import check_meta_cfg, meta_spec

    cfg = build_cfg(opts=["META.AUTOCAST", "fp16"])
    assert meta_spec(cfg, "cpu").autocast == "none" and meta_spec(cfg, "cuda:0").autocast == "fp16"
    assert meta_spec(cfg).autocast == "fp16"  # as configured (export provenance)
    with pytest.raises(ValueError, match="META.AUTOCAST"):
        check_meta_cfg(build_cfg(opts=["META.AUTOCAST", "half"]))


@pytest.mark.parametrize("lowp", [False, True], ids=["", "support_attention_lowp"])
@pytest.mark.parametrize("kind", ["coop", "unigram"])
def test_bf16_autocast_meta_gradient_close_to_fp32_on_cpu(tiny_clip, kind, lowp):
    """The learner's autocast path itself (CPU bf16 autocast), within the tolerance stated above; also with the
    support pass's attention products in bf16 (``META.SUPPORT_ATTENTION_LOWP``)."""
    clip, dims = tiny_clip
    _compare(clip, dims, kind, "bf16", lowp)


@pytest.mark.parametrize("kind", list(SPECS))
def test_fp16_weights_give_fp32_features_and_gradients(kind):
    """open_clip's fp16 weights (PREC fp16) keep embeddings fp32; the prompted towers must cast to the blocks'
    dtype.  Same weights in fp32 and fp16 (CPU half kernels): features and ∇θ agree to fp16 precision."""
    from meta.model.backbone import load_clip

    towers = {}
    for prec in ("fp32", "fp16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            towers[prec] = load_clip("GRAM-Test-Tiny", None, device="cpu", precision=prec)
    clip, dims = towers["fp16"]
    assert clip.transformer.resblocks[0].mlp.c_fc.weight.dtype == torch.float16
    images = torch.randn(4, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(1))
    out = {}
    for prec, (model, _) in towers.items():
        theta = PromptParams.from_spec(SPECS[kind], model, dims, generator=torch.Generator().manual_seed(0))
        pclip = PromptedCLIP(model, dims, theta.n_ctx_text, template=SPECS[kind].template)
        text = pclip.text_features(theta, NAMES)
        image = pclip.image_features(theta, images.to(model.visual.conv1.weight.dtype))
        logits = image.float() @ text.float().t()
        grads = torch.autograd.grad(F.cross_entropy(logits * 10, torch.tensor([0, 1, 2, 0])), list(theta.parameters()))
        assert all(p.dtype == torch.float32 for p in theta.parameters())  # θ stays fp32
        out[prec] = (text.float(), image.float(), torch.cat([g.flatten() for g in grads]))
    for ref, got in zip(out["fp32"], out["fp16"]):
        assert torch.isfinite(got).all()
        assert float((got.detach() - ref.detach()).norm() / ref.detach().norm()) < 0.02, (
            kind
        )  # fp16: 11 significant bits


# ----------------------------------------------------------------------------- CUDA
@pytest.fixture(scope="module")
def cuda_clip():
    from meta.model.backbone import load_clip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return load_clip("GRAM-Test-Tiny", None, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("lowp", [False, True], ids=["", "support_attention_lowp"])
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_cuda_autocast_meta_gradient_close_to_fp32(cuda_clip, kind, mode, lowp):
    clip, dims = cuda_clip
    cos, rel = _compare(clip, dims, kind, mode, lowp)
    print(f"{kind} {mode} support_attention_lowp={lowp}: cosine {cos:.5f} relative error {rel:.4f}")


@pytest.mark.gpu
def test_cuda_fp16_meta_step_scales_steps_and_resumes(cuda_clip):
    clip, dims = cuda_clip
    ml = _learner(clip, dims, SPECS["unigram"], "fp16")
    outer = OuterStep(ml)  # the default first scale: overflows are skipped, then it backs off
    assert outer.scaler is not None and outer.scaler.is_enabled()
    gen = torch.Generator().manual_seed(3)
    tasks = [TaskBatch(_batch(2, dims.image_size, gen, "cuda"), _batch(3, dims.image_size, gen, "cuda"))]
    loss_fn = classification_loss(PromptedCLIP(clip, dims, ml.prompt_module.n_ctx_text))
    before = [p.detach().clone() for p in ml.prompt_module.parameters()]
    for _ in range(3):
        out = outer.meta_step(tasks, loss_fn)
    assert outer.skipped_steps < 3 and np.isfinite(out["query_loss_after"])  # an early overflow may skip one
    assert any(not torch.equal(b, p) for b, p in zip(before, ml.prompt_module.parameters()))
    state = {**ml.state(), **outer.state()}  # what a meta-training checkpoint holds under "learner"
    assert state["scaler"]["scale"] > 0
    again = _learner(clip, dims, SPECS["unigram"], "fp16")
    again.load_state(state)
    again_outer = OuterStep(again)
    again_outer.load_state(state)
    assert again_outer.scaler.get_scale() == outer.scaler.get_scale()
    for a, b in zip(again.prompt_module.parameters(), ml.prompt_module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_cuda_chc_image_features_under_autocast(cuda_clip, mode):
    from meta.chc.imaging import CLIP_MEAN, CLIP_STD, encode_images

    clip, dims = cuda_clip
    pixels = np.random.default_rng(0).integers(0, 256, (16, dims.image_size, dims.image_size, 3), dtype=np.uint8)
    ref = encode_images(clip, pixels, CLIP_MEAN, CLIP_STD, device="cuda")
    with precision.autocast(mode, "cuda"):
        got = encode_images(clip, pixels, CLIP_MEAN, CLIP_STD, device="cuda")
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert (ref * got).sum(-1).min() >= 0.99  # both L2-normalised


def test_run_checkpointed_before_the_key_existed_still_resumes():
    from meta.metatrain import build_cfg
    from meta.metatrain.settings import cfg_differences, result_defining_cfg

    old = result_defining_cfg(build_cfg())
    del old["META.AUTOCAST"]  # a checkpoint written before the key existed
    assert cfg_differences(old, result_defining_cfg(build_cfg())) == []
    assert cfg_differences(old, result_defining_cfg(build_cfg(opts=["META.AUTOCAST", "bf16"]))) == [
        "META.AUTOCAST: '<absent>' -> 'bf16'"
    ]


@pytest.mark.parametrize("vpt_init,std", [("normal", 0.02), ("zeros", 0.0)])
def test_fp16_autocast_second_order_through_ln_pre_is_finite(tiny_clip, vpt_init, std):
    """Visual prompts of small spread under fp16 autocast (CPU): the meta-gradient is finite and near fp32.

    Before ``meta.model.visual_encoder._ln_pre`` ran ``ln_pre`` in float32 outside autocast, the double backward of
    open_clip's LayerNorm there returned NaN (θ's visual and then text gradient; both cases here, and ViT-B/16
    UNIGRAM at its default init).  Measured after the change, seeds 0-3: relative error 0.004-0.057, cosine
    >= 0.9996 (seed 0, tested: 0.010 and 0.008).
    """
    clip, dims = tiny_clip
    spec = PromptSpec(n_ctx_text=2, n_ctx_vision=2, init_std=std, vpt_init=vpt_init)
    ref = _meta_grad(clip, dims, spec, "none")
    got = _meta_grad(clip, dims, spec, "fp16")
    assert torch.isfinite(got).all()
    rel = float((got - ref).norm() / ref.norm())
    assert float(F.cosine_similarity(ref, got, dim=0)) >= 0.999 and 0 < rel <= 0.05, rel
