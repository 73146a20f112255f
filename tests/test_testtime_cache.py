"""The training-free cache baseline (TDA's positive/negative caches, meta/finetune/cache.py): the cache's keep/replace
rule, a stream's logits against a numpy replay of TDA's formulas, the shuffled order, and what the prediction reads."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meta.finetune.cache import CacheSpec, ClassCache, StreamCache, cache_and_predict, predict_one, stream_order
from meta.finetune.testtime import TestTimeSpec, image_generator, view_batch
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec
from meta.model.backbone import load_clip

NAMES = ["cat", "dog", "tree", "car", "boat"]


def test_a_full_class_keeps_its_lowest_entropy_entries_in_order():
    cache = ClassCache(capacity=2)
    value = torch.zeros(3)
    for loss in (0.9, 0.5, 0.7, 0.95, 0.1):
        cache.offer(1, torch.tensor([loss]), loss, value)
    assert [e[1] for e in cache.entries[1]] == [0.1, 0.5]  # 0.7 replaced 0.9, 0.95 refused, 0.1 replaced 0.7
    cache.offer(0, torch.tensor([2.0]), 2.0, value)
    assert sorted(cache.entries) == [0, 1] and len(cache.entries[0]) == 1
    assert ClassCache(1).affinity_logits(torch.ones(1), 1.0) is None


def _hand_stream(feats: np.ndarray, text: np.ndarray, scale: float, spec: CacheSpec) -> tuple[list, int, int]:
    """TDA's loop in numpy, one view per image: (logits per image, positive entries, negative entries at the end)."""
    C = text.shape[0]
    pos: dict = {}
    neg: dict = {}

    def keep(cache, label, item, cap):
        items = cache.setdefault(label, [])
        if len(items) < cap:
            items.append(item)
        elif item[1] < items[-1][1]:
            items[-1] = item
        items.sort(key=lambda x: x[1])

    def affinity(cache, f, beta):
        total = np.zeros(C)
        for label in sorted(cache):
            for key, _, value in cache[label]:
                total += math.exp(-beta * (1.0 - float(key @ f))) * value
        return total

    out = []
    for f in feats:
        logits = scale * text @ f
        p = np.exp(logits - logits.max())
        p /= p.sum()
        h = float(-(p * np.log(p)).sum())
        label = int(np.argmax(logits))
        keep(pos, label, (f, h, np.eye(C)[label]), spec.pos_capacity)
        if spec.neg_entropy[0] < h / math.log2(C) < spec.neg_entropy[1]:
            keep(neg, label, (f, h, ((p > spec.neg_mask[0]) & (p < spec.neg_mask[1])).astype(float)), spec.neg_capacity)
        cache = spec.pos_alpha * affinity(pos, f, spec.pos_beta) - spec.neg_alpha * affinity(neg, f, 1.0)
        out.append(logits + scale / 100.0 * cache)  # TDA's α are written against CLIP's logit scale 100
    return out, sum(map(len, pos.values())), sum(map(len, neg.values()))


def test_a_stream_of_single_views_matches_a_numpy_replay_of_tdas_formulas():
    g = torch.Generator().manual_seed(0)
    feats = torch.nn.functional.normalize(torch.randn(40, 8, generator=g, dtype=torch.float64), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(len(NAMES), 8, generator=g, dtype=torch.float64), dim=-1)
    spec, scale = CacheSpec(), 4.0  # a small scale: entropies spread over the negative cache's window
    stream = StreamCache(len(NAMES), spec)
    got = [stream.step(f[None], text, scale, kept=1)[0] for f in feats]
    wanted, n_pos, n_neg = _hand_stream(feats.numpy(), text.numpy(), scale, spec)
    assert n_neg > 0 and n_pos == sum(len(v) for v in stream.positive.entries.values())  # both caches took images
    assert n_neg == sum(len(v) for v in stream.negative.entries.values())
    np.testing.assert_allclose(torch.stack(got).numpy(), np.stack(wanted), rtol=1e-12, atol=1e-12)
    plain = scale * feats @ text.T
    assert not torch.allclose(torch.stack(got), plain)  # the caches moved the logits


