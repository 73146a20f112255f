"""Deep text prompts (IVLP) and MaPLe's coupled visual prompts in the core.

The forwards are checked against a plain loop over open_clip's own resblocks written here (all 77
text positions, the blocks' own ``forward``), not against ``meta.model.text_encoder`` / ``meta.model.visual_encoder``
nor the MaPLe fork's code.  The tiny model has text width 64 != vision width 96, so a transposed
projection cannot pass.
"""

import json
import warnings

import open_clip
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.func import functional_call

from meta.finetune.init_io import InitMismatchError, export_gram_init, load_gram_init
from meta.method.gram import GRAMMetaLearner, MetaSpec, double_backward_attention
from meta.method.prompts import (
    PromptedCLIP,
    PromptParams,
    PromptSpec,
    classification_loss,
    initial_projections,
    visual_prompts,
)
from meta.method.regulator import RegulatorSpec
from meta.model.text_encoder import ClassTokenCache, encode_text_with_context

NAMES = ["red circle", "square", "a very long class name with many words"]
IVLP = dict(n_ctx_text=2, text_depth=2, n_ctx_vision=2, vision_depth=2, vpt_init="normal")
MAPLE = dict(n_ctx_text=2, text_depth=3, coupling="maple")


@pytest.fixture(scope="module")
def deep_clip():
    """A frozen CLIP with 3 text and 3 vision blocks, text width 64, vision width 96 (random weights)."""
    from meta.model.backbone import load_clip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return load_clip("GRAM-Test-Deep", pretrained=None)


def _theta(clip, dims, seed=1, **spec):
    return PromptParams.from_spec(PromptSpec(**spec), clip, dims, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- independent reference forwards
def _reference_text(clip, names, ctx, deep):
    """IVLP/MaPLe text side over all 77 positions: token 1..M = ctx; before block i < J they become deep[i-1]."""
    assert clip.transformer.batch_first
    m = ctx.shape[0]
    ids = open_clip.get_tokenizer("ViT-B-16")([" ".join(["X"] * m) + " " + n + "." for n in names])
    x = clip.token_embedding(ids)
    x = torch.cat([x[:, :1], ctx.expand(len(names), -1, -1), x[:, 1 + m :]], dim=1) + clip.positional_embedding
    for i, block in enumerate(clip.transformer.resblocks):
        if deep is not None and 1 <= i <= deep.shape[0]:
            x = torch.cat([x[:, :1], deep[i - 1].expand(len(names), -1, -1), x[:, 1 + m :]], dim=1)
        x = block(x, attn_mask=clip.attn_mask)
    x = clip.ln_final(x)
    return x[torch.arange(len(names)), ids.argmax(dim=-1)] @ clip.text_projection


def _reference_image(clip, images, layers):
    """Deep visual prompts: ``layers[0]`` appended before ln_pre, ``layers[i]`` replace the last n before block i."""
    v = clip.visual
    assert v.transformer.batch_first
    n = layers[0].shape[0]
    x = v.conv1(images).flatten(2).transpose(1, 2)
    x = torch.cat([v.class_embedding.expand(len(images), 1, -1), x], dim=1) + v.positional_embedding
    x = v.ln_pre(torch.cat([x, layers[0].expand(len(images), -1, -1)], dim=1))
    for i, block in enumerate(v.transformer.resblocks):
        if 1 <= i < len(layers):
            x = torch.cat([x[:, :-n], layers[i].expand(len(images), -1, -1)], dim=1)
        x = block(x)
    return v.ln_post(x[:, 0]) @ v.proj


def _maple_visual_layers(theta):
    """MaPLe's coupling written out: one linear map per layer, layer 0 from ctx, layer i from ctx_deep[i-1]."""
    texts = [theta.ctx] + ([] if theta.ctx_deep is None else list(theta.ctx_deep))
    return [F.linear(t, theta.proj_weight[i], theta.proj_bias[i]) for i, t in enumerate(texts)]


# ---------------------------------------------------------------- forward
def test_deep_text_prompts_match_reference_with_exact_truncation(deep_clip):
    clip, dims = deep_clip
    theta = _theta(clip, dims, **IVLP)
    assert theta.ctx.shape == (2, 64) and theta.ctx_deep.shape == (1, 2, 64)
    with torch.no_grad():
        theta.ctx_deep.mul_(50)  # large enough that ignoring or misplacing them shows
    tokens = ClassTokenCache(clip, 2, truncate=True).tokens(NAMES)
    assert tokens.length < 77  # the truncated path is the one compared
    ours = encode_text_with_context(clip, tokens, theta.ctx, theta.ctx_deep)
    ref = _reference_text(clip, NAMES, theta.ctx, theta.ctx_deep)
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6 * float(ref.detach().abs().max()))
    shallow = _reference_text(clip, NAMES, theta.ctx, None)
    assert (ours - shallow).abs().max() > 1e-2 * shallow.abs().max()  # the deep prompts matter


