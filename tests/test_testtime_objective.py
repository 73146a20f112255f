"""Test-time GRAM's meta-training objective (meta/metatrain/testtime_objective.py) on the tiny CLIP in float64: its
meta-gradient against a hand-written second-order computation and against central finite differences (θ, φ, both),
for cached view features (CoOp) and for view images through a prompted image tower (UNIGRAM); the inner step reads
no label; first order differs; the view builder; the one-line errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_central_differences
from torch.func import functional_call

from meta.finetune.testtime import TestTimeSpec, view_batch
from meta.metatrain.testtime_objective import TaskViews, TestTimeObjective, view_features
from meta.method.gram import GRAMMetaLearner, MetaSpec, double_backward_attention
from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
from meta.method.regulator import RegulatorSpec

NAMES = ["cat", "dog", "tree"]
KEPT = 2


@pytest.fixture(scope="module")
def clip64(tiny_clip):
    return copy.deepcopy(tiny_clip[0]).double(), tiny_clip[1]


def _learner(clip, dims, spec: PromptSpec, meta_spec: MetaSpec) -> GRAMMetaLearner:
    gen = torch.Generator().manual_seed(0)
    theta = PromptParams.from_spec(spec, clip, dims, generator=gen).double()
    ml = GRAMMetaLearner(theta, meta_spec).double()
    with torch.no_grad():  # a regulator away from the identity, so a bug in its path shows
        for p in ml.gbml.compute_update.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    return ml


def _query(pclip, dims, images_key: bool, m: int = 2, views: int = 4, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(m, 3, dims.image_size, dims.image_size, generator=gen, dtype=torch.float64)
    spec = TestTimeSpec(views=views, confident_share=KEPT / views)
    value = torch.stack([view_batch(x, spec, gen) for x in images])
    if not images_key:
        value = view_features(pclip, value)
    return {
        "classnames": NAMES,
        "label": torch.tensor([1, 2][:m]),
        ("view_images" if images_key else "view_features"): value,
    }


def _meta_grads(ml, pclip, query) -> tuple[list, dict]:
    ml.zero_grad(set_to_none=True)
    _, metrics = TestTimeObjective(KEPT).backward(ml, classification_loss(pclip), None, query, n_tasks=1)
    return [p.grad.detach().clone() for p in _params(ml)], metrics


def _params(ml) -> list:
    return list(ml.prompt_module.parameters()) + list(ml.gbml.compute_update.parameters())


def _hand_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the mean softmax over the KEPT rows of lowest entropy, written out with plain softmax and log."""
    p = torch.softmax(logits, dim=-1)
    row_entropy = -(p * torch.log(p)).sum(dim=-1)
    order = sorted(range(len(row_entropy)), key=lambda r: float(row_entropy[r].detach()))[:KEPT]
    mean = p[order].mean(dim=0)
    return -(mean * torch.log(mean)).sum()


@pytest.mark.parametrize("inner_steps", [1, 2])
def test_the_meta_gradient_matches_a_hand_written_second_order_computation(clip64, inner_steps):
    clip, dims = clip64
    alpha = 0.5
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=2), MetaSpec(inner_lr=alpha, inner_steps=inner_steps))
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key=False)
    got, metrics = _meta_grads(ml, pclip, query)

    regulator = ml.regulators()["ctx"]
    phi = {k: v.detach().clone().requires_grad_(True) for k, v in regulator.named_parameters()}
    theta = ml.prompt_module.ctx.detach().clone().requires_grad_(True)

    class View:  # the attributes PromptedCLIP reads from θ
        vpt = None

        def __init__(self, ctx):
            self.ctx = ctx

    total, entropies = 0.0, []
    for i, label in enumerate(query["label"]):
        feats = query["view_features"][i]
        ctx = theta
        for step in range(inner_steps):
            with double_backward_attention():
                h = _hand_entropy(pclip.logits(View(ctx), NAMES, image_features=feats))
            entropies += [h.detach()] if step == 0 else []
            (g,) = torch.autograd.grad(h, ctx, create_graph=True)
            ctx = ctx - alpha * functional_call(regulator, phi, (g,))
        logits = pclip.logits(View(ctx), NAMES, image_features=feats[:1])
        total = total + F.cross_entropy(logits, label.view(1)) / len(query["label"])
    want = torch.autograd.grad(total, [theta, *phi.values()])
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    for g, w in zip(got, want):
        assert float(w.abs().sum()) > 0
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-10)
    assert float(metrics["query_loss_after"]) == pytest.approx(float(total.detach()), rel=1e-9)
    assert float(metrics["entropy_before"]) == pytest.approx(float(torch.stack(entropies).mean()), rel=1e-9)


