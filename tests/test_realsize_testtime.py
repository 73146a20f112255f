"""gram_tools.realsize's testtime mode (one TPT image) on the tiny test CLIP: what it measures, against the hand count.

A CoOp image of test-time tuning is the V views encoded without gradients, then text passes over the C prompts (the
step's forward and backward, the prediction's forward); the logits ``[V, C]`` of the views against the classes cost
``2 V C E`` FLOPs per product: the step's forward, its backward to the text features, and the prediction's forward.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gram_tools import realsize

TINY = "GRAM-Test-Tiny"
VIEWS = (16, 32)  # enough views that the tiny CLIP's peak clears the allocator's resolution
CLASSES = (3, 6, 9)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One run of ``python -m gram_tools.realsize --modes testtime encode`` on the tiny CLIP, merged into a figures
    file that already holds one point and its settings."""
    out = tmp_path_factory.mktemp("realsize") / "figures.json"
    old_point = {
        "learner": "vpt",
        "mode": "finetune",
        "support": 1,
        "query": 0,
        "peak_mib": 70.0,
        "flops": 64_000_000_000,
        "seconds": 3.0,
        "load_avg_1min": [1.0, 1.0],
        "repeats": 2,
    }
    old_settings = {"model": TINY, "date_utc": "2026-01-01T00:00:00Z", "repeats": 2, "way": 5}
    out.write_text(json.dumps({"points": [old_point], "fits": {}, "settings": old_settings}))
    argv = ["--model", TINY, "--learners", "coop", "unigram", "--modes", "testtime", "encode"]
    argv += ["--views", ",".join(map(str, VIEWS)), "--classes", ",".join(map(str, CLASSES)), "--batches", "1"]
    assert realsize.main([*argv, "--repeats", "1", "--out", str(out), "--merge"]) == 0
    return old_point, old_settings, json.loads(out.read_text())


def _flops(result: dict, learner: str) -> dict:
    return {
        (p["views"], p["classes"]): p["flops"]
        for p in result["points"]
        if p["learner"] == learner and p["mode"] == "testtime"
    }


@pytest.fixture(scope="module")
def tiny():
    from meta.model.backbone import load_clip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return load_clip(TINY, pretrained=None)


@pytest.mark.slow
def test_testtime_points_are_positive_and_merged(measured):
    old_point, old_settings, result = measured
    tt = [p for p in result["points"] if p["mode"] == "testtime"]
    assert {(p["learner"], p["views"], p["classes"]) for p in tt} == {
        (learner, v, c) for learner in ("coop", "unigram") for v in VIEWS for c in CLASSES
    }
    for p in tt:
        assert p["peak_mib"] > 0 and p["flops"] > 0 and p["seconds"] > 0, p
        assert p["support"] == 0 and p["query"] == 0 and p["way"] == p["classes"]
    # --merge: the file's point and settings stay as they were; the run adds keys only (its own under testtime)
    assert old_point in result["points"]
    assert {k: result["settings"][k] for k in old_settings} == old_settings
    for learner in ("coop", "unigram"):
        (run,) = result["settings"]["testtime"]["runs"][learner]
        assert run["views"] == list(VIEWS) and run["classes"] == list(CLASSES) and run["repeats"] == 1
    # the text-only learner's points also measure their no-grad view encoding alone, the visual learner's cannot
    assert all((p.get("views_peak_mib") is not None) == (p["learner"] == "coop") for p in tt)
    assert all(p["views_peak_mib"] > 0 for p in tt if p["learner"] == "coop")
    assert result["fits"]["coop"]["testtime"]["peak_mib"]["phase"] in ("step", "all")
    assert "views_peak_mib" in result["fits"]["coop"]["testtime"]
    assert "views_peak_mib" not in result["fits"]["unigram"]["testtime"]
    # the visual learner's peak plane: the points at the two largest class counts (two views x two class counts)
    peak = result["fits"]["unigram"]["testtime"]["peak_mib"]
    assert peak["phase"] == "largest classes" and peak["points"] == 4
    assert set(result["fits"]["coop"]) == {"testtime"} == set(result["fits"]["unigram"])  # encode: one batch, no line


@pytest.mark.slow
def test_text_only_learner_grows_with_views_by_the_no_grad_image_pass_only(measured, tiny):
    """CoOp: at fixed C, one more view costs one no-grad image pass (the measured ``encode`` of one image) plus its
    row of the three ``[V, C]`` logit products, nothing else: the step itself is text passes."""
    _, _, result = measured
    embed = tiny[1].embed_dim
    (image_flops,) = [p["flops"] for p in result["points"] if p["mode"] == "encode" and p["support"] == 1]
    flops = _flops(result, "coop")
    (v1, v2) = VIEWS
    for c in CLASSES:
        assert flops[(v2, c)] - flops[(v1, c)] == (v2 - v1) * (image_flops + 3 * 2 * c * embed)


