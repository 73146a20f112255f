"""The demo's tables, method rows, settings and world selection (no training; seconds)."""

import json
import statistics
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gram_world.demo import (
    META_VARIANTS,
    METHOD_BY_KEY,
    METHODS,
    TABLE1_KEYS,
    TABLE4_KEYS,
    TABLE_GROUPS,
    TOKEN_KEYS,
    VARIANT_BY_NAME,
    DemoSettings,
    default_out,
    demo_world_settings,
    main,
    method_spec,
    settings_from_args,
)
from gram_world.demo.cli import _parser
from gram_world.demo.report import build_tables, markdown_table, tokens_markdown, transfer_markdown
from gram_world.demo.settings import (
    COMPONENT_KEYS,
    DEFAULT_TABLES,
    INIT_ONLY_KEYS,
    ONE_STEP_KEYS,
    OPT_IN_TABLES,
    REG_ONLY_KEYS,
    TABLE1_ROWS,
    b2n_keys,
    variants_needed,
)
from gram_world.demo.stages import check_settings
from meta.data.coop_data import harmonic_mean
from meta.evaluation import summarise
from meta.infra.cli_errors import UserError

DATASETS = ("WorldA", "WorldB")
FAMILY = ("WorldP", "WorldQ")
SKETCH = "WorldASketch"


def _b2n_records():
    out = []
    for d_i, dataset in enumerate(DATASETS):
        for m_i, m in enumerate(METHODS):
            for seed in (1, 2, 3):
                base = 40 + m_i + (3 * seed if d_i == 0 else -2 * seed)  # opposite seed effects
                new = 30 + 0.5 * m_i - seed + 2 * d_i
                out.append(
                    {
                        "protocol": "base2new",
                        "dataset": dataset,
                        "key": m.key,
                        "method": m.label,
                        "seed": seed,
                        "base": base,
                        "new": new,
                        "H": harmonic_mean(base, new),
                        "history": [],
                    }
                )
    return out


def _transfer_records(shots):
    out = []
    for m_i, m in enumerate(METHODS):
        for seed in (1, 2, 3):
            targets = {SKETCH: 20 + m_i + seed, FAMILY[0]: 50 + seed, FAMILY[1]: 60 - 2 * seed + m_i}
            out.append(
                {
                    "protocol": "transfer",
                    "dataset": "WorldA",
                    "key": m.key,
                    "method": m.label,
                    "seed": seed,
                    "shots": shots,
                    "source": 70 + m_i - seed,
                    "targets": targets,
                    "target_mean": statistics.fmean(targets.values()),
                    "history": [],
                }
            )
    return out


def _fake_world():
    roles = {"cross_domain_target": [SKETCH], "cross_dataset_target": list(FAMILY)}
    return SimpleNamespace(with_role=lambda role: [SimpleNamespace(name=n) for n in roles.get(role, [])])


def test_average_rows_average_datasets_per_seed_first_then_take_h_of_the_means():
    records = _b2n_records()
    rows = summarise(records, average="Average")
    for row in rows:
        runs = [
            r
            for r in records
            if r["key"] == row["key"] and (row["dataset"] == "Average" or r["dataset"] == row["dataset"])
        ]
        per_seed = {s: statistics.fmean(r["base"] for r in runs if r["seed"] == s) for s in (1, 2, 3)}
        assert row["base_mean"] == pytest.approx(statistics.fmean(per_seed.values()))
        assert row["base_std"] == pytest.approx(statistics.pstdev(per_seed.values()))
        assert row["H"] == pytest.approx(harmonic_mean(row["base_mean"], row["new_mean"]))
    avg = next(r for r in rows if r["dataset"] == "Average" and r["key"] == "coop")
    per_dataset = [r["base_std"] for r in rows if r["dataset"] in DATASETS and r["key"] == "coop"]
    # per-seed averaging is not the average of the per-dataset spreads (opposite seed effects cancel)
    assert avg["base_std"] == pytest.approx(statistics.pstdev([0.5, 1.0, 1.5])) and min(per_dataset) > 1.5
    assert avg["datasets"] == list(DATASETS)