@pytest.mark.parametrize(
    "spec, images_key",
    [(PromptSpec(n_ctx_text=2), False), (PromptSpec(n_ctx_text=2, n_ctx_vision=2), True)],
    ids=["coop-view-features", "unigram-view-images"],
)
def test_directional_derivatives_match_central_finite_differences_float64(clip64, spec, images_key):
    clip, dims = clip64
    ml = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5))
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key)
    loss_fn = classification_loss(pclip)
    analytic, _ = _meta_grads(ml, pclip, query)
    params = _params(ml)
    n_theta = len(list(ml.prompt_module.parameters()))

    def objective() -> float:  # L_out recomputed without its gradient: the same step, by a second call
        return float(
            TestTimeObjective(KEPT).backward(ml, loss_fn, None, query, 1, backward=lambda _: None)[1][
                "query_loss_after"
            ]
        )

    theta_part = [j < n_theta for j in range(len(params))]
    masks = {"theta": theta_part, "phi": [not t for t in theta_part], "both": [True] * len(params)}
    assert_matches_central_differences(objective, params, analytic, masks, torch.Generator().manual_seed(4))


def test_the_inner_step_reads_no_label_and_first_order_differs(clip64):
    clip, dims = clip64
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key=False, m=1)
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=2), MetaSpec(inner_lr=0.5))
    relabelled = dict(query, label=torch.tensor([0]))
    from meta.metatrain.testtime_objective import entropy_loss

    batches = [
        {"classnames": NAMES, "label": q["label"].expand(4), "features": q["view_features"][0]}
        for q in (query, relabelled)
    ]
    adapted = [ml.unroll(entropy_loss(pclip, KEPT), b)[0].module.ctx.detach() for b in batches]
    torch.testing.assert_close(adapted[0], adapted[1], rtol=0, atol=0)  # θ' is the same whatever the label
    grads = {}
    for first_order in (False, True):
        ml = _learner(clip, dims, PromptSpec(n_ctx_text=2), MetaSpec(inner_lr=0.5, first_order=first_order))
        got, _ = _meta_grads(ml, pclip, query)
        assert all(float(g.abs().sum()) > 0 for g in got), "θ and φ are connected to the outer loss in both modes"
        grads[first_order] = got[0]
    assert float((grads[True] - grads[False]).norm() / grads[False].norm()) > 1e-4


def test_task_views_start_with_the_image_depend_on_the_task_only_and_encode_without_gradient(clip64):
    clip, dims = clip64
    pclip = PromptedCLIP(clip, dims, 2)
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(2, 3, dims.image_size, dims.image_size, generator=gen, dtype=torch.float64)
    spec = TestTimeSpec(views=3)
    feats = TaskViews(pclip, spec, seed=1, use_images=False)(images, np.array([4, 9]))["view_features"]
    assert feats.shape == (2, 3, pclip.image_features(None, images[:1]).shape[-1]) and not feats.requires_grad
    torch.testing.assert_close(feats[:, 0], pclip.image_features(None, images))  # view 0: the image itself
    pixels = TaskViews(pclip, spec, seed=1, use_images=True)(images, np.array([4, 9]))["view_images"]
    assert pixels.shape == (2, 3, 3, dims.image_size, dims.image_size)
    torch.testing.assert_close(view_features(pclip, pixels), feats, rtol=0, atol=0)  # the same draws, encoded
    again = TaskViews(pclip, spec, seed=1, use_images=True)(images, np.array([4, 9]))["view_images"]
    torch.testing.assert_close(again, pixels, rtol=0, atol=0)
    for other in (
        TaskViews(pclip, spec, 2, True)(images, np.array([4, 9])),
        TaskViews(pclip, spec, 1, True)(images, np.array([4, 8])),
    ):
        assert float((other["view_images"][:, 1:] - pixels[:, 1:]).abs().max()) > 1e-6  # another seed, another task