def test_ivlp_image_side_matches_reference(deep_clip):
    clip, dims = deep_clip
    theta = _theta(clip, dims, **IVLP)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    pclip = PromptedCLIP(clip, dims, 2)
    ours = pclip.image_features(theta, images)
    ref = F.normalize(_reference_image(clip, images, list(theta.vpt)), dim=-1)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_maple_coupled_visual_prompts_match_reference(deep_clip):
    clip, dims = deep_clip
    theta = _theta(clip, dims, **MAPLE)
    assert theta.vpt is None and theta.ctx_deep.shape == (2, 2, 64)
    assert theta.proj_weight.shape == (3, 96, 64) and theta.proj_bias.shape == (3, 96)
    layers = _maple_visual_layers(theta)
    torch.testing.assert_close(visual_prompts(theta), torch.stack(layers), rtol=1e-6, atol=1e-7)
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    logits = PromptedCLIP(clip, dims, 2).logits(theta, NAMES, images=images)
    img = F.normalize(_reference_image(clip, images, layers), dim=-1)
    txt = F.normalize(_reference_text(clip, NAMES, theta.ctx, theta.ctx_deep), dim=-1)
    torch.testing.assert_close(logits, clip.logit_scale.exp() * img @ txt.t(), rtol=1e-4, atol=1e-4)


def test_maple_projection_start_follows_nn_linear_and_clones():
    w, b = initial_projections(4, 64, 96, torch.Generator().manual_seed(0))
    assert w.shape == (4, 96, 64) and b.shape == (4, 96)
    bound = 1 / 64**0.5
    assert float(w.abs().max()) <= bound and float(b.abs().max()) <= bound and float(w.std()) > bound / 3
    assert torch.equal(w[1], w[2]) and torch.equal(w[1], w[3]) and torch.equal(b[1], b[3])  # deep copies
    assert not torch.equal(w[0], w[1])


def test_shallow_draws_unchanged_by_deep_options(deep_clip):
    clip, dims = deep_clip
    shallow = _theta(clip, dims, n_ctx_text=2, n_ctx_vision=2, vision_depth=2, vpt_init="normal")
    deep = _theta(clip, dims, **IVLP)
    assert torch.equal(shallow.ctx, deep.ctx) and torch.equal(shallow.vpt, deep.vpt)
    assert float(deep.ctx_deep.detach().std()) == pytest.approx(0.02, rel=0.5)


@pytest.mark.parametrize(
    "spec, why",
    [
        (dict(n_ctx_text=0, n_ctx_vision=2, text_depth=2), "need text context"),
        (dict(n_ctx_text=2, n_ctx_vision=2, coupling="maple"), "n_ctx_vision must be 0"),
        (dict(n_ctx_text=2, coupling="deep"), "coupling must be one of"),
        (dict(n_ctx_text=2, text_depth=-1), "text_depth and vision_depth must be >= 0"),
    ],
)
def test_bad_specs_raise(spec, why):
    with pytest.raises(ValueError, match=why):
        PromptSpec(**spec)


def test_text_depth_beyond_the_tower_raises(deep_clip):
    clip, dims = deep_clip
    with pytest.raises(ValueError, match="text_depth must be in 1..3"):
        _theta(clip, dims, n_ctx_text=2, text_depth=4)


