"""The method table meta/method/methods.yaml: it loads, its keys, files and labels agree with every reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meta.evaluation import PRESET_ALIASES, PRESET_NAMES, method_preset
from meta.method import methods

REPO = Path(__file__).resolve().parents[1]
# read without meta.method.methods
RAW = yaml.safe_load((REPO / "meta" / "method" / "methods.yaml").read_text())["methods"]


def test_packaged_table_loads_with_unique_keys_aliases_and_labels():
    table = methods.methods()
    assert list(table) == [r["key"] for r in RAW]
    names = [n for m in table.values() for n in (m.key, *m.aliases)]
    assert len(names) == len(set(names)) and len({m.label for m in table.values()}) == len(table)
    # the paper's rows (Tables 1, 4, A3) and the Dassl methods the scripts run
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
        "unigram_2tok",
        "unigram_6tok",
        "unigram_8tok",
        "gram_coop_init_only",
        "gram_coop_reg_only",
        "gram_vpt_init_only",
        "gram_vpt_reg_only",
        "unigram_reg_only",
        "ivlp",
        "gram_ivlp",
        "maple",
        "gram_maple",
    } <= set(table)
    assert methods.dassl_keys()[:5] == ("zsclip", "coop", "gram_coop", "gram_coop_init_only", "gram_coop_reg_only")
    assert {
        "vpt",
        "gram_vpt",
        "unigram",
        "joint",
        "unigram_reg_only",
        "ivlp",
        "gram_ivlp",
        "maple",
        "gram_maple",
    } <= set(methods.dassl_keys())
    assert methods.canonical_key("coop_gram") == "gram_coop" and methods.get("vpt_gram").key == "gram_vpt"


def test_component_rows_take_one_part_of_gram_each():
    """θ*-only rows: the file's start, raw gradients; R_φ-only rows: the scratch start, the file's R_φ."""
    from meta.evaluation.spec import table_fields

    for key, (init, regulate) in {
        "gram_coop_init_only": (True, False),
        "gram_coop_reg_only": (False, True),
        "gram_vpt_init_only": (True, False),
        "gram_vpt_reg_only": (False, True),
        "unigram_reg_only": (False, True),
        "unigram_no_reg": (True, False),
    }.items():
        row = methods.get(key)
        assert (row.init, row.regulate) == (init, regulate)
        fields = table_fields(key)
        assert (fields["init_prompts"], fields["regulate"]) == (init, regulate)
        spec = method_preset(row.preset, init_path="/x.safetensors", **fields)
        assert (spec.init_prompts, spec.regulate) == (init, regulate)


def test_a_component_row_needs_a_gram_preset(tmp_path):
    bad = [dict(r) for r in RAW]
    bad.append(
        {
            "key": "coop_reg",
            "label": "CoOp, R only",
            "preset": "coop",
            "text_tokens": 4,
            "visual_tokens": 0,
            "init": False,
            "regulate": True,
            "zero_shot": False,
        }
    )
    path = tmp_path / "methods.yaml"
    path.write_text(yaml.safe_dump({"methods": bad}, allow_unicode=True))
    with pytest.raises(methods.MethodTableError, match="'coop_reg': init/regulate need a GRAM init file"):
        methods.load_methods(path)


def test_setup_ships_the_table_as_package_data():
    text = (REPO / "setup.py").read_text()
    assert '"methods.yaml"' in text and '"pyyaml' in text.lower()


def test_every_trainer_config_is_named_by_exactly_one_row_and_exists():
    named = {m.config: m.key for m in methods.methods().values() if m.dassl}
    for config in named:
        assert (REPO / config).is_file(), config
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "configs" / "trainers").rglob("*.yaml")}
    assert on_disk == set(named)
    for config, key in named.items():
        folder = Path(config).parent
        if folder == Path("configs/trainers"):
            assert Path(config).stem == key  # the scripts' output folders and the configs share the key
        else:  # a fork's naming: configs/trainers/<TRAINER>/<CFG>.yaml, as the fork's scripts build the path
            assert folder.name == methods.get(key).trainer, config


def test_evaluator_presets_are_the_table_rows():
    assert (
        PRESET_NAMES
        == methods.preset_keys()
        == (
            "zsclip",
            "coop",
            "gram_coop",
            "vpt",
            "gram_vpt",
            "unigram",
            "joint",
            "ivlp",
            "gram_ivlp",
            "maple",
            "gram_maple",
            "cocoop",
            "gram_cocoop",
        )
    )
    assert PRESET_ALIASES == {"coop_gram": "gram_coop", "vpt_gram": "gram_vpt"}
    for raw in RAW:
        if raw["preset"] != raw["key"]:
            continue
        spec = method_preset(raw["key"], init_path="/x.safetensors" if raw["init"] else "")
        assert spec.name == raw["label"]
        assert (spec.n_ctx_text, spec.n_ctx_vision, spec.regulate) == (
            raw["text_tokens"],
            raw["visual_tokens"],
            raw["regulate"],
        )
        assert spec.zero_shot == raw["zero_shot"]
        assert (spec.text_depth, spec.vision_depth, spec.coupling) == (
            raw.get("text_depth", 1),
            raw.get("vision_depth", 1),
            raw.get("coupling", "none"),
        )


def test_parser_labels_are_the_table_labels(tmp_path):
    """parse_results prints the table's label for every key (and a foreign key as itself)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import parse_results
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert parse_results.METHOD_ORDER == [r["key"] for r in RAW]
    for raw in RAW:
        assert parse_results.method_table.label(raw["key"]) == raw["label"]
    assert parse_results.method_table.label("CoCoOp/vit_b16") == "CoCoOp/vit_b16"
    for side, sub, end in (("base", "train_base", "Finish training"), ("new", "test_new", "=> result")):
        run = tmp_path / "base2new" / sub / "dtd" / "shots_16" / "gram_coop" / "seed1"
        run.mkdir(parents=True)
        (run / "log.txt").write_text(f"{end}\n* accuracy: 50.0%\n")
    assert parse_results.main([str(tmp_path), "--out", str(tmp_path / "t")]) == 0
    md = (tmp_path / "t" / "base2new_shots16.md").read_text()
    assert "| CoOp + GRAM | 50.00" in md