def test_every_table_holds_its_paper_rows_under_stable_keys():
    settings = replace(DemoSettings(), tables=tuple(g for g in TABLE_GROUPS if g not in OPT_IN_TABLES))
    records = _b2n_records() + _transfer_records(16) + _transfer_records(4)
    tables = build_tables(records, settings, _fake_world())
    assert set(tables) == {"table1", "table2", "table3", "table4", "tableA1", "tableA2", "tableA3"}
    for tid, keys in (("table1", TABLE1_ROWS), ("table4", TABLE4_KEYS)):
        for dataset in DATASETS + ("Average",):
            assert [r["key"] for r in tables[tid]["rows"] if r["dataset"] == dataset] == list(keys)
    assert [METHOD_BY_KEY[k].label for k in TABLE1_KEYS] == [
        "CLIP",
        "CoOp",
        "CoOp + GRAM",
        "CoCoOp",
        "CoCoOp + GRAM, θ* only",
        "VPT",
        "VPT + GRAM",
        "UNIGRAM",
    ]
    assert [r["method"] for r in tables["table4"]["rows"][:6]] == [
        "UNIGRAM",
        "- domain shift simulating",
        "- gradient regulating",
        "- meta-learning = prompt pre-training",
        "- CHC = supervised meta-learning",
        "joint textual & visual prompt tuning",
    ]
    # Table 2: the held-out-style twin only; Table 3: the family datasets and their per-seed average
    t2, t3, a2 = tables["table2"], tables["table3"], tables["tableA2"]
    assert (t2["targets"], t3["targets"], t2["shots"], a2["shots"]) == ([SKETCH], list(FAMILY), 16, 4)
    assert [r["key"] for r in t3["rows"]] == list(TABLE1_KEYS)
    coop = next(r for r in t3["rows"] if r["key"] == "coop")
    per_seed = [statistics.fmean(r["targets"][f] for f in FAMILY) for r in _transfer_records(16) if r["key"] == "coop"]
    assert (coop["target_mean"], coop["target_std"]) == (
        pytest.approx(statistics.fmean(per_seed)),
        pytest.approx(statistics.pstdev(per_seed)),
    )
    assert list(next(r for r in t2["rows"] if r["key"] == "coop")["targets"]) == [SKETCH]
    # Table A3: 2 / 4 / 6 / 8 tokens, half text, half visual; 4 is UNIGRAM itself
    a3 = tables["tableA3"]["rows"]
    assert [(r["tokens"], r["text_tokens"], r["visual_tokens"], r["key"]) for r in a3] == [
        (2, 1, 1, "unigram_2tok"),
        (4, 2, 2, "unigram"),
        (6, 3, 3, "unigram_6tok"),
        (8, 4, 4, "unigram_8tok"),
    ]
    # markdown: one line per row plus header and rule
    assert markdown_table(tables["table1"]["rows"], "Average").count("\n") == len(TABLE1_ROWS) + 1
    assert transfer_markdown(t3).splitlines()[0].endswith("| target average |")
    assert "| target average" not in transfer_markdown(t2)
    assert tokens_markdown(tables["tableA3"]).count("\n") == 5