# ---------------------------------------------------------------- gradients and meta-gradients
def _batch(seed, per_class=2):
    gen = torch.Generator().manual_seed(seed)
    return {
        "classnames": NAMES[:2],
        "images": torch.randn(2 * per_class, 3, 32, 32, generator=gen),
        "label": torch.arange(2).repeat(per_class),
    }


@pytest.mark.parametrize("spec", [IVLP, MAPLE], ids=["ivlp", "maple"])
def test_meta_gradient_matches_hand_written_second_order(deep_clip, spec):
    """θ' = θ − α R_φ(∇θ L_s(θ)) through GBML equals a hand-written computation, and every θ and φ tensor
    (MaPLe's projections included, every layer of the deep tensors) receives a meta-gradient."""
    clip, dims = deep_clip
    theta = _theta(clip, dims, **spec)
    ml = GRAMMetaLearner(theta, MetaSpec(inner_lr=0.5, regulator=RegulatorSpec()))
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(4))
    names = [n for n, _ in ml.prompt_module.named_parameters()]
    assert sorted(ml.regulators()) == sorted(names)  # one R_φ per prompt tensor
    pclip = PromptedCLIP(clip, dims, 2)
    loss_fn = classification_loss(pclip)
    support, query = _batch(5), _batch(6)

    ml.zero_grad()
    learner, _, _ = ml.adapt(loss_fn, support)
    loss_fn(learner.module, query)[0].backward()
    got_theta = {n: p.grad.clone() for n, p in ml.prompt_module.named_parameters()}
    got_phi = {(n, k): p.grad.clone() for n, r in ml.regulators().items() for k, p in r.named_parameters()}

    # hand-written: plain tensors, no GBML
    th = {n: p.detach().clone().requires_grad_(True) for n, p in ml.prompt_module.named_parameters()}
    regs = ml.regulators()
    phi = {n: {k: v.detach().clone().requires_grad_(True) for k, v in regs[n].named_parameters()} for n in names}

    class View:
        def __init__(self, d):
            self.__dict__.update({k: d.get(k) for k in ("ctx", "vpt", "ctx_deep", "proj_weight", "proj_bias")})

    def loss(params, batch):
        return F.cross_entropy(pclip.logits(View(params), batch["classnames"], images=batch["images"]), batch["label"])

    with double_backward_attention():
        grads = torch.autograd.grad(loss(th, support), [th[n] for n in names], create_graph=True)
    adapted = {n: th[n] - 0.5 * functional_call(regs[n], phi[n], (g,)) for n, g in zip(names, grads)}
    flat_phi = [(n, k, v) for n in names for k, v in phi[n].items()]
    out = torch.autograd.grad(loss(adapted, query), [th[n] for n in names] + [v for _, _, v in flat_phi])
    for n, g in zip(names, out[: len(names)]):
        torch.testing.assert_close(got_theta[n], g, rtol=1e-4, atol=1e-7)
        per_layer = got_theta[n].flatten(1).abs().sum(1) if got_theta[n].dim() == 3 else got_theta[n].abs().sum()[None]
        assert bool((per_layer > 0).all()), f"{n}: a layer gets no meta-gradient"
    for (n, k, _), g in zip(flat_phi, out[len(names) :]):
        torch.testing.assert_close(got_phi[(n, k)], g, rtol=1e-4, atol=1e-8)
        assert float(g.abs().sum()) > 0, f"regulator of {n}: {k} gets no meta-gradient"


# ---------------------------------------------------------------- init files
def _export(tmp_path, clip, dims, spec, name="init.safetensors"):
    theta = _theta(clip, dims, **spec)
    ml = GRAMMetaLearner(theta, MetaSpec())
    with torch.no_grad():
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(7))
    path = export_gram_init(tmp_path / name, ml.prompt_module, ml.regulators(), dims)
    return path, ml


