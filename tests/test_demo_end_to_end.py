"""The main job end to end on the quick world: world -> tiny CLIP -> CHC -> meta-training -> table.

Shares the session's quick world (and its quick CLIP weights, cached by settings hash) with
tests/test_world_*.py; meta-training and fine-tuning are cut to a few steps so that the whole
chain, not the numbers, is what this test checks.
"""
import json
from dataclasses import replace
from pathlib import Path

import pytest

from meta.coop_data import harmonic_mean
from meta.demo import EVAL_METHODS, META_VARIANTS, DemoSettings, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory):
    settings = replace(DemoSettings.preset(quick=True), meta_steps=2, checkpoint_every=1, log_detail_every=1,
                       epochs=1, val_tasks=2, jobs=1, seeds=(1, 2))
    out = tmp_path_factory.mktemp("demo")
    md = run(settings, out, world_root=tmp_path_factory.getbasetemp() / "worlds")
    return out, md, settings


def test_results_table_has_every_row_and_h_of_the_means(demo_out):
    out, md, settings = demo_out
    text = md.read_text()
    result = json.loads((out / "results.json").read_text())
    labels = [label for label, _, _ in EVAL_METHODS]
    for dataset in ("WorldMixed", "Average"):
        rows = [r for r in result["rows"] if r["dataset"] == dataset]
        assert [r["method"] for r in rows] == labels
        for r in rows:
            assert 0.0 <= r["base_mean"] <= 100.0 and 0.0 <= r["new_mean"] <= 100.0
            assert r["H"] == pytest.approx(harmonic_mean(r["base_mean"], r["new_mean"]))
            assert f"| {r['method']} | {r['base_mean']:.2f} ± " in text
    # one run record per (dataset, method, seed), each with its per-epoch history
    runs = sorted((out / "runs").rglob("seed*.json"))
    assert len(runs) == len(EVAL_METHODS) * len(settings.seeds)
    # zero-shot CLIP trains nothing, so its accuracy cannot depend on the seed
    zero_shot = [r for r in result["rows"] if r["method"] == "CLIP (zero-shot)" and r["dataset"] == "WorldMixed"][0]
    assert zero_shot["base_std"] == 0.0 and zero_shot["new_std"] == 0.0
    assert set(result["zeroshot"]) >= {"WorldMixed"}


def test_every_meta_variant_exported_and_plots_written(demo_out):
    out, _, settings = demo_out
    for variant in META_VARIANTS:
        run_dir = out / "meta" / variant.name
        assert (run_dir / "gram_init.safetensors").is_file(), variant.name
        logged = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in logged if r.get("kind") == "train") == settings.meta_steps
    for name in ("accuracy_bars.png", "grad_cosine.png", "accuracy_vs_epoch.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_rerun_reuses_every_stage_and_gives_the_same_table(demo_out, tmp_path_factory):
    out, md, settings = demo_out
    before = json.loads((out / "results.json").read_text())["rows"]
    mtimes = {p: p.stat().st_mtime for p in (out / "runs").rglob("seed*.json")}
    run(settings, out, world_root=tmp_path_factory.getbasetemp() / "worlds")
    assert json.loads((out / "results.json").read_text())["rows"] == before
    assert all(p.stat().st_mtime == t for p, t in mtimes.items())
