"""The META yacs defaults build exactly the dataclass defaults (MetaSpec, OuterSpec, RegulatorSpec, PromptSpec).

Fields are enumerated with ``dataclasses.fields``: a field added to a spec without its yacs key (or
with a different default there) fails here.  Two fields have their own encoding: ``BETA_SCALE`` (yacs ``0.0`` or
less stands for the dataclass default ``"grad_rms"``, a positive number for itself) and R_φ's ``context``, the width
of the prototype context that ``META.TEST_TIME.PROTOTYPES`` other than none gives under ``META.MODE testtime``.
"""

import dataclasses

import pytest

from meta.config import get_meta_cfg_default
from meta.metatrain.outer import OuterSpec
from meta.metatrain.settings import add_metatrain_cfg, meta_spec, outer_spec, prompt_spec, regulator_spec
from meta.method.gram import MetaSpec
from meta.method.prompts import VPT_INITS, PromptSpec
from meta.method.regulator import RegulatorSpec

# dataclass field -> META key, where it is not simply the upper-cased field name in the spec's node
KEY_OF = {
    (MetaSpec, "regulator"): "REGULATOR",
    (OuterSpec, "regulator_weight_decay"): "REGULATOR.WEIGHT_DECAY",
    (RegulatorSpec, "context"): "TEST_TIME.PROTOTYPES",
}
NODE_OF = {MetaSpec: "", OuterSpec: "", RegulatorSpec: "REGULATOR.", PromptSpec: "PROMPT."}
BUILD = {MetaSpec: meta_spec, OuterSpec: outer_spec, RegulatorSpec: regulator_spec, PromptSpec: prompt_spec}
# a valid non-default value for each string field (a new string field must be added here)
OTHER_STR = {
    "optimizer": "sgd",
    "autocast": "bf16",
    "form": "paper",
    "init": "normal",
    "ctx_init": "a photo of a",
    "template": "itap of a {}.",
    "vpt_init": next(v for v in VPT_INITS if v != PromptSpec.vpt_init),
    "coupling": "maple",
    "inner_support": "split",
    "task_batching": "off",
    "learner": "a_learner_of_your_own",  # read as given; META.PROMPT.LEARNER is checked against the registry later
}


def _cfg():
    cfg = get_meta_cfg_default()
    if "META" not in cfg:
        add_metatrain_cfg(cfg)
    return cfg


def _key(spec_cls, field):
    return "META." + KEY_OF.get((spec_cls, field.name), NODE_OF[spec_cls] + field.name.upper())


def _node_and_leaf(cfg, key):
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
        node = node[part]
    return node, leaf


@pytest.mark.parametrize("spec_cls", [MetaSpec, OuterSpec, RegulatorSpec, PromptSpec], ids=lambda c: c.__name__)
def test_default_yacs_config_builds_the_dataclass_defaults(spec_cls):
    cfg = _cfg()
    built, default = BUILD[spec_cls](cfg), spec_cls()
    fields = dataclasses.fields(spec_cls)
    assert len(fields) >= 5
    for field in fields:
        node, leaf = _node_and_leaf(cfg, _key(spec_cls, field))
        assert leaf in node, f"{spec_cls.__name__}.{field.name} has no yacs key {_key(spec_cls, field)}"
        assert getattr(built, field.name) == getattr(default, field.name), (
            f"{_key(spec_cls, field)} default builds {getattr(built, field.name)!r}, "
            f"{spec_cls.__name__}.{field.name} defaults to {getattr(default, field.name)!r}"
        )
    assert built == default


def _other_value(name, value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 if value > 0 else 0.25
    return OTHER_STR[name]


@pytest.mark.parametrize("spec_cls", [MetaSpec, OuterSpec, RegulatorSpec, PromptSpec], ids=lambda c: c.__name__)
def test_every_field_is_read_from_its_yacs_key(spec_cls):
    """Changing each key alone changes exactly its field (the key is wired, not just present)."""
    default = spec_cls()
    for field in dataclasses.fields(spec_cls):
        if dataclasses.is_dataclass(getattr(default, field.name)) or field.name in ("beta_scale", "context"):
            continue  # the regulator node is checked field by field above; BETA_SCALE and the context below
        cfg = _cfg()
        node, leaf = _node_and_leaf(cfg, _key(spec_cls, field))
        node[leaf] = _other_value(field.name, node[leaf])
        built = BUILD[spec_cls](cfg)
        changed = [f.name for f in dataclasses.fields(spec_cls) if getattr(built, f.name) != getattr(default, f.name)]
        assert changed == [field.name], (field.name, changed)
        assert getattr(built, field.name) == node[leaf]


def test_beta_scale_encoding():
    cfg = _cfg()
    assert cfg.META.REGULATOR.BETA_SCALE == 0.0 and regulator_spec(cfg).beta_scale == "grad_rms"
    cfg.META.REGULATOR.BETA_SCALE = -1.0
    assert regulator_spec(cfg).beta_scale == "grad_rms"
    cfg.META.REGULATOR.BETA_SCALE = 1.0
    assert regulator_spec(cfg).beta_scale == 1.0 and meta_spec(cfg).regulator.beta_scale == 1.0


def test_the_regulator_context_comes_from_the_prototypes_under_testtime_only():
    from meta.method.prototypes import CONTEXT_DIM

    cfg = _cfg()
    assert regulator_spec(cfg).context == 0
    cfg.META.TEST_TIME.PROTOTYPES = "nearest"
    assert regulator_spec(cfg).context == 0  # META.MODE gram: no prototypes (check_meta_cfg refuses the pair)
    cfg.META.MODE = "testtime"
    assert regulator_spec(cfg).context == CONTEXT_DIM == 2 and meta_spec(cfg).regulator.context == 2