@pytest.mark.parametrize("spec", [IVLP, MAPLE], ids=["ivlp", "maple"])
def test_init_file_round_trip(tmp_path, deep_clip, spec):
    clip, dims = deep_clip
    path, ml = _export(tmp_path, clip, dims, spec)
    structure = {
        "text_depth": spec["text_depth"],
        "coupling": spec.get("coupling", "none"),
        "n_ctx_text": 2,
        "n_ctx_vision": spec.get("n_ctx_vision", 0),
        "vision_depth": spec.get("vision_depth", 0) if spec.get("n_ctx_vision") else 0,
    }
    init = load_gram_init(path, expect={"text_width": 64, "vision_width": 96, **structure})
    assert {k: init.metadata["prompt"][k] for k in structure} == structure
    loaded = init.prompt_module()
    for name, p in ml.prompt_module.named_parameters():
        assert torch.equal(getattr(loaded, name), p.detach()), name
    regs = init.regulator_modules()
    assert sorted(regs) == sorted(ml.regulators())
    for name, reg in ml.regulators().items():
        for k, v in reg.state_dict().items():
            assert torch.equal(regs[name].state_dict()[k], v), (name, k)


def test_init_file_refuses_other_structure(tmp_path, deep_clip):
    clip, dims = deep_clip
    path, _ = _export(tmp_path, clip, dims, MAPLE)
    with pytest.raises(InitMismatchError) as err:
        load_gram_init(path, expect={"text_depth": 2, "coupling": "maple"}, config_key="TRAINER.GRAM.INIT")
    msg = str(err.value)
    assert "\n" not in msg and "text_depth: file has 3, model expects 2" in msg and "TRAINER.GRAM.INIT" in msg
    with pytest.raises(InitMismatchError, match="coupling: file has maple, model expects none"):
        load_gram_init(path, expect={"coupling": "none"})


def _rewrite(path, out, tensors=None, prompt_meta=None):
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["gram"])
    tensors = tensors if tensors is not None else load_file(str(path))
    meta["prompt"].update(prompt_meta or {})
    meta["shapes"] = {k: list(v.shape) for k, v in tensors.items()}
    save_file(tensors, str(out), metadata={"gram": json.dumps(meta)})
    return out


def test_init_file_tensor_and_structure_errors(tmp_path, deep_clip):
    clip, dims = deep_clip
    path, _ = _export(tmp_path, clip, dims, MAPLE)
    tensors = load_file(str(path))
    short = dict(tensors, **{"prompt.ctx_deep": tensors["prompt.ctx_deep"][:1]})
    with pytest.raises(
        InitMismatchError,
        match=r"tensor prompt.ctx_deep: has shape \[1, 2, 64\], but the "
        r"metadata's \[prompt.text_depth - 1",
    ):
        load_gram_init(_rewrite(path, tmp_path / "a.safetensors", short))
    no_proj = {k: v for k, v in tensors.items() if "proj_" not in k}
    with pytest.raises(InitMismatchError, match="tensor prompt.proj_weight: missing"):
        load_gram_init(_rewrite(path, tmp_path / "b.safetensors", no_proj))
    with pytest.raises(InitMismatchError, match="prompt.coupling: expected one of none, maple"):
        load_gram_init(_rewrite(path, tmp_path / "c.safetensors", prompt_meta={"coupling": "deep"}))
    with pytest.raises(InitMismatchError, match="prompt.text_depth: 9 exceeds backbone.text_layers 3"):
        load_gram_init(_rewrite(path, tmp_path / "d.safetensors", prompt_meta={"text_depth": 9}))


def test_files_without_deep_fields_read_as_shallow(tmp_path, tiny_clip):
    """A CoOp file written before text_depth/coupling existed loads with depth 1 and no coupling."""
    clip, dims = tiny_clip
    path, _ = _export(tmp_path, clip, dims, dict(n_ctx_text=4))
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["gram"])
    for key in ("text_depth", "coupling"):
        del meta["prompt"][key]
    del meta["backbone"]["text_layers"]
    old = tmp_path / "old.safetensors"
    save_file(load_file(str(path)), str(old), metadata={"gram": json.dumps(meta)})
    init = load_gram_init(old, expect={"text_depth": 1, "coupling": "none", "n_ctx_text": 4})
    assert init.prompt_module().ctx_deep is None
