"""The demo's test-time group (``--tables testtime``, gram_world/demo/testtime_report.py and the test-time jobs of
gram_world/demo/stages.py): which runs it plans, how its table averages seeds and datasets, that its records stay
out of the other tables, and (slow) the group end to end on the quick world, where TPT from the hand prompt starts
from exactly zero-shot CLIP's predictions."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import make_dtd, quick_demo_settings

from gram_world.demo import DemoSettings, run, variants_needed
from gram_world.demo import stages as demo_stages
from gram_world.demo.report import build_tables
from gram_world.demo.settings import OPT_IN_TABLES, TABLE_GROUPS, TESTTIME_ROWS, VARIANT_BY_NAME, method_row
from gram_world.demo.testtime_report import GROUPS, build_testtime_table, markdown_of_testtime
from meta.finetune.testtime import TestTimeSpec

KEYS = [r.key for r in TESTTIME_ROWS]


def _world():
    datasets = {n: SimpleNamespace(name=n, dataset_dir=Path("/data") / n) for n in ("A", "B", "Src", "Sketch")}
    roles = {"base2new": ["A", "B"], "cross_domain_source": ["Src"], "cross_domain_target": ["Sketch"]}
    return SimpleNamespace(
        manifest="world.json",
        with_role=lambda role: [datasets[n] for n in roles.get(role, [])],
        dataset=lambda n: datasets[n],
    )


def test_the_group_is_opt_in_and_plans_every_row_seed_and_set_in_its_own_folders(tmp_path):
    assert "testtime" in TABLE_GROUPS and "testtime" in OPT_IN_TABLES
    settings = replace(DemoSettings(), tables=("testtime",), seeds=(1, 2))
    # θ* and φ of CoOp + GRAM, and of CoOp + GRAM meta-trained for test time (META.MODE testtime)
    names = ["gram_coop", "gram_coop_testtime", "gram_coop_testtime_proto"]
    assert [v.name for v in variants_needed(settings.tables)] == names
    plain, proto = (dict(zip(*[iter(VARIANT_BY_NAME[n].overrides)] * 2)) for n in names[1:])
    assert plain["META.MODE"] == "testtime" and proto == {**plain, "META.TEST_TIME.PROTOTYPES": "nearest"}
    inits = {n: f"{n}.safetensors" for n in names}
    jobs = demo_stages.eval_jobs(_world(), inits, settings)
    assert len(jobs) == len(TESTTIME_ROWS) * 2 * (2 + 1)  # rows x seeds x (two base-to-new datasets + transfer)
    assert {j.test_time for j in jobs} == set(KEYS)
    for j in jobs:
        assert j.path(tmp_path).parts[-4].startswith("testtime_") and j.path(tmp_path).parts[
            -2
        ] == j.test_time + "_views1" * (j.test_time == "tda_cache")
        assert j.init == inits.get(method_row(j.key).variant, "")
        if j.protocol == "transfer":  # the held-out style only, not the family datasets
            assert (j.dataset, j.targets) == ("Src", (("Sketch", "/data/Sketch"),))
    assert len({j.path(tmp_path) for j in jobs}) == len(jobs)
    plain = demo_stages.eval_jobs(_world(), {}, replace(settings, tables=("base2new",), datasets=("A",)))
    assert not any(j.test_time for j in plain)


def _record(key: str, protocol: str, seed: int, dataset: str, value: float) -> dict:
    sets = ["Sketch"] if protocol == "transfer" else ["base", "new"]
    row = {"accuracy": value, "accuracy_before": value - 1, "ece": 5.0 + seed, "ece_before": 4.0}
    row["seconds_per_image"] = 0.5
    record = {"protocol": protocol, "seed": seed, "dataset": dataset, "key": "coop", "method": "CoOp"}
    record["test_time_row"] = key
    if protocol == "transfer":
        record.update(source=1.0, targets={"Sketch": value}, target_mean=value)
    else:
        record.update(base=value, new=value, H=value)
    if key != "zsclip":
        spec = TestTimeSpec(adapt="cache", views=1) if key == "tda_cache" else TestTimeSpec()
        record["test_time"] = {"spec": asdict(spec), "sets": {n: dict(row) for n in sets}}
    return record


def test_the_table_averages_datasets_within_a_seed_first_and_reads_zero_shot_as_plain():
    records = []
    for seed in (1, 2):
        for i, key in enumerate(KEYS):
            records.append(_record(key, "transfer", seed, "Src", 10.0 * i + seed))
            records += [_record(key, "base2new", seed, d, 10.0 * i + seed + off) for d, off in (("A", 0), ("B", 4))]
    table = build_testtime_table(records, DemoSettings())
    assert list(table["groups"]) == [g[0] for g in GROUPS]
    cross, new = table["groups"]["cross_domain"]["rows"], table["groups"]["new"]["rows"]
    assert [r["key"] for r in cross] == KEYS and all(r["seeds"] == [1, 2] for r in cross)
    # seed 1: mean over A and B of (10 i + 1, 10 i + 5) = 10 i + 3; seed 2: 10 i + 4
    i = KEYS.index("tpt_coop")
    assert new[i]["accuracy"] == pytest.approx((10 * i + 3.5, statistics.pstdev([3.0, 4.0])))
    assert cross[i]["ece"] == pytest.approx((6.5, 0.5)) and cross[i]["accuracy_before"][0] == pytest.approx(
        10 * i + 0.5
    )
    zs = cross[0]
    assert zs["accuracy"] == zs["accuracy_before"] == pytest.approx((1.5, 0.5)) and zs["ece"] == (None, None)
    other = dict(records[3], test_time=dict(records[3]["test_time"], spec=asdict(TestTimeSpec(views=4))))
    with pytest.raises(ValueError, match="^test-time table: expected the runs of one TPT spec, found 2"):
        build_testtime_table(records[:3] + [other] + records[4:], DemoSettings())
    c = 3 * KEYS.index("tda_cache")  # the cache row's views are its own, its other fields are not
    shared = dict(records[c], test_time=dict(records[c]["test_time"], spec=asdict(TestTimeSpec(adapt="cache"))))
    assert build_testtime_table(records[:c] + [shared] + records[c + 1 :], DemoSettings())["cache_views"] == [1, 64]
    odd = asdict(TestTimeSpec(adapt="cache", views=1, confident_share=0.2))
    with pytest.raises(ValueError, match="found 2"):
        build_testtime_table(
            records[:c] + [dict(records[c], test_time={**records[c]["test_time"], "spec": odd})] + records[c + 1 :],
            DemoSettings(),
        )
    text = "\n".join(markdown_of_testtime(table))
    assert "| Zero-shot CLIP (no tuning) | 1.50 ± 0.50 | 1.50 ± 0.50 | — | — | — | — |" in text
    # the cache row's views are its own (DemoSettings.cache_views): the TPT rows' 64 head the table, the text says 1
    assert table["spec"]["views"] == 64 and table["cache_views"] == [1]
    assert "shuffled test stream (each image's own feature, no augmented views)" in text
    assert text.count("| method | accuracy | accuracy before | ECE | ECE before | s / image | peak MiB / image |") == 3


def test_the_table_shows_the_peak_memory_per_image_of_a_real_record(tmp_path, tiny_clip):
    from meta.evaluation import DatasetRef, TrainSpec, evaluate_base_to_new, method_preset

    make_dtd(tmp_path, n_classes=4, counts={"train": 2, "val": 1, "test": 2})
    spec, tpt = TrainSpec(epochs=0, test_batch_size=4), TestTimeSpec(views=2, steps=1)
    args = (DatasetRef.from_dir(tmp_path / "dtd"), *tiny_clip, method_preset("coop"), 1, 2, spec)
    record = dict(evaluate_base_to_new(*args, use_split_cache=False, log=lambda m: None, test_time=tpt))
    record["test_time_row"] = "tpt_coop"
    peaks = [record["test_time"]["sets"][n]["peak_mib_per_image"] for n in ("base", "new")]
    table = build_testtime_table([record], DemoSettings())
    row, text = table["groups"]["new"]["rows"][0], "\n".join(markdown_of_testtime(table))
    if peaks[1] is None:  # no VmHWM reset here: null in the record, a dash in the table
        assert row["peak_mib_per_image"] == (None, None) and text.count(" — |") >= 3
    else:
        assert row["peak_mib_per_image"] == (peaks[1], 0.0) and f"{peaks[1]:.1f} ± 0.0 |" in text


def test_test_time_records_stay_out_of_table_1():
    plain = {"protocol": "base2new", "seed": 1, "dataset": "A", "key": "coop", "method": "CoOp", "base": 50.0}
    plain.update(new=40.0)
    plain.update(H=44.4, history=[])
    tuned = dict(_record("tpt_coop", "base2new", 1, "A", 90.0), history=[])
    settings = replace(DemoSettings(), tables=("base2new", "testtime"))
    tables = build_tables([plain, tuned], settings, _world())
    coop = [r for r in tables["table1"]["rows"] if r["key"] == "coop" and r["dataset"] == "A"]
    assert [(r["base_mean"], r["new_mean"]) for r in coop] == [(50.0, 40.0)]
    assert tables["testtime"]["groups"]["base"]["rows"][0]["accuracy"] == (90.0, 0.0)


@pytest.mark.slow
def test_the_group_end_to_end_on_the_quick_world(tmp_path, quick_world, quick_world_weights, monkeypatch):
    monkeypatch.setattr(demo_stages, "TESTTIME_SPEC", TestTimeSpec(views=4))  # 4 views keep the test short
    settings = quick_demo_settings(tables=("testtime",))
    run(settings, tmp_path, world_root=quick_world.root.parent)
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["tables"]) == {"testtime"}
    for gid, group in result["tables"]["testtime"]["groups"].items():
        rows = {r["key"]: r for r in group["rows"]}
        assert list(rows) == KEYS, gid
        # the hand prompt as CoOp's context is zero-shot CLIP's prompt: the same predictions before tuning
        assert rows["tpt_hand"]["accuracy_before"][0] == pytest.approx(rows["zsclip"]["accuracy"][0], abs=1e-9)
        # θ* alone and θ* with R_φ predict the same before the step; R_φ acts only on the step
        assert rows["tpt_init"]["accuracy_before"] == rows["tpt_init_reg"]["accuracy_before"]
        # the caches start from zero-shot CLIP's predictions, and move some of them
        assert rows["tda_cache"]["accuracy_before"][0] == pytest.approx(rows["zsclip"]["accuracy"][0], abs=1e-9)
        for r in group["rows"][1:]:
            assert 0.0 <= r["ece"][0] <= 100.0 and r["seconds_per_image"][0] > 0
    records = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("seed*.json")]
    tuned = {r["test_time_row"]: r["test_time"] for r in records if r.get("test_time")}
    assert tuned["tpt_init_reg"]["regulated"] is True and tuned["tpt_init"]["regulated"] is False
    assert tuned["tt_gram"]["regulated"] is True and tuned["tt_gram"]["spec"]["optimizer"] == "meta"
    assert tuned["tt_gram_proto"]["spec"]["optimizer"] == "meta" and tuned["tt_gram"]["spec"]["prototypes"] == "none"
    assert tuned["tt_gram_proto"]["spec"]["prototypes"] == "nearest" and tuned["tt_gram_proto"]["regulated"] is True
    assert {t["spec"]["optimizer"] for k, t in tuned.items() if not k.startswith("tt_gram")} == {"adamw"}
    assert {k for k, t in tuned.items() if t["spec"]["adapt"] == "cache"} == {"tda_cache"}
    assert tuned["tda_cache"]["regulated"] is False and all(
        math.isnan(v["loss_after"]) for v in tuned["tda_cache"]["sets"].values()
    )
    run_info = json.loads((tmp_path / "meta" / "gram_coop_testtime" / "run.json").read_text())
    assert run_info["mode"] == "testtime"
    assert {t["spec"]["views"] for k, t in tuned.items() if k != "tda_cache"} == {4}
    assert tuned["tda_cache"]["spec"]["views"] == settings.cache_views == 1  # the val choice, its own
    assert "## Test-time prompt tuning (TPT, 4 views" in (tmp_path / "results.md").read_text()