def _write(tmp_path, rows) -> Path:
    path = tmp_path / "methods.yaml"
    path.write_text(yaml.safe_dump({"methods": rows}))
    return path


ROW = dict(key="a", label="A", preset="a", text_tokens=4, visual_tokens=0, init=False, regulate=False, zero_shot=False)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([ROW, dict(ROW, label="B")], "method key or alias 'a' appears twice"),
        ([ROW, dict(ROW, key="b")], "label(s) 'A' used by more than one method"),
        ([dict(ROW, colour="red")], "method 'a': unknown field(s) colour"),
        ([{k: v for k, v in ROW.items() if k != "init"}], "method 'a': missing field(s) init"),
        ([dict(ROW, init="yes")], "method 'a': field 'init' must be true or false, got 'yes'"),
        ([dict(ROW, text_tokens=-1)], "method 'a': field 'text_tokens' must be an integer >= 0"),
        ([dict(ROW, preset="zz")], "method 'a': preset 'zz' is not a row whose preset is itself"),
        ([dict(ROW, trainer="GRAM_CoOp")], "method 'a': give both 'trainer' and 'config' or neither"),
        ([dict(ROW, regulate=True)], "method 'a': init/regulate need a GRAM init file, but its preset 'a'"),
        ([dict(ROW, label="- a part")], "method 'a': label '- a part' reads only under another row; give it a full"),
        ([dict(ROW, full_label="")], "method 'a': field 'full_label' must be a non-empty string"),
        ([], "expected a top-level 'methods:' list"),
    ],
)
def test_bad_tables_are_one_line_errors_naming_file_and_key(tmp_path, rows, message):
    path = _write(tmp_path, rows)
    with pytest.raises(methods.MethodTableError) as err:
        methods.load_methods(path)
    text = str(err.value)
    assert message in text and text.startswith(str(path)) and "\n" not in text


def test_standalone_labels_name_the_parent_row_of_table4_ablations():
    """A row whose label reads only under another row ("- gradient regulating" under UNIGRAM) names that row where
    it stands alone; every other row stands alone under its own label, and the demo's derived rows keep the suffix."""
    from gram_world.demo.settings import method_row

    table = methods.load_methods()
    ablations = [m for m in table.values() if m.label.startswith("- ")]
    assert len(ablations) == 4
    for m in ablations:
        assert m.standalone_label.startswith(table[m.preset].label + " ") and "- " not in m.standalone_label
    assert all(m.standalone_label == m.label for m in table.values() if m not in ablations)
    assert method_row("unigram_no_reg").standalone_label == "UNIGRAM without gradient regulating"
    assert method_row("coop@ct1").standalone_label == method_row("coop@ct1").label == "CoOp, λ text 1"


def test_unreadable_and_invalid_yaml_files(tmp_path):
    with pytest.raises(methods.MethodTableError, match="cannot read the method table .*nope.yaml"):
        methods.load_methods(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("methods: [\n")
    with pytest.raises(methods.MethodTableError, match="bad.yaml is not valid YAML"):
        methods.load_methods(bad)


def test_query_cli_for_shell_scripts():
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "meta.method.methods", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )

    r = cli("get", "gram_vpt", "trainer")
    assert (r.returncode, r.stdout) == (0, "GRAM_VPT\n")
    assert cli("get", "coop_gram", "init").stdout == "true\n"
    assert cli("keys", "--dassl").stdout.split() == list(methods.dassl_keys())
    r = cli("get", "no_such_method", "trainer")
    assert r.returncode == 1 and r.stderr.startswith("unknown method 'no_such_method': expected one of zsclip coop")
    assert len(r.stderr.strip().splitlines()) == 1
    assert "CoOp + GRAM" in cli().stdout
