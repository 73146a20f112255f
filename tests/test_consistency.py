"""The zero-shot consistency terms (meta.method.consistency) against computations written from their definitions.

The references use open_clip's own ``encode_text`` / ``encode_image`` on the tiny CLIP (not this project's
encoders) and numpy for the two terms; the loss with both weights 0 is the plain cross-entropy bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F

from meta.evaluation.spec import method_preset
from meta.method.consistency import ConsistencySpec, image_consistency, text_consistency
from meta.method.prompts import DEFAULT_TEMPLATE, PromptedCLIP, PromptParams, PromptSpec, classification_loss

NAMES = ["cat", "dog", "bird"]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_terms_match_their_definitions():
    rng = np.random.default_rng(0)
    a, b = _unit(rng.normal(size=(5, 8))), _unit(rng.normal(size=(5, 8)))
    cos = [float(a[k] @ b[k]) for k in range(5)]
    expected_text = 1.0 - sum(cos) / 5
    got = text_consistency(torch.from_numpy(a), torch.from_numpy(b))
    assert math.isclose(float(got), expected_text, rel_tol=1e-12)
    expected_image = float(np.abs(a - b).sum() / a.size)
    assert math.isclose(
        float(image_consistency(torch.from_numpy(a), torch.from_numpy(b))), expected_image, rel_tol=1e-12
    )
    assert float(text_consistency(torch.from_numpy(a), torch.from_numpy(a))) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_weights_are_refused(bad):
    with pytest.raises(ValueError, match="text_weight: expected a finite number >= 0"):
        ConsistencySpec(text_weight=bad)
    with pytest.raises(ValueError, match=r"MethodSpec 'CoOp': consistency image_weight"):
        method_preset("coop", consistency_image=bad)


def _setup(tiny_clip, **fields):
    clip, dims = tiny_clip
    spec = PromptSpec(**fields)
    prompts = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # θ away from the zero-shot start, so both terms are clearly non-zero
        for p in prompts.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    pclip = PromptedCLIP(clip, dims, prompts.n_ctx_text, template=spec.template)
    gen = torch.Generator().manual_seed(5)
    batch = {
        "classnames": NAMES,
        "label": torch.tensor([0, 1, 2, 1]),
        "images": torch.randn(4, 3, dims.image_size, dims.image_size, generator=gen),
    }
    return clip, prompts, pclip, batch


def _open_clip_reference(clip, pclip, prompts, batch, lam_t, lam_v):
    """CE + λ_t (1 − mean cos(text, zero-shot text)) + λ_v mean|f − f⁰|, with f⁰ and the zero-shot text from
    open_clip's own encoders."""
    with torch.no_grad():
        tokens = open_clip.tokenize([DEFAULT_TEMPLATE.format(c) for c in batch["classnames"]])
        zs_text = F.normalize(clip.encode_text(tokens), dim=-1).double().numpy()
        frozen = F.normalize(clip.encode_image(batch["images"]), dim=-1).double().numpy()
        text = pclip.text_features(prompts, batch["classnames"]).double().numpy()
        image = pclip.image_features(prompts, batch["images"]).double().numpy()
    logits = pclip.logit_scale * image @ text.T
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    ce = -float(np.mean(logp[np.arange(len(logits)), batch["label"].numpy()]))
    text_term = 1.0 - float(np.mean(np.sum(text * zs_text, axis=1)))
    image_term = float(np.mean(np.abs(image - frozen)))
    return ce + lam_t * text_term + lam_v * image_term, text_term, image_term


@pytest.mark.parametrize(
    "fields",
    [{"n_ctx_text": 2, "n_ctx_vision": 2}, {"n_ctx_text": 4}],
    ids=["unigram", "coop"],
)
def test_regularised_loss_matches_an_open_clip_reference(tiny_clip, fields):
    clip, prompts, pclip, batch = _setup(tiny_clip, **fields)
    lam_t, lam_v = 8.0, 10.0
    visual = "n_ctx_vision" in fields
    expected, text_term, image_term = _open_clip_reference(clip, pclip, prompts, batch, lam_t, lam_v)
    if not visual:  # text-only prompts train on cached image features: f = f⁰, no image term
        with torch.no_grad():
            features = pclip.image_features(None, batch["images"])
        batch = {"classnames": batch["classnames"], "label": batch["label"], "features": features}
        assert image_term == pytest.approx(0.0, abs=1e-6)
    else:
        assert image_term > 1e-4  # random tiny CLIP: the prompts move image features a little
    assert text_term > 0.01
    loss, logits = classification_loss(pclip, ConsistencySpec(lam_t, lam_v))(prompts, batch)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-5)
    plain, plain_logits = classification_loss(pclip)(prompts, batch)
    assert torch.equal(logits, plain_logits)
    assert float(loss) > float(plain) + 0.05
    grads = torch.autograd.grad(loss, list(prompts.parameters()))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_zero_weights_give_the_plain_loss_bit_for_bit_and_vpt_has_no_text_term(tiny_clip):
    clip, prompts, pclip, batch = _setup(tiny_clip, n_ctx_text=2, n_ctx_vision=2)
    off = classification_loss(pclip, ConsistencySpec())
    assert off.consistency is None
    a, _ = off(prompts, batch)
    b, _ = classification_loss(pclip)(prompts, batch)
    assert torch.equal(a, b)
    # VPT's text side is the hand-made prompt itself: the text term is 0 up to float rounding
    clip, vpt, vclip, batch = _setup(tiny_clip, n_ctx_text=0, n_ctx_vision=2)
    with_text, _ = classification_loss(vclip, ConsistencySpec(text_weight=8.0))(vpt, batch)
    plain, _ = classification_loss(vclip)(vpt, batch)
    assert float(with_text) == pytest.approx(float(plain), abs=1e-5)