def test_several_views_average_the_confident_ones():
    g = torch.Generator().manual_seed(1)
    views = torch.nn.functional.normalize(torch.randn(10, 8, generator=g, dtype=torch.float64), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(3, 8, generator=g, dtype=torch.float64), dim=-1)
    feature, logits, loss, probs, label = predict_one(views, text, 10.0, kept=3)
    all_logits = 10.0 * views @ text.T
    p = all_logits.softmax(-1)
    chosen = torch.argsort(-(p * p.log()).sum(-1))[:3]
    torch.testing.assert_close(feature, views[chosen].mean(0))
    torch.testing.assert_close(logits, all_logits[chosen].mean(0))
    mean_p = p[chosen].mean(0)
    torch.testing.assert_close(probs, mean_p)
    assert loss == pytest.approx(float(-(mean_p * mean_p.log()).sum()), rel=1e-12)
    assert label == int(logits.argmax())


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    clip, dims = load_clip("GRAM-Test-Tiny", None)
    images = torch.randn(12, 3, dims.image_size, dims.image_size, generator=torch.Generator().manual_seed(2))
    return clip, dims, images


def test_the_stream_runs_in_the_seeded_order_and_returns_logits_in_the_images_order(tiny):
    clip, dims, images = tiny
    pclip = PromptedCLIP(clip, dims, 0)
    spec = TestTimeSpec(views=4, confident_share=0.5, adapt="cache")
    result = cache_and_predict(pclip, None, images, NAMES, spec, seed=3)
    text = pclip.text_features(None, NAMES)
    stream, wanted = StreamCache(len(NAMES)), {}
    order = stream_order(len(images), 3).tolist()
    assert order != list(range(len(images)))
    for i in order:
        with torch.no_grad():
            views = pclip.image_features(None, view_batch(images[i], spec, image_generator(3, i)))
            wanted[i] = stream.step(views, text, pclip.logit_scale, spec.kept)[0]
    torch.testing.assert_close(result.logits, torch.stack([wanted[i] for i in range(len(images))]))
    assert result.logits.shape == (len(images), len(NAMES)) and math.isnan(result.loss_after)
    other = cache_and_predict(pclip, None, images, NAMES, spec, seed=4)
    assert not torch.allclose(other.logits, result.logits)  # another order, other caches


def test_prompts_embed_the_classes_and_are_left_unchanged(tiny):
    clip, dims, images = tiny
    theta = PromptParams.from_spec(PromptSpec(n_ctx_text=2), clip, dims, generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in theta.state_dict().items()}
    pclip = PromptedCLIP(clip, dims, 2)
    spec = TestTimeSpec(views=1, adapt="cache")
    prompted = cache_and_predict(pclip, theta, images, NAMES, spec, seed=0)
    assert all(torch.equal(before[k], v) for k, v in theta.state_dict().items())
    text = pclip.text_features(theta, NAMES).detach()
    stream = StreamCache(len(NAMES))
    with torch.no_grad():
        feats = pclip.image_features(theta, images)
        wanted = {i: stream.step(feats[i : i + 1], text, pclip.logit_scale, 1)[0] for i in stream_order(12, 0).tolist()}
    torch.testing.assert_close(prompted.logits, torch.stack([wanted[i] for i in range(12)]))


def test_bad_settings_and_no_images_end_in_one_line():
    with pytest.raises(ValueError, match=r"^test-time adapt: expected tpt \| cache, got 'tda'$"):
        TestTimeSpec(adapt="tda")
    with pytest.raises(ValueError, match=r"^test-time cache: expected unlabelled images \[n >= 1"):
        cache_and_predict(None, None, torch.zeros(0, 3, 4, 4), NAMES)