@pytest.mark.slow
def test_text_passes_scale_with_classes(measured, tiny):
    """At fixed V the FLOPs are linear in C, and the per-class part beyond the logits is the same at every V: the
    text tower on one more prompt, forward and backward in the step and forward again for the prediction, between
    two and four of its plain forwards (the backward computes input gradients only; attention's backward has two
    products per forward one)."""
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec

    _, _, result = measured
    clip, dims = tiny
    spec = PromptSpec(**realsize.LEARNERS["coop"])
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template)
    names = [f"class {i}" for i in range(CLASSES[-1])]
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        pclip.text_features(theta, names)
    forward_per_class = counter.get_total_flops() / len(names)

    flops = _flops(result, "coop")
    c1, c2, c3 = CLASSES
    per_class = set()
    for v in VIEWS:
        assert flops[(v, c2)] - flops[(v, c1)] == flops[(v, c3)] - flops[(v, c2)]  # linear in C
        per_class.add((flops[(v, c2)] - flops[(v, c1)]) / (c2 - c1) - 3 * 2 * v * dims.embed_dim)
    assert len(per_class) == 1  # independent of V
    (text,) = per_class
    assert 2 * forward_per_class < text < 4 * forward_per_class


@pytest.mark.slow
def test_visual_learner_pays_the_image_tower_with_gradients_per_view(measured):
    """UNIGRAM runs the image tower with gradients on every view: per view more than CoOp's no-grad pass; its FLOP
    plane fits with residual ~0 and its V x C term is the logit products (forward, backward to both sides; the
    prediction encodes the image alone)."""
    _, _, result = measured
    (image_flops,) = [p["flops"] for p in result["points"] if p["mode"] == "encode" and p["support"] == 1]
    flops = _flops(result, "unigram")
    (v1, v2) = VIEWS
    for c in CLASSES:
        assert flops[(v2, c)] - flops[(v1, c)] > 1.2 * (v2 - v1) * image_flops
    for learner in ("coop", "unigram"):
        fit = result["fits"][learner]["testtime"]
        assert fit["variables"] == ["views", "classes", "views x classes"] and fit["points"] == 6
        assert fit["gflops"]["max_abs_residual"] < 1e-3
        assert fit["peak_mib"]["variables"] == ["views", "classes"] and len(fit["peak_mib"]["slopes"]) == 2
        assert fit["seconds_per_gflop"] > 0


def test_fit_testtime_recovers_a_plane_and_refuses_a_line():
    rows = [
        {
            "views": v,
            "classes": c,
            "peak_mib": 5.0 + 2.0 * v + 0.5 * c,
            "flops": int(1e9 * (1.0 + 3.0 * v + 0.25 * c + 0.01 * v * c)),
            "seconds": 0.1 * v,
            "load_avg_1min": [1.0],
            "repeats": 1,
        }
        for v in (8, 16, 32)
        for c in (10, 40)
    ]
    fit = realsize.fit_testtime(rows)
    assert fit["gflops"]["intercept"] == pytest.approx(1.0, abs=1e-3)
    assert fit["gflops"]["slopes"] == pytest.approx([3.0, 0.25, 0.01], abs=1e-3)
    assert fit["peak_mib"]["slopes"] == pytest.approx([2.0, 0.5], abs=1e-3)
    assert realsize.fit_testtime([r for r in rows if r["classes"] == 10]) is None  # one class count: no plane
    # two phases: the encoding's line, and the step's plane from the points whose peak is the step's
    for r in rows:
        r["views_peak_mib"] = 1.0 + 3.0 * r["views"]  # dominates at 10 classes, not at 40
        r["peak_mib"] = max(r["views_peak_mib"], 5.0 + 0.5 * r["views"] + 2.0 * r["classes"])
    rows += [r | {"classes": 80, "peak_mib": 5.0 + 0.5 * r["views"] + 160.0} for r in rows if r["classes"] == 40]
    fit = realsize.fit_testtime(rows)
    assert fit["views_peak_mib"]["slopes"] == pytest.approx([3.0], abs=1e-3)
    assert fit["peak_mib"]["phase"] == "step" and fit["peak_mib"]["points"] == 6
    assert fit["peak_mib"]["slopes"] == pytest.approx([0.5, 2.0], abs=1e-3)
    assert realsize.point_key(rows[0] | {"learner": "coop", "mode": "testtime", "support": 0, "query": 0}) != (
        realsize.point_key(rows[1] | {"learner": "coop", "mode": "testtime", "support": 0, "query": 0})
    )
