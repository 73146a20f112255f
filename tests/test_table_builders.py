"""The spec builders of ``python -m meta train`` (:mod:`meta.metatrain.settings`) read the declared key -> field table
(``meta.config.KEY_FIELDS``, through :func:`meta.config.table_fields`): every SAME link of a META key moves exactly its
own field of the spec the builder returns, and nothing else, so the table and the builders cannot disagree."""

from __future__ import annotations

import dataclasses

import pytest

from meta.config import KEY_FIELDS, SAME, get_meta_cfg_default, table_fields
from meta.metatrain import settings

# the builder of each owner's spec from a META config
BUILDERS = {
    "PromptSpec": settings.prompt_spec,
    "RegulatorSpec": settings.regulator_spec,
    "ConsistencySpec": settings.consistency_spec,
    "MetaSpec": settings.meta_spec,
    "OuterSpec": settings.outer_spec,
    "TrainSpec": settings.val_train_spec,
    "StartSpec": settings.val_start_spec,
    "TestTimeSpec": settings.test_time_spec,  # META.TEST_TIME.* (META.MODE testtime's views)
}
# a value other than the default that the spec accepts, for the string fields
OTHER_WORDS = {
    "autocast": "bf16",
    "inner_support": "split",
    "task_batching": "on",
    "optimizer": "sgd",
    "form": "paper",
    "init": "normal",
    "ctx_init": "a photo of",
    "template": "itap of a {}.",
    "vpt_init": "normal",
    "coupling": "maple",
    "learner": "cocoop",
    "prototypes": "nearest",
}
LINKS = [link for link in KEY_FIELDS if link.key.startswith("META.") and link.relation == SAME]


def _other(link) -> object:
    """A value of the link's field type away from its default."""
    default = link.default()
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return round(default * 0.5 + 0.07, 6)
    if isinstance(default, tuple):
        return [0.5, 1.0]
    return OTHER_WORDS[link.field]


def _set(cfg, key: str, value) -> None:
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
        node = node[part]
    node[leaf] = value


def test_every_meta_key_of_the_table_has_a_builder():
    assert len(LINKS) >= 40 and {link.owner.split(":")[1] for link in LINKS} == set(BUILDERS)


@pytest.mark.parametrize("link", LINKS, ids=[link.key for link in LINKS])
def test_each_key_moves_exactly_its_field(link):
    owner = link.owner.split(":")[1]
    build = BUILDERS[owner]
    cfg = get_meta_cfg_default()
    if link.key == "META.PRETRAIN.LR":  # λ1 of prompt pre-training: the key acts in that mode only
        cfg.META.MODE = "pretrain"
    before = build(cfg)
    value = _other(link)
    _set(cfg, link.key, value)
    after = build(cfg)
    want = tuple(value) if isinstance(value, list) else value
    assert getattr(after, link.field) == want != getattr(before, link.field)
    moved = [f.name for f in dataclasses.fields(after) if getattr(after, f.name) != getattr(before, f.name)]
    assert moved == [link.field], moved


def test_a_saved_config_without_a_key_reads_its_field_default():
    """A checkpoint's config from before a key existed (the node lacks it) reads as the field's default."""
    cfg = get_meta_cfg_default()
    del cfg.META.PROMPT["COUPLING"]
    cfg.META.PROMPT.N_CTX_TEXT = 7
    fields = table_fields(cfg, "meta.method.prompts:PromptSpec", "META.PROMPT")
    assert fields["coupling"] == "none" and fields["n_ctx_text"] == 7
