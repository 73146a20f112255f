"""Every list of learners follows the method table (``meta/method/methods.yaml``): the golden fingerprint, the
benchmarks, the planner, the demo's deep group and the Dassl trainers take them and their prompt shapes from its
``learners:`` rows and their reference method rows, and a learner the tools have no figure for is a one-line
answer naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers_learner import KEY, low_rank_learner

from meta.method import methods

REPO = Path(__file__).resolve().parents[1]


def _spec(fields: dict):
    from meta.method.prompts import PromptSpec

    return PromptSpec(**fields)


def test_full_size_shapes_are_the_learners_meta_training_configs():
    # the benchmarks and the planner measure each learner as `python -m meta train` runs its config
    from gram_tools import bench_gpu, realsize
    from meta.config import load_meta_cfg
    from meta.metatrain.settings import prompt_spec

    learners = methods.learners()
    shapes = methods.learner_shapes("full")
    assert list(shapes) == [row.name for row in learners.values()]  # every learner, table order
    for name, fields in shapes.items():
        config = REPO / "configs" / "meta" / f"train_{name}.yaml"
        assert _spec(fields) == prompt_spec(load_meta_cfg(str(config), [])), name
    assert bench_gpu.VARIANTS == shapes
    assert bench_gpu.SCALING_VARIANTS == tuple(row.name for row in learners.values() if not row.deep)
    assert [n for n in realsize.LEARNERS if n in shapes] == list(shapes)
    for name, (extra, changes) in realsize.DEPTH_ROWS.items():
        assert realsize.LEARNERS[extra] == {**shapes[name], **changes}
    # the planner's shape rules land on a measured row for every learner's own config
    for name, fields in shapes.items():
        spec = _spec(fields)
        found = realsize.learner_of(
            spec.n_ctx_text, spec.n_ctx_vision, spec.vision_depth, spec.text_depth, spec.coupling, spec.learner
        )
        assert found == name


def test_tiny_shapes_are_the_reference_rows_and_the_configs_visual_start():
    # the golden fingerprint runs each learner as its reference row's evaluator preset shapes it on the test CLIP,
    # with the visual-token start its trainer configs set
    from dataclasses import replace

    from meta.evaluation.spec import method_preset
    from meta.fingerprint.golden import LEARNERS
    from meta.method.prompts import PromptSpec

    learners = methods.learners()
    assert (
        list(LEARNERS)
        == [row.name for row in learners.values()]
        == ["coop", "vpt", "unigram", "ivlp", "maple", "cocoop"]
    )
    for row in learners.values():
        preset = method_preset(row.name, init_path="init.safetensors" if methods.get(row.name).init else "")
        vpt_init = row.vpt_init or PromptSpec.vpt_init
        assert _spec(LEARNERS[row.name]) == replace(preset.prompt_spec(), vpt_init=vpt_init), row.name
        if not row.vision:
            continue
        for m in methods.methods().values():
            if m.trainer == row.trainer and m.dassl and not m.zero_shot:
                gram = yaml.safe_load((REPO / m.config).read_text())["TRAINER"]["GRAM"]
                assert gram.get("VPT_INIT", PromptSpec.vpt_init) == vpt_init, m.config
    assert [row.name for row in learners.values() if row.deep] == ["ivlp", "maple"]
    golden = json.loads((REPO / "meta" / "fingerprint" / "golden.json").read_text())
    assert {run.split("/")[0] for run in golden["runs"]} == set(LEARNERS)


def _table_with_toy_learner(tmp_path) -> Path:
    """The packaged table plus a learner ``GRAM_LowRank`` whose one method row uses the tests' toy prompt learner."""
    doc = yaml.safe_load(methods.TABLE_FILE.read_text())
    doc["learners"].append({"trainer": "GRAM_LowRank", "text": True, "vision": False, "coupling": "none"})
    doc["methods"].append(
        dict(
            key="low_rank",
            label="low-rank context",
            preset="low_rank",
            text_tokens=4,
            visual_tokens=0,
            init=False,
            regulate=False,
            zero_shot=False,
            trainer="GRAM_LowRank",
            config="configs/trainers/low_rank.yaml",
            learner=KEY,
        )
    )
    path = tmp_path / "methods.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return path