def test_only_the_requested_table_groups_are_built():
    tables = build_tables(_b2n_records(), DemoSettings(), _fake_world())
    assert set(tables) == {"table1"}
    # the default's Table 1: every row but the diagnostics; Table 4 comes with "ablations" (and "all")
    assert set(b2n_keys(DEFAULT_TABLES)) == set(TABLE1_ROWS) - set(REG_ONLY_KEYS + ONE_STEP_KEYS + ("gram_cocoop",))
    assert {"unigram_no_shift", "unigram_pretrain", "unigram_supervised"} == set(b2n_keys(("ablations",))) - set(
        b2n_keys(DEFAULT_TABLES)
    )
    assert {v.name for v in variants_needed(DEFAULT_TABLES)} == {
        "gram_coop",
        "gram_cocoop",
        "gram_vpt",
        "unigram",
        "unigram_no_reg",
    }
    ablations = build_tables(_b2n_records(), replace(DemoSettings(), tables=("ablations",)), _fake_world())
    assert set(ablations) == {"table4"}
    assert "ablations" in settings_from_args(_parser().parse_args(["--tables", "all"])).tables


def test_deep_group_is_opt_in_and_holds_ivlp_and_maple_with_their_variants():
    from gram_world.demo.settings import DEEP_KEYS, DEEP_VARIANTS, variants_needed

    assert "deep" not in settings_from_args(_parser().parse_args(["--tables", "all"])).tables
    assert settings_from_args(_parser().parse_args(["--tables", "base2new", "deep"])).tables == ("base2new", "deep")
    assert "deep" not in DemoSettings().tables
    tables = build_tables(_b2n_records(), replace(DemoSettings(), tables=("deep",)), _fake_world())
    assert set(tables) == {"deep"}
    for dataset in DATASETS + ("Average",):
        assert [r["key"] for r in tables["deep"]["rows"] if r["dataset"] == dataset] == list(DEEP_KEYS)
    assert variants_needed(("deep",)) == DEEP_VARIANTS
    maple = method_spec(METHOD_BY_KEY["gram_maple"], init="/x.safetensors")
    assert (maple.coupling, maple.text_depth, maple.n_ctx_text, maple.n_ctx_vision, maple.regulate) == (
        "maple",
        0,
        2,
        0,
        True,
    )
    ivlp = method_spec(METHOD_BY_KEY["ivlp"])
    assert (ivlp.text_depth, ivlp.vision_depth, ivlp.n_ctx_text, ivlp.n_ctx_vision) == (0, 0, 2, 2)


