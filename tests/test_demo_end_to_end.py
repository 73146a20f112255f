"""The main job end to end on the quick world: world -> tiny CLIP -> CHC -> meta-training -> every table.

Shares the test run's quick world and its quick CLIP weights (conftest.py: built once for every pytest-xdist
worker, cached by settings hash) with tests/test_world_*.py; meta-training and fine-tuning are cut to a few
steps so that the whole chain, not the numbers, is what this test checks.
"""

import json
from dataclasses import replace

import pytest
from helpers import file_lock, quick_demo_settings, shared_dir

from gram_world.demo import (
    METHOD_BY_KEY,
    TABLE4_KEYS,
    TABLE_GROUPS,
    TOKEN_KEYS,
    TRANSFER_KEYS,
    b2n_keys,
    run,
    variants_needed,
)
from gram_world.demo.background import BackgroundRuns, baseline_jobs
from gram_world.demo.report import QUICK_NOTE
from gram_world.demo.settings import ONE_STEP_VARIANTS, OPT_IN_TABLES, TABLE1_ROWS
from gram_world.demo.stages import stage_world
from meta.data.coop_data import harmonic_mean

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def _demo_run(tmp_path_factory, quick_world, quick_world_weights):
    """The demo, run once per test run into a folder every pytest-xdist worker shares: pytest-xdist may hand this
    module's tests to both workers, and the second one's run() then finds every stage finished (reusing them is
    what test_rerun_... checks).  Its stage 1 finds the quick world and CLIP of the fixtures cached."""
    # 2 shots (the quick preset's 4 halve the evaluation time): transfer tables at 2 and 1 shots
    settings = quick_demo_settings(seeds=(1, 2), tables=tuple(g for g in TABLE_GROUPS if g not in OPT_IN_TABLES))
    out = shared_dir(tmp_path_factory, "demo_end_to_end")
    lock = out.parent / ".demo_end_to_end.lock"
    with file_lock(lock):
        md = run(settings, out, world_root=quick_world.root.parent)
    return out, md, settings, lock


@pytest.fixture
def demo_out(_demo_run):
    """``(folder, results.md, settings)`` of the demo, the folder locked for the test (a test on the other
    pytest-xdist worker may rewrite its report: test_rerun_...)."""
    out, md, settings, lock = _demo_run
    with file_lock(lock):
        yield out, md, settings


def test_every_table_is_present_with_stable_keys_and_h_of_the_means(demo_out):
    out, md, settings = demo_out
    text = md.read_text()
    result = json.loads((out / "results.json").read_text())
    tables = result["tables"]
    assert set(tables) == {"table1", "table2", "table3", "table4", "tableA1", "tableA2", "tableA3"}
    for tid, keys in (("table1", TABLE1_ROWS), ("table4", TABLE4_KEYS)):
        for dataset in ("WorldMixed", "Average"):
            rows = [r for r in tables[tid]["rows"] if r["dataset"] == dataset]
            assert [r["key"] for r in rows] == list(keys)
            assert [r["method"] for r in rows] == [METHOD_BY_KEY[k].label for k in keys]
            for r in rows:
                assert r["seeds"] == [1, 2]
                assert r["H"] == pytest.approx(harmonic_mean(r["base_mean"], r["new_mean"]))
                assert f"| {r['method']} | {r['base_mean']:.2f} ± {r['base_std']:.2f} | " in text
    # one dataset: its average row is that dataset's row
    t1 = {(r["dataset"], r["key"]): r for r in tables["table1"]["rows"]}
    assert t1[("Average", "unigram")]["new_mean"] == pytest.approx(t1[("WorldMixed", "unigram")]["new_mean"])
    # zero-shot CLIP trains nothing: identical across seeds, in every table
    assert t1[("WorldMixed", "zsclip")]["base_std"] == 0.0 == t1[("WorldMixed", "zsclip")]["new_std"]
    shots = settings.transfer_shot_counts
    twin, families = ["WorldMixedSketch"], ["WorldPolygons", "WorldCurves", "WorldSymbols", "WorldIcons"]
    for tid, n_shots, targets in (
        ("table2", shots[0], twin),
        ("tableA1", shots[1], twin),
        ("table3", shots[0], families),
        ("tableA2", shots[1], families),
    ):
        t = tables[tid]
        assert (t["source"], t["shots"], sorted(t["targets"])) == ("WorldMixed", n_shots, sorted(targets))
        assert [r["key"] for r in t["rows"]] == list(TRANSFER_KEYS)
        for r in t["rows"]:
            assert sorted(r["targets"]) == sorted(targets)
            assert r["target_mean"] == pytest.approx(sum(m for m, _ in r["targets"].values()) / len(targets))
        zs = t["rows"][0]
        assert zs["key"] == "zsclip" and zs["source_std"] == 0.0 and zs["target_std"] == 0.0
        assert t["title"] in text
    # the zero-shot row of the transfer tables does not depend on the shots either
    assert tables["table2"]["rows"][0]["targets"] == tables["tableA1"]["rows"][0]["targets"]
    a3 = tables["tableA3"]["rows"]
    assert [(r["tokens"], r["key"]) for r in a3] == list(TOKEN_KEYS.items())
    assert a3[1]["H"] == t1[("Average", "unigram")]["H"]  # 4 tokens is UNIGRAM itself
    # every base-to-new row of results.json carries its key; provenance names world, hash, commit, machine
    assert {r["key"] for r in result["rows"]} == set(b2n_keys(settings.tables))
    prov = result["provenance"]
    assert prov["world_seed"] == 0 and len(prov["world_settings_hash"]) == 12 and prov["commit"] and prov["machine"]
    # and what computed the numbers: the pinned kernels and this machine's golden-run digest
    computed = prov["computed_by"]
    assert computed["numerics"]["pinned"] is True and computed["numerics"]["pins"]["MKL_CBWR"] == "COMPATIBLE"
    assert len(computed["fingerprint"]) == 64 and computed["numerics"]["cpu_model"]
    assert f"world seed **0**, world settings hash `{prov['world_settings_hash']}`" in text
    assert f"**{QUICK_NOTE}**" in text  # quick numbers are marked as a wiring check in the file too
    # one run record per (protocol, dataset, method, seed[, shots])
    n_b2n = len(b2n_keys(settings.tables)) * len(settings.seeds)
    n_transfer = len(TRANSFER_KEYS) * len(settings.seeds) * len(shots)
    assert len(list((out / "runs").rglob("seed*.json"))) == n_b2n + n_transfer