def test_a_learner_row_gives_its_name_and_shape_and_bad_fields_are_one_line_errors(tmp_path):
    table = methods.load_learners(_table_with_toy_learner(tmp_path))
    row = table["GRAM_LowRank"]
    assert row.name == "low_rank" and not row.deep
    assert (
        row.prompt_fields("tiny") == row.prompt_fields("full") == {"n_ctx_text": 4, "n_ctx_vision": 0, "learner": KEY}
    )
    assert table["GRAM_MaPLe"].prompt_fields("full")["text_depth"] == 9
    assert table["GRAM_MaPLe"].prompt_fields("tiny")["text_depth"] == 0
    with pytest.raises(methods.MethodTableError, match="prompt size 'huge'"):
        row.prompt_fields("huge")
    base = dict(label="A", preset="a", init=False, regulate=False, zero_shot=False, config="c.yaml", key="a")
    for learner, message in (
        ({"trainer": "T", "text": True, "vision": False, "vpt_init": "normal"}, "vpt_init must be a non-empty"),
        ({"trainer": "T", "text": True, "vision": False, "full_text_depth": -1}, "full_text_depth must be"),
        ({"trainer": "T", "text": True, "vision": False, "depth": 3}, "learners[0]: expected trainer"),
    ):
        path = tmp_path / "bad.yaml"
        row = dict(base, trainer="T", text_tokens=4, visual_tokens=0)
        path.write_text(yaml.safe_dump({"learners": [learner], "methods": [row]}))
        with pytest.raises(methods.MethodTableError) as err:
            methods.load_learners(path)
        assert message in str(err.value) and str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_bench_names_a_learner_it_has_no_shape_or_prompt_learner_for(tmp_path, monkeypatch):
    from gram_tools import bench_gpu

    with pytest.raises(ValueError) as err:
        bench_gpu.run("GRAM-Test-Tiny", "cpu", variants=("low_rank",), scaling_variants=())
    assert "\n" not in str(err.value) and "learner 'low_rank' has no prompt shape" in str(err.value)
    table = methods.load_learners(_table_with_toy_learner(tmp_path))
    monkeypatch.setattr(bench_gpu, "VARIANTS", {row.name: row.prompt_fields("full") for row in table.values()})
    with pytest.raises(ValueError) as err:  # the table names it, but its prompt learner is not registered
        bench_gpu.check_learners(["coop", "low_rank"])
    assert "\n" not in str(err.value) and "learner 'low_rank'" in str(err.value) and KEY in str(err.value)
    with low_rank_learner():
        size = {"way": 3, "support_shots": 1, "query_shots": 1, "meta_batch": 1, "steps": 10, "chc_batch": 2}
        result = bench_gpu.run(
            "GRAM-Test-Tiny",
            "cpu",
            warmup=0,
            repeats=1,
            size=size,
            chc_images=2,
            variants=("low_rank",),
            scaling_variants=(),
            chc_batches=(),
            matmul_n=16,
        )
    row = result["variants"]["low_rank"]
    assert row["second_order_step_s"] > 0 and row["second_order_tflop"] > 0


def test_planner_names_a_prompt_learner_without_figures(tmp_path, capsys):
    # META.PROMPT.LEARNER of the tests' toy learner with CoOp's token counts: CoOp's figures must not answer
    from gram_tools import plan
    from gram_tools.realsize import learner_of

    line = {"intercept": 100.0, "slopes": [1.0, 1.0]}
    fit = {"variables": ["support", "query"], "points": 4, "peak_mib": line, "gflops": line, "seconds": line}
    figures = tmp_path / "figures.json"
    figures.write_text(
        json.dumps({"settings": {"model": "ViT-B-16", "model_mib": 1.0}, "fits": {"coop": {"second": fit}}})
    )
    argv = ["--config-file", "configs/meta/train_coop.yaml", "--figures", str(figures)]
    argv += ["--gpu-figures", "absent.json", "--chc-figures", "absent.json"]
    assert learner_of(4, 0, 1, learner=KEY) == KEY
    with low_rank_learner():
        assert plan.main([*argv, "META.PROMPT.LEARNER", KEY]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"learner {KEY!r}" in err and "no fitted line" in err
    assert "meta/method/methods.yaml" in err  # realsize cannot measure it: no --learners command is suggested
    assert plan.main(argv) == 0  # the built-in learner at that shape is answered from CoOp's line
    capsys.readouterr()


def test_planner_says_which_learner_the_gpu_figures_lack(tmp_path, capsys):
    from gram_tools import plan

    line = {"intercept": 100.0, "slopes": [1.0, 1.0]}
    fit = {"variables": ["support", "query"], "points": 4, "peak_mib": line, "gflops": line, "seconds": line}
    figures = tmp_path / "figures.json"
    figures.write_text(json.dumps({"settings": {"model": "ViT-B-16"}, "fits": {"unigram": {"second": fit}}}))
    settings = {"way": 5, "support_shots": 4, "query_shots": 8, "meta_batch": 4, "gpu": "fake", "autocast": "none"}
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps({"settings": settings, "variants": {"coop": {"second_order_step_s": 1.0}}}))
    argv = ["--config-file", "configs/meta/train_unigram.yaml", "--figures", str(figures)]
    argv += ["--gpu-figures", str(gpu), "--chc-figures", "absent.json"]
    assert plan.main(argv) == 0
    hours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["meta_training"]["hours"]
    assert hours["how"].startswith("estimated") and "no second_order_step_s of learner 'unigram'" in hours["how"]