def test_method_rows_have_unique_keys_existing_presets_and_variants():
    from meta.evaluation import PRESET_NAMES

    assert len({m.key for m in METHODS}) == len(METHODS) and len({m.label for m in METHODS}) == len(METHODS)
    assert {
        "zsclip",
        "coop",
        "gram_coop",
        "vpt",
        "gram_vpt",
        "joint",
        "unigram",
        "unigram_no_shift",
        "unigram_no_reg",
        "unigram_pretrain",
        "unigram_supervised",
    } <= set(METHOD_BY_KEY)
    for m in METHODS:
        assert m.preset in PRESET_NAMES
        assert m.variant == "" or m.variant in VARIANT_BY_NAME
    # the GRAM rows start from the variant of the same name (Tables 1 and 4)
    for v in META_VARIANTS:
        assert METHOD_BY_KEY[v.name].variant == v.name
    assert set(TOKEN_KEYS) == {2, 4, 6, 8}
    spec = method_spec(METHOD_BY_KEY["unigram_8tok"], init="/x.safetensors")
    assert (spec.n_ctx_text, spec.n_ctx_vision, spec.regulate, spec.name) == (4, 4, True, "UNIGRAM, 8 prompt tokens")
    assert method_spec(METHOD_BY_KEY["unigram_no_reg"], init="/x.safetensors").regulate is False
    assert method_spec(METHOD_BY_KEY["vpt"]).vpt_init == DemoSettings().vpt_init
    assert method_spec(METHOD_BY_KEY["vpt"], settings=DemoSettings(vpt_init="cls")).prompt_spec().vpt_init == "cls"
    # component rows: θ* only = file's θ*, raw gradients; R_φ only = scratch θ, the file's R_φ
    init_only = method_spec(METHOD_BY_KEY["gram_coop_init_only"], init="/x.safetensors")
    reg_only = method_spec(
        METHOD_BY_KEY["gram_vpt_reg_only"], init="/x.safetensors", settings=DemoSettings(reg_window=20, launch=True)
    )
    assert (init_only.init_prompts, init_only.regulate, init_only.launch) == (True, False, DemoSettings().launch)
    assert (reg_only.init_prompts, reg_only.regulate, reg_only.reg_window, reg_only.launch) == (False, True, 20, True)
    assert (reg_only.n_ctx_text, reg_only.n_ctx_vision) == (0, 4)
    assert (
        method_spec(METHOD_BY_KEY["unigram_pretrain"], init="/x.safetensors", settings=DemoSettings(launch=True)).launch
        is False
    )  # nothing to launch
    # θ*-only rows are in the default tables; R_φ-only and one-step rows come with the diagnostics group
    default, diagnostics = set(b2n_keys(DEFAULT_TABLES)), set(b2n_keys(("diagnostics",)))
    assert set(INIT_ONLY_KEYS) <= default and not set(INIT_ONLY_KEYS) & diagnostics
    assert set(REG_ONLY_KEYS + ONE_STEP_KEYS + ("gram_cocoop",)) == diagnostics and not diagnostics & default
    assert set(COMPONENT_KEYS) == set(INIT_ONLY_KEYS + REG_ONLY_KEYS) <= set(TABLE1_ROWS)
    assert "diagnostics" not in OPT_IN_TABLES  # `--tables all` computes them
    # the paper-literal rows keep the per-image rule and no launch step whatever the settings say, and start
    # from a variant meta-trained on the one-step objective
    literal = method_spec(
        METHOD_BY_KEY["unigram_one_step"],
        init="/x.safetensors",
        settings=DemoSettings(reg_window=20, launch=True, query_before_weight=1.0),
    )
    assert (literal.init_prompts, literal.regulate, literal.reg_window, literal.launch) == (True, True, 1, False)
    variant = VARIANT_BY_NAME[METHOD_BY_KEY["unigram_one_step"].variant]
    assert dict(zip(variant.overrides[::2], variant.overrides[1::2]))["META.QUERY_BEFORE_WEIGHT"] == 0.0
    assert set(ONE_STEP_KEYS) <= set(TABLE1_ROWS)


def test_cocoop_rows_follow_coop_in_tables_1_to_3_and_leave_the_other_variants_alone():
    """CoCoOp and its θ*-only row stand after CoOp's rows in Table 1 (its R_φ rows with the diagnostics) and in
    Tables 2-3; they run the ``cocoop`` learner from the ``gram_cocoop`` variant, which alone names a learner."""
    settings = replace(DemoSettings(), tables=("base2new", "diagnostics", "transfer"))
    tables = build_tables(_b2n_records() + _transfer_records(16) + _transfer_records(4), settings, _fake_world())
    average = [r["key"] for r in tables["table1"]["rows"] if r["dataset"] == "Average"]
    cocoop_rows = ["cocoop", "gram_cocoop", "gram_cocoop_init_only", "gram_cocoop_reg_only"]
    at = average.index("cocoop")
    assert average[at - 1] == "gram_coop_one_step" and average[at : at + 4] == cocoop_rows and average[at + 4] == "vpt"
    assert [r["method"] for r in tables["table1"]["rows"][at : at + 4]] == [
        "CoCoOp",
        "CoCoOp + GRAM",
        "CoCoOp + GRAM, θ* only",
        "CoCoOp + GRAM, R_φ only",
    ]
    for tid in ("table2", "table3"):
        keys = [r["key"] for r in tables[tid]["rows"]]
        assert keys[keys.index("gram_coop") + 1 : keys.index("vpt")] == ["cocoop", "gram_cocoop_init_only"], tid
    assert {"cocoop", "gram_cocoop_init_only"} <= set(b2n_keys(DEFAULT_TABLES))
    assert "gram_cocoop" not in b2n_keys(DEFAULT_TABLES)
    for key in cocoop_rows:
        spec = method_spec(METHOD_BY_KEY[key], init="" if key == "cocoop" else "/x.safetensors")
        assert (spec.learner, spec.n_ctx_text, spec.n_ctx_vision) == ("cocoop", 4, 0), key
        assert METHOD_BY_KEY[key].variant == ("" if key == "cocoop" else "gram_cocoop"), key
    overrides = {v.name: dict(zip(v.prompt_overrides[::2], v.prompt_overrides[1::2])) for v in VARIANT_BY_NAME.values()}
    assert {n for n, o in overrides.items() if "META.PROMPT.LEARNER" in o} == {"gram_cocoop"}
    assert overrides["gram_cocoop"]["META.PROMPT.LEARNER"] == "cocoop"