def test_bad_queries_and_a_gate_regulator_end_in_one_line(clip64):
    clip, dims = clip64
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key=False)
    ml = _learner(clip, dims, PromptSpec(n_ctx_text=2), MetaSpec(inner_lr=0.5))
    objective, loss_fn = TestTimeObjective(KEPT), classification_loss(pclip)
    no_views = {k: v for k, v in query.items() if k != "view_features"}
    with pytest.raises(
        ValueError,
        match=r"^test-time objective: the query holds no views \(expected one of view_features, view_images\)$",
    ):
        objective.backward(ml, loss_fn, None, no_views, 1)
    with pytest.raises(ValueError, match=r"^test-time objective: view_features holds 2 images, label 1$"):
        objective.backward(ml, loss_fn, None, dict(query, label=torch.tensor([1])), 1)
    gated = _learner(clip, dims, PromptSpec(n_ctx_text=2), MetaSpec(inner_lr=0.5, regulator=RegulatorSpec(form="gate")))
    with pytest.raises(ValueError, match=r"^test-time objective: META.REGULATOR.FORM gate needs a regulariser"):
        objective.backward(gated, loss_fn, None, query, 1)


@pytest.mark.parametrize("images_key", [False, True])
def test_first_order_gives_the_second_order_values_without_the_second_order_graph(clip64, images_key):
    clip, dims = clip64
    spec = PromptSpec(n_ctx_text=2, n_ctx_vision=2 if images_key else 0)
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key)
    views = query["view_images" if images_key else "view_features"].requires_grad_(True)
    values, reach = {}, {}
    for first_order in (False, True):
        ml, kept = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5)), []
        unroll = ml.unroll
        ml.unroll = lambda *a, **k: kept.append(unroll(*a, **k)) or kept[-1]  # keep each image's θ'_i
        loss_fn = classification_loss(pclip)
        _, values[first_order] = TestTimeObjective(KEPT).backward(
            ml, loss_fn, None, query, 1, backward=lambda _: None, first_order=first_order
        )
        # θ'_i = θ − α R_φ(∇_θ H_i): only a second-order step keeps the gradient's graph, which reaches the views
        ctx = [adapted.module.ctx.sum() for adapted, _, _ in kept]
        reach[first_order] = [torch.autograd.grad(c, views, allow_unused=True)[0] is not None for c in ctx]
    assert reach == {False: [True, True], True: [False, False]}
    for key, value in values[False].items():
        torch.testing.assert_close(values[True][key], value, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "spec, images_key, inner_steps, prototypes",
    [
        (PromptSpec(n_ctx_text=2), False, 1, False),
        (PromptSpec(n_ctx_text=2), False, 2, True),
        (PromptSpec(n_ctx_text=2, n_ctx_vision=2), True, 1, False),
    ],
    ids=["coop", "coop-2-steps-prototypes", "unigram-view-images"],
)
def test_the_images_stacked_in_one_pass_give_the_loops_gradients_and_metrics(
    clip64, spec, images_key, inner_steps, prototypes
):
    from meta.method.prototypes import Prototypes

    clip, dims = clip64
    regulator = RegulatorSpec(context=2 if prototypes else 0)
    ml = _learner(clip, dims, spec, MetaSpec(inner_lr=0.5, inner_steps=inner_steps, regulator=regulator))
    pclip = PromptedCLIP(clip, dims, 2)
    query = _query(pclip, dims, images_key, m=2, views=5, seed=3)
    query = {**query, "label": torch.tensor([1, 2])}
    protos = None
    if prototypes:
        g = torch.Generator().manual_seed(3)
        unit = lambda n: F.normalize(torch.randn(n, dims.embed_dim, generator=g), dim=1)  # noqa: E731
        protos = Prototypes(unit(3), unit(4), torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.25]))
    objective = TestTimeObjective(KEPT, protos)
    results = {}
    for mode in ("off", "on"):
        ml.task_batching.mode = mode
        ml.zero_grad(set_to_none=True)
        _, metrics = objective.backward(ml, classification_loss(pclip), None, query, n_tasks=2)
        results[mode] = ([p.grad.detach().clone() for p in _params(ml)], metrics)
    (loop, loop_metrics), (stacked, stacked_metrics) = results["off"], results["on"]
    assert all(float(g.abs().sum()) > 0 for g in loop)  # every θ and φ tensor is reached
    for a, b in zip(loop, stacked):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)
    for name, value in loop_metrics.items():
        assert float(stacked_metrics[name]) == pytest.approx(float(value), rel=1e-10, abs=1e-13), name
    ml.task_batching.mode = "auto"
