"""The learner table of ``meta/method/methods.yaml`` is the one place a prompt learner's structure is written:
every row reaches the Dassl registry, the trainer configs and the demo with the same structure."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from meta.method import methods

REPO = Path(__file__).resolve().parents[1]


def test_every_method_row_fits_its_learner_and_the_learners_follow_the_table():
    learners = methods.learners()
    assert list(learners) == ["GRAM_CoOp", "GRAM_VPT", "UNIGRAM", "GRAM_IVLP", "GRAM_MaPLe", "GRAM_CoCoOp"]
    for m in methods.methods().values():
        if not m.trainer or m.zero_shot:
            continue
        row = learners[m.trainer]
        assert (m.text_tokens > 0, m.visual_tokens > 0, m.coupling) == (row.text, row.vision, row.coupling), m.key


def _table(tmp_path, learners, rows) -> Path:
    base = dict(label="A", preset="a", init=False, regulate=False, zero_shot=False, config="c.yaml")
    path = tmp_path / "methods.yaml"
    path.write_text(yaml.safe_dump({"learners": learners, "methods": [dict(base, key=k, **r) for k, r in rows]}))
    return path


@pytest.mark.parametrize(
    "learners, row, message",
    [
        (
            [{"trainer": "T", "text": True, "vision": False}],
            dict(trainer="U", text_tokens=4, visual_tokens=0),
            "method 'a': trainer 'U' is not in 'learners'",
        ),
        (
            [{"trainer": "T", "text": True, "vision": False}],
            dict(trainer="T", text_tokens=2, visual_tokens=2),
            "method 'a': tokens 2+2 / coupling none do not fit learner 'T'",
        ),
        (
            [{"trainer": "T", "text": False, "vision": True, "coupling": "maple"}],
            dict(trainer="T", text_tokens=0, visual_tokens=2),
            "learner 'T': coupling must be none, or maple",
        ),
        (
            [{"trainer": "T", "text": "yes", "vision": False}],
            dict(trainer="T", text_tokens=4, visual_tokens=0),
            "learner 'T': text and vision must be true or false",
        ),
    ],
)
def test_a_row_that_does_not_fit_its_learner_is_a_one_line_error(tmp_path, learners, row, message):
    path = _table(tmp_path, learners, [("a", row)])
    with pytest.raises(methods.MethodTableError) as err:
        methods.load_learners(path)
    assert message in str(err.value) and str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_demo_variants_take_their_prompt_shape_from_the_table():
    from gram_world.demo.settings import ALL_VARIANTS, METHODS
    from gram_world.demo.stages import method_spec

    for v in ALL_VARIANTS:
        row = methods.get(v.name)
        pairs = dict(zip(v.prompt_overrides[::2], v.prompt_overrides[1::2]))
        assert (pairs["META.PROMPT.N_CTX_TEXT"], pairs["META.PROMPT.N_CTX_VISION"]) == (
            row.text_tokens,
            row.visual_tokens,
        )
        assert pairs.get("META.PROMPT.TEXT_DEPTH", 1) == row.text_depth
        assert pairs.get("META.PROMPT.COUPLING", "none") == row.coupling
    learners = methods.learners()
    for m in METHODS:
        table = methods.get(m.key)
        if not table.trainer or table.zero_shot:
            continue
        spec = method_spec(m, init="init.safetensors" if table.gram_file else "")
        learner = learners[table.trainer]
        assert (spec.n_ctx_text > 0, spec.n_ctx_vision > 0, spec.coupling) == (
            learner.text,
            learner.vision,
            learner.coupling,
        ), m.key


@pytest.mark.dassl
def test_every_learner_is_a_registered_trainer_and_every_config_builds_its_structure():
    pytest.importorskip("dassl", reason="Dassl not installed")
    from dassl.config import get_cfg_default
    from dassl.engine import TRAINER_REGISTRY

    import trainers  # noqa: F401  (registers the GRAM trainers)
    from trainers.gram import dassl_trainers
    from trainers.gram.config import TRAINER_COUPLING, TRAINER_PROMPTS, extend_cfg, gram_settings

    learners = methods.learners()
    assert [cls.__name__ for cls in dassl_trainers.GRAM_TRAINERS] == list(learners)
    for name, row in learners.items():
        cls = TRAINER_REGISTRY.get(name)
        assert issubclass(cls, dassl_trainers._GramTrainer) and cls.gram_trainer
        assert TRAINER_PROMPTS[name] == (row.text, row.vision)
        assert TRAINER_COUPLING.get(name, "none") == row.coupling
    for key in methods.dassl_keys():
        m = methods.get(key)
        cfg = get_cfg_default()
        extend_cfg(cfg)
        cfg.merge_from_file(str(REPO / m.config))
        cfg.TRAINER.NAME = m.trainer
        if cfg.TRAINER.GRAM.ENABLED:
            cfg.TRAINER.GRAM.INIT = "init.safetensors"  # the scripts pass the file; any path checks the keys
        s = gram_settings(cfg)
        assert s.coupling == learners[m.trainer].coupling
        if not m.zero_shot:
            assert (s.n_ctx_text, s.n_ctx_vision) == (m.text_tokens, m.visual_tokens), key