def test_old_preset_names_are_silent_aliases_of_the_stable_keys():
    from meta.evaluation import method_preset

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert method_preset("coop_gram", in_memory=True) == method_preset("gram_coop", in_memory=True)
        assert method_preset("vpt_gram", in_memory=True) == method_preset("gram_vpt", in_memory=True)
    with pytest.raises(KeyError, match="unknown method preset 'no_such_method'"):
        method_preset("no_such_method")


def test_changed_settings_are_refused_but_jobs_and_tables_are_not_results(tmp_path):
    quick = DemoSettings.preset(quick=True)
    check_settings(quick, tmp_path)
    check_settings(replace(quick, jobs=1, tables=tuple(TABLE_GROUPS)), tmp_path)  # same results: fine
    with pytest.raises(UserError, match="other settings"):
        check_settings(DemoSettings.preset(quick=False), tmp_path)
    with pytest.raises(UserError, match=r"\(world_seed\)"):
        check_settings(replace(quick, world_seed=1), tmp_path)
    saved = json.loads((tmp_path / "demo_settings.json").read_text())
    assert saved["quick"] is True and "jobs" not in saved and "tables" not in saved
    # a folder written before the world fields existed is read with their preset values
    for key in ("world_seed", "world", "clip", "transfer_shots"):
        saved.pop(key)
    (tmp_path / "demo_settings.json").write_text(json.dumps(saved))
    check_settings(quick, tmp_path)
    # ... except a setting whose behaviour before the key differs from today's default: a folder
    # without vpt_init started its visual prompts from N(0, 0.02^2) and is not reused
    assert quick.vpt_init != "normal"
    saved.pop("vpt_init")
    (tmp_path / "demo_settings.json").write_text(json.dumps(saved))
    with pytest.raises(UserError, match=r"\(vpt_init\)"):
        check_settings(quick, tmp_path)
    check_settings(replace(quick, vpt_init="normal"), tmp_path)


def test_world_seed_and_world_options_change_the_world_hash_and_output_folder():
    quick = DemoSettings.preset(quick=True)
    args = _parser().parse_args(
        [
            "--quick",
            "--world-seed",
            "3",
            "--holdout-style",
            "cartoon",
            "--mixed-classes",
            "circle",
            "star",
            "square",
            "heart",
            "--tables",
            "all",
        ]
    )
    other = settings_from_args(args)
    assert other.world_seed == 3 and other.tables == tuple(g for g in TABLE_GROUPS if g not in OPT_IN_TABLES)  # opt-in
    ws = demo_world_settings(other)
    assert (ws.seed, ws.holdout_style) == (3, "cartoon")
    twin = next(p for p in ws.plans if "cross_domain_target" in p.roles)
    assert (twin.name, twin.styles, twin.classnames) == (
        "WorldMixedCartoon",
        ("cartoon",),
        ("circle", "heart", "square", "star"),
    )
    seed_only = replace(quick, world_seed=3)
    hashes = {demo_world_settings(s).checksum() for s in (quick, seed_only, other)}
    assert len(hashes) == 3
    assert default_out(quick).name == "demo_quick" and default_out(seed_only).name == "demo_quick_world3"
    assert default_out(other).name == f"demo_quick_world-{ws.checksum()}"
    # the default world's hash does not depend on the new field
    assert (
        demo_world_settings(replace(quick, world=(("mixed_classes", ()),))).checksum()
        == demo_world_settings(quick).checksum()
    )


