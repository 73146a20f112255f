"""Options of R_φ and meta-training that were measured and dropped (meta.config.REMOVED_KEYS, docs/evidence.md
"Options removed"): setting one is a one-line migration error, a saved config or init file that records one at its
off value still loads as today's default, one that had it on is refused naming the file or key."""

import json
from pathlib import Path

import pytest
import torch
from helpers import minimal_cfg
from safetensors.torch import save_file
from yacs.config import CfgNode as CN

from meta.config import KEY_FIELDS, REMOVED, REMOVED_KEYS, get_meta_cfg_default, load_meta_cfg
from meta.finetune.init_io import InitMismatchError, load_gram_init
from meta.infra.cli_errors import UserError
from meta.metatrain import settings
from meta.method.regulator import GradientRegulator, RegulatorSpec
from trainers.gram.config import gram_settings

REPO = Path(__file__).resolve().parents[1]
META_REMOVED = [r.key for r in REMOVED_KEYS if r.key.startswith("META.")]
# a value each removed key once took that was not its off value
ON_VALUE = {
    "META.REGULATOR.GAMMA_BOUND": 0.25,
    "META.REGULATOR.NORM_PRESERVE": True,
    "META.REGULATOR.MIX": True,
    "META.REGULATOR.MIX_INIT": 0.5,
    "META.REGULATOR.HALVES": "beta",
    "META.REGULATOR.LEARN_LR": True,
    "META.TRAJECTORY_STATES": 4,
    "META.TRAJECTORY_WINDOWS": 20,
    "TRAINER.GRAM.NORM_PRESERVE": "on",
}


def _message(key: str) -> str:
    return f"{key} was removed: measured and dropped (docs/evidence.md, Options removed); delete the key"


def test_the_table_holds_every_removed_option_once_and_no_default_or_link_names_one():
    assert sorted(REMOVED) == sorted(ON_VALUE)
    defaults = settings.flatten_cfg(get_meta_cfg_default())
    assert not set(defaults) & set(REMOVED)
    assert not {k.key for k in KEY_FIELDS} & set(REMOVED)
    field_names = {f for f in RegulatorSpec.__dataclass_fields__}
    assert not field_names & {r.field for r in REMOVED_KEYS if r.field}


@pytest.mark.parametrize("key", META_REMOVED)
def test_a_removed_meta_key_as_an_override_is_a_one_line_migration_error(key):
    with pytest.raises(UserError) as err:
        load_meta_cfg("", [key, str(ON_VALUE[key])])
    assert str(err.value) == f"command-line override: {_message(key)}"
    with pytest.raises(UserError, match="META.REGULATOR.MIX was removed"):  # at its old off value too: delete it
        load_meta_cfg("", ["META.INNER_LR", "0.2", "META.REGULATOR.MIX", "False"])


@pytest.mark.parametrize("key", ["META.REGULATOR.NORM_PRESERVE", "META.TRAJECTORY_STATES"])
def test_a_removed_meta_key_in_a_config_file_names_the_file(tmp_path, key):
    parts = key.split(".")
    tree: dict = {}
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = REMOVED[key].off
    tree["META"]["INNER_LR"] = 0.2
    path = tmp_path / "old.yaml"
    path.write_text(json.dumps(tree))  # JSON is YAML
    with pytest.raises(UserError) as err:
        load_meta_cfg(str(path))
    assert str(err.value) == f"{path}: {_message(key)}"
    del node[parts[-1]]
    path.write_text(json.dumps(tree))
    assert load_meta_cfg(str(path)).META.INNER_LR == 0.2  # without the key the file reads


def test_the_committed_meta_configs_still_load():
    for path in sorted((REPO / "configs" / "meta").glob("*.yaml")):
        load_meta_cfg(str(path))


@pytest.mark.parametrize("how", ["override", "file"])
def test_trainer_gram_norm_preserve_is_a_one_line_migration_error(tmp_path, how):
    cfg = minimal_cfg("GRAM_VPT")
    if how == "override":
        cfg.merge_from_list(["TRAINER.GRAM.NORM_PRESERVE", "on"])
    else:
        path = tmp_path / "gram_vpt.yaml"
        path.write_text("TRAINER:\n  GRAM:\n    NORM_PRESERVE: auto\n")
        cfg.merge_from_file(str(path))
    with pytest.raises(ValueError) as err:
        gram_settings(cfg, "GRAM_VPT")
    assert str(err.value) == _message("TRAINER.GRAM.NORM_PRESERVE")
    assert gram_settings(minimal_cfg("GRAM_VPT"), "GRAM_VPT").n_ctx_vision == 4  # unset: the trainer reads


def _saved(**regulator) -> CN:
    """A checkpoint's config as an older run wrote it: every removed key at its off value, ``regulator`` over it."""
    cfg = get_meta_cfg_default()
    text = cfg.dump()
    saved = CN.load_cfg(text)
    saved.META.TRAJECTORY_STATES = 0
    saved.META.TRAJECTORY_WINDOWS = 0
    for r in REMOVED_KEYS:
        if r.key.startswith("META.REGULATOR."):
            saved.META.REGULATOR[r.key.rsplit(".", 1)[1]] = r.off
    for k, v in regulator.items():
        node, name = (saved.META.REGULATOR, k) if not k.startswith("TRAJECTORY") else (saved.META, k)
        node[name] = v
    return saved