def test_demo_deep_group_is_every_deep_learner():
    from gram_world.demo.settings import DEEP_KEYS, DEEP_VARIANTS, METHOD_BY_KEY

    deep = {row.trainer for row in methods.learners().values() if row.deep}
    table = methods.methods()
    assert list(DEEP_KEYS) == [k for k, m in table.items() if m.trainer in deep]
    assert [v.name for v in DEEP_VARIANTS] == ["gram_ivlp", "gram_maple"]
    # every table row is a demo row, in the table's order, with its own meta variant or its preset's; only a row that
    # needs a GRAM file the demo meta-trains no variant for may be left out (none is, since CoCoOp's variant came)
    from gram_world.demo.settings import VARIANT_BY_NAME

    def has_variant(key: str) -> bool:
        return key in VARIANT_BY_NAME or table[key].preset in VARIANT_BY_NAME

    left_out = [k for k in table if k not in METHOD_BY_KEY]
    assert list(METHOD_BY_KEY) == [k for k in table if k not in left_out]
    assert all(table[k].gram_file and not has_variant(k) for k in left_out), left_out
    assert {"cocoop", "gram_cocoop", "gram_cocoop_init_only"} <= set(METHOD_BY_KEY)
    for key, row in METHOD_BY_KEY.items():
        assert row.variant in ("", key, table[key].preset) and bool(row.variant) == table[key].gram_file, key


def test_every_demo_row_and_variant_has_a_plot_colour_of_its_own():
    from matplotlib.colors import to_rgba

    from gram_world.demo.report import colour
    from gram_world.demo.settings import META_VARIANTS, METHOD_BY_KEY

    rows = {key: to_rgba(colour(key)) for key in METHOD_BY_KEY}
    assert len(set(rows.values())) == len(rows), rows  # no two rows share a bar / line colour
    for variant in META_VARIANTS:  # Fig. 3b draws each meta-training run; one that is no row still gets a colour
        assert len(to_rgba(colour(variant.name))) == 4


@pytest.mark.dassl
def test_a_table_learner_without_a_class_gets_one_and_the_package_exposes_every_trainer():
    pytest.importorskip("dassl", reason="Dassl not installed")
    from dassl.engine import TRAINER_REGISTRY

    import trainers.gram as package
    from trainers.gram import GRAM_CoOp, dassl_trainers

    learners = methods.learners()
    assert [cls.__name__ for cls in dassl_trainers.GRAM_TRAINERS] == list(learners)
    for name in learners:
        assert getattr(package, name) is TRAINER_REGISTRY.get(name) and name in package.__all__
    assert GRAM_CoOp is dassl_trainers.GRAM_CoOp
    table = methods.load_learners(REPO / "meta" / "method" / "methods.yaml")
    table["GRAM_New"] = methods.Learner("GRAM_New", True, True)
    made = dassl_trainers.trainer_classes(table, {"GRAM_CoOp": GRAM_CoOp})
    assert [cls.__name__ for cls in made] == list(table)
    assert made[0] is GRAM_CoOp and all(issubclass(cls, dassl_trainers._GramTrainer) for cls in made)
    assert made[-1].__module__ == dassl_trainers.__name__ and "visual tokens yes" in made[-1].__doc__


def test_a_learner_row_prompts_the_image_tower_exactly_when_its_reference_prompts_do():
    from meta.method.prompts import PromptSpec

    rows = methods.learners()
    for trainer, row in rows.items():
        spec = PromptSpec(**row.prompt_fields())
        assert row.prompts_image == spec.has_visual_prompts, trainer
    assert {t for t, row in rows.items() if not row.prompts_image} >= {"GRAM_CoOp", "GRAM_CoCoOp"}