def test_bad_world_options_give_one_line_errors(capsys):
    with pytest.raises(ValueError, match="WorldSettings has no field colour"):
        demo_world_settings(replace(DemoSettings(), world=(("colour", "red"),)))
    assert main(["--quick", "--mixed-classes", "circle", "--out", "/nonexistent/never"]) == 2
    assert "mixed_classes must be >= 2 distinct" in capsys.readouterr().err


def test_stage_world_builds_another_world_per_seed_and_reuses_it(tmp_path):
    """--world-seed: its own cache key, other images, its own CLIP; a rerun rebuilds nothing."""
    import numpy as np

    from gram_world.demo import stage_world

    tiny_world = (
        ("pretrain_size", 128),
        ("chc_size", 60),
        ("chc_shard_size", 30),
        ("labelled_per_class", 1),
        ("val_per_class", 1),
        ("test_per_class", 1),
    )
    tiny_clip = (("epochs", 1), ("batch_size", 64))
    base = replace(DemoSettings.preset(quick=True), world=tiny_world, clip=tiny_clip)
    w0, weights0, _, _ = stage_world(base, tmp_path, tmp_path / "worlds")
    w1, weights1, _, zeroshot1 = stage_world(replace(base, world_seed=1), tmp_path, tmp_path / "worlds")
    assert w0.settings_hash != w1.settings_hash and w0.root != w1.root
    assert w1.settings["seed"] == 1
    assert not np.array_equal(np.load(w0.pretrain_images), np.load(w1.pretrain_images))
    assert weights0 != weights1 and weights1.parent == w1.root / "clip"
    assert set(zeroshot1) == set(w1.datasets)
    stamps = {p: p.stat().st_mtime_ns for p in w1.root.rglob("*") if p.is_file()}
    again, weights_again, _, zeroshot_again = stage_world(replace(base, world_seed=1), tmp_path, tmp_path / "worlds")
    assert (again.root, weights_again, zeroshot_again) == (w1.root, weights1, zeroshot1)
    assert {p: p.stat().st_mtime_ns for p in w1.root.rglob("*") if p.is_file()} == stamps


def test_dumped_meta_config_reloads(tmp_path):
    """A run's saved config.yaml must merge back (yacs dumps "{}" as a yaml dict)."""
    from meta.config import get_meta_cfg_default, load_meta_cfg

    path = tmp_path / "config.yaml"
    path.write_text(get_meta_cfg_default().dump())
    assert load_meta_cfg(str(path)) == get_meta_cfg_default()


def test_a_folder_of_another_world_or_clip_is_refused(tmp_path):
    from gram_world.demo.stages import check_world

    world = SimpleNamespace(settings_hash="aaaaaaaaaaaa")
    check_world(tmp_path, world, tmp_path / "clip-1.safetensors")
    check_world(tmp_path, world, tmp_path / "clip-1.safetensors")
    with pytest.raises(
        UserError, match="world aaaaaaaaaaaa / CLIP clip-1.safetensors, this run uses bbbbbbbbbbbb / clip-1.safetensors"
    ):
        check_world(tmp_path, SimpleNamespace(settings_hash="bbbbbbbbbbbb"), tmp_path / "clip-1.safetensors")
    with pytest.raises(UserError, match="clip-2"):
        check_world(tmp_path, world, tmp_path / "clip-2.safetensors")