def test_every_meta_variant_exported_and_plots_written(demo_out):
    out, _, settings = demo_out
    one_step = {v.name for v in ONE_STEP_VARIANTS}
    for variant in variants_needed(settings.tables):
        run_dir = out / "meta" / variant.name
        if variant.name in one_step and settings.query_before_weight == 0:  # same config as the GRAM variant
            assert not run_dir.exists(), variant.name
            continue
        assert (run_dir / "gram_init.safetensors").is_file(), variant.name
        logged = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in logged if r.get("kind") == "train") == settings.meta_steps
    for name in ("accuracy_bars.png", "grad_cosine.png", "accuracy_vs_epoch.png", "transfer_bars.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    fig3b = json.loads((out / "results.json").read_text())["fig3b"]
    assert "unigram_pretrain" not in fig3b["series"] and fig3b["not_shown"] == [
        "UNIGRAM, θ* from prompt pre-training (no meta-learning)"
    ]
    assert {"gram_coop", "gram_vpt", "unigram"} <= set(fig3b["series"])


def test_rerun_reuses_every_stage_and_gives_the_same_tables(demo_out, quick_world):
    out, md, settings = demo_out
    before = json.loads((out / "results.json").read_text())["tables"]
    stamps = {
        p: p.stat().st_mtime_ns
        for p in list((out / "runs").rglob("seed*.json"))
        + list((out / "meta").rglob("gram_init.safetensors"))
        + list((out / "chc").rglob("*"))
        if p.is_file()
    }
    run(settings, out, world_root=quick_world.root.parent)
    assert json.loads((out / "results.json").read_text())["tables"] == before
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_baseline_runs_in_the_background_process_give_the_same_records(demo_out, quick_world, tmp_path_factory):
    """What :class:`BackgroundRuns` computes beside CHC / meta-training equals the in-process runs."""
    out, _, settings = demo_out
    again = tmp_path_factory.mktemp("demo_background")
    world, weights, model, _ = stage_world(settings, again, quick_world.root.parent)
    jobs = baseline_jobs(world, again, settings)
    assert jobs and {j.key for j in jobs} == {k for k in b2n_keys(settings.tables) if not METHOD_BY_KEY[k].variant}
    assert settings.jobs == 1 and BackgroundRuns.start(world, weights, model, again, settings) is None  # one process
    background = BackgroundRuns.start(world, weights, model, again, replace(settings, jobs=2))
    background.process.join(timeout=600)  # it ends by itself when its list is done
    assert background.finish() == len(jobs)
    assert baseline_jobs(world, again, settings) == []  # the evaluation stage has nothing left of them

    def numbers(record: dict) -> dict:  # everything but wall-clock times
        history = [{k: v for k, v in row.items() if "seconds" not in k} for row in record.get("history", [])]
        kept = ("base", "new", "H", "source", "targets", "final_prompt_sha256")
        return {"history": history, **{k: record.get(k) for k in kept}}

    for job in jobs:
        ours, theirs = (json.loads(job.path(folder).read_text()) for folder in (again, out))
        assert numbers(ours) == numbers(theirs), job.key