def test_a_saved_run_config_with_removed_keys_off_reads_and_resumes_as_today():
    saved = _saved(MIX_INIT=0.7, TRAJECTORY_WINDOWS=20)  # both without effect while MIX / TRAJECTORY_STATES are off
    assert settings.regulator_spec(saved) == RegulatorSpec()
    assert settings.meta_spec(saved) == settings.meta_spec(get_meta_cfg_default())
    now = settings.result_defining_cfg(get_meta_cfg_default())
    assert settings.cfg_differences(settings.result_defining_cfg(saved), now) == []


@pytest.mark.parametrize("key", META_REMOVED)
def test_a_saved_run_config_with_a_removed_option_on_is_refused(key):
    name = key.rsplit(".", 1)[1]
    # a key that acts only with another removed one is on with it; the error then names that one
    needs = {"MIX_INIT": ("MIX", True), "TRAJECTORY_WINDOWS": ("TRAJECTORY_STATES", 4)}.get(name)
    extra = {needs[0]: needs[1]} if needs else {}
    named = key.rsplit(".", 1)[0] + "." + needs[0] if needs else key
    saved = _saved(**extra, **{name: ON_VALUE[key]})
    with pytest.raises(ValueError, match=f"^{named} is .* in this saved config, an option that was removed"):
        settings.meta_spec(saved)
    diffs = settings.cfg_differences(settings.result_defining_cfg(saved), settings.result_defining_cfg(_saved()))
    assert any(d.startswith(f"{named}: ") for d in diffs)  # a resume of that run is refused too


def _init_file(tmp_path: Path, regulator_record: dict) -> tuple[Path, GradientRegulator]:
    """An init file as the exporter at b3be65a wrote it: the spec record with every field, γ/β tensors."""
    torch.manual_seed(3)
    reg = GradientRegulator(4, RegulatorSpec(init="normal", init_std=0.3))
    tensors = {"prompt.ctx": torch.randn(3, 4)}
    tensors.update({f"regulator.ctx.{k}": v.detach().clone() for k, v in reg.state_dict().items()})
    meta = {
        "format_version": 1,
        "backbone": {"model_name": "T", "weights": "", "text_width": 4, "vision_width": 4, "vision_layers": 1},
        "prompt": {"n_ctx_text": 3, "n_ctx_vision": 0, "vision_depth": 0},
        "regulator": regulator_record,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "provenance": {},
    }
    path = tmp_path / "init.safetensors"
    save_file(tensors, str(path), metadata={"gram": json.dumps(meta)})
    return path, reg


OLD_RECORD = {
    "form": "residual",
    "input_norm": True,
    "beta_scale": "grad_rms",
    "init": "normal",
    "init_std": 0.3,
    "gamma_bound": 1.0,
    "norm_preserve": False,
    "mix": False,
    "mix_init": 0.0,
    "halves": "both",
    "learn_lr": False,
}


def test_an_init_file_recording_the_removed_options_off_loads_as_today(tmp_path):
    path, reg = _init_file(tmp_path, {**OLD_RECORD, "mix_init": 0.4})  # mix_init acted only with mix
    init = load_gram_init(path)
    assert init.metadata["regulator"] == RegulatorSpec(init="normal", init_std=0.3).as_dict()
    loaded = init.regulator_modules()["ctx"]
    g = torch.randn(3, 4)
    torch.testing.assert_close(loaded(g), reg(g), rtol=0, atol=0)


@pytest.mark.parametrize("field, value", [("norm_preserve", True), ("halves", "gamma"), ("gamma_bound", 0.05)])
def test_an_init_file_recording_a_removed_option_on_is_refused_naming_the_file(tmp_path, field, value):
    path, _ = _init_file(tmp_path, {**OLD_RECORD, field: value})
    key = next(r.key for r in REMOVED_KEYS if r.field == field)
    with pytest.raises(InitMismatchError) as err:
        load_gram_init(path, config_key="TRAINER.GRAM.INIT")
    line = str(err.value)
    assert line.startswith(f"TRAINER.GRAM.INIT: {path}: regulator.{field}: ")
    assert str(value).lower() in line.split(": ")[3]  # the value the file records
    assert f": {key} was removed (measured and dropped" in line
    assert "\n" not in line and "b3be65a" in line


def test_the_committed_regulator_sweep_still_reads_and_ranks_as_written():
    from gram_world import study

    data = json.loads((REPO / "docs/study/selection_regulator.json").read_text())
    per = {}
    for name, table in data["cells"].items():
        variant, world, seed = name.split("/")
        per.setdefault(variant, {})[(world, int(seed))] = study.table_from_json(table)
    ranked = study.rank_regulator_variants(per, worlds=tuple(data["worlds_done"]))
    assert ranked["chosen"] == data["chosen"] == "beta_only"
    assert [(r["variant"], r["overrides"]) for r in ranked["rows"]] == [
        (r["variant"], r["overrides"]) for r in data["rows"]
    ]
    assert study.regulator_markdown(ranked) == (REPO / "docs/study/selection_regulator.md").read_text()
    assert set(study.REGULATOR_SWEEP) == {"k1", "k4"}