def test_demo_script_runs_the_demo_module():
    """``scripts/demo.sh`` execs ``python -m <module>`` from the checkout; that module's command line answers."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = (repo / "scripts" / "demo.sh").read_text()
    module = re.search(r'^exec "\$ROOT/\.venv/bin/python" -m (\S+) "\$@"$', script, re.M).group(1)
    assert module == "gram_world.demo"
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=repo, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python -m gram_world.demo") and "--world-seed" in proc.stdout


def test_the_consistency_group_is_opt_in_and_takes_the_b2n_sweeps_lambda(tmp_path, monkeypatch):
    import json

    from gram_world.demo import settings as demo_settings
    from gram_world.demo.report import markdown_table

    assert "consistency" not in settings_from_args(_parser().parse_args(["--tables", "all"])).tables
    published = ("coop", "coop@ct8", "vpt", "vpt@ci10", "joint", "joint@ct8_ci10")  # KgCoOp 8, PromptSRC 10
    assert demo_settings.consistency_keys(tmp_path / "absent.json") == published
    sweep = {
        "partial": False,
        "off_rule": [],
        "fixed": {
            "gram_coop": {"row": "coop", "lambda": [2.0, 0.0]},
            "gram_vpt": {"row": "vpt", "lambda": [0.0, 20.0]},
            "unigram": {"row": "joint", "lambda": [1.0, 1.25]},
        },
    }
    (tmp_path / "s.json").write_text(json.dumps(sweep))
    chosen = ("coop", "coop@ct2", "vpt", "vpt@ci20", "joint", "joint@ct1_ci1.25")
    assert demo_settings.consistency_keys(tmp_path / "s.json") == chosen
    (tmp_path / "p.json").write_text(json.dumps({**sweep, "partial": True}))  # an unfinished sweep chooses nothing
    assert demo_settings.consistency_keys(tmp_path / "p.json") == published
    monkeypatch.setattr(demo_settings, "SELECTION_B2N", tmp_path / "s.json")
    assert b2n_keys(("consistency",)) == chosen and variants_needed(("consistency",)) == ()
    records = [
        r | {"key": k, "method": demo_settings.method_row(k).label}
        for r in _b2n_records()
        for k in chosen
        if r["key"] == k.split("@")[0]
    ]
    tables = build_tables(records, replace(DemoSettings(), tables=("consistency",)), _fake_world())
    table = tables["consistency"]
    assert set(tables) == {"consistency"} and table["source"] == "chosen on val splits (s.json)"
    assert [r["key"] for r in table["rows"] if r["dataset"] == "Average"] == list(chosen)
    assert "| CoOp, λ text 2 |" in markdown_table(table["rows"], "Average")


def test_the_last_screen_is_the_first_table_its_file_and_for_quick_runs_the_wiring_note(tmp_path):
    """The demo ends on results.md's first table (with its heading), the file's absolute path and, for --quick, the
    note that its numbers are a wiring check; a full run gets no such note."""
    from gram_world.demo.report import last_screen

    md = tmp_path / "results.md"
    md.write_text(
        "# World demo\n\nsettings text\n\n## Table 1: base-to-new\n\n| method | H |\n| --- | --- |\n| CoOp | 61.2 |\n"
        "\n## Table 2\n\n| other | x |\n",
        encoding="utf-8",
    )
    quick = replace(DemoSettings(), quick=True)
    lines = last_screen(md, quick).splitlines()
    assert lines[:4] == ["## Table 1: base-to-new", "| method | H |", "| --- | --- |", "| CoOp | 61.2 |"]
    assert lines[5] == f"results: {md.resolve()}"
    assert lines[6].startswith(f"quick demo: a wiring check of every stage ({len(quick.seeds)} seed(s)")
    assert "its numbers are not results" in lines[6] and lines[-1] == lines[6]
    assert "| other | x |" not in lines
    full = last_screen(md, replace(DemoSettings(), quick=False)).splitlines()
    assert full[-1] == f"results: {md.resolve()}" and not any(ln.startswith("quick demo") for ln in full)
