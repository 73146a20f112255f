"""Dassl-free tests of the GRAM trainer config: extend_cfg defaults, resolution, method configs."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import yaml
from helpers import minimal_cfg
from yacs.config import CfgNode as CN

from meta.finetune.regulated import DEFAULT_LAUNCH, DEFAULT_REG_WINDOW
from meta.method import methods
from trainers.gram.config import (
    TRAINER_PROMPTS,
    default_weights_path,
    effective_num_workers,
    effective_settings_line,
    extend_cfg,
    gram_settings,
    open_clip_name,
    resolve_precision,
)

REPO = Path(__file__).resolve().parents[1]
METHOD_TRAINER = {k: methods.get(k).trainer for k in methods.dassl_keys()}


def test_extend_cfg_adds_every_key_with_paper_defaults():
    cfg = minimal_cfg()
    g = cfg.TRAINER.GRAM
    assert set(g.keys()) == {
        "ENABLED",
        "INIT",
        "REGULATE",
        "NORM_PRESERVE",
        "N_CTX_TEXT",
        "N_CTX_VISION",
        "VPT_DEEP",
        "VPT_DEPTH",
        "CTX_INIT",
        "TEMPLATE",
        "VPT_INIT",
        "MODEL_NAME",
        "WEIGHTS",
        "QUICK_GELU",
        "PREC",
        "TEXT_DEPTH",
        "INIT_PROMPTS",
        "REG_WINDOW_IMAGES",
        "REG_WINDOW",
        "LAUNCH",
        "CONSISTENCY_TEXT",
        "CONSISTENCY_IMAGE",
        "LEARNER",
        "LEARNER_MODULES",
        "EXIF_UPRIGHT",
        "TEST_TIME",
    }
    t = g.TEST_TIME  # off; TPT's protocol (views, share, steps, lr, AdamW's weight decay) when ENABLED
    assert (t.ENABLED, t.VIEWS, t.CONFIDENT_SHARE, t.STEPS, t.LR, t.WEIGHT_DECAY) == (False, 64, 0.1, 1, 5e-3, 0.01)
    assert t.OPTIMIZER == "adamw"  # TPT's; meta = the init file's meta-trained step
    assert g.LEARNER == "clip"  # the built-in prompt learner (meta.method.learners)
    assert g.EXIF_UPRIGHT is False  # images as stored, as Dassl's read_image reads them
    assert (g.N_CTX_TEXT, g.N_CTX_VISION, g.VPT_DEEP, g.ENABLED, g.REGULATE) == (4, 4, False, False, True)
    assert (g.INIT_PROMPTS, g.REG_WINDOW_IMAGES, g.LAUNCH) == (True, DEFAULT_REG_WINDOW, DEFAULT_LAUNCH)
    assert g.REG_WINDOW is None  # the old key (batches) is kept only to refuse it
    assert g.NORM_PRESERVE is None  # a removed option, kept only to refuse it (tests/test_removed_options.py)
    assert (g.CONSISTENCY_TEXT, g.CONSISTENCY_IMAGE) == (0.0, 0.0)  # off: the plain cross-entropy
    assert cfg.DATASET.SUBSAMPLE_CLASSES == "all"


def test_extend_cfg_keeps_keys_a_fork_already_added_and_is_idempotent():
    cfg = CN()
    cfg.TRAINER = CN()
    cfg.TRAINER.NAME = "GRAM_CoOp"
    cfg.TRAINER.GRAM = CN()
    cfg.TRAINER.GRAM.N_CTX_TEXT = 8  # fork's own value
    cfg.TRAINER.GRAM.FORK_ONLY = "x"  # a key we do not know
    cfg.DATASET = CN()
    cfg.DATASET.SUBSAMPLE_CLASSES = "base"  # CoOp's extend_cfg ran first
    extend_cfg(cfg)
    extend_cfg(cfg)
    assert cfg.TRAINER.GRAM.N_CTX_TEXT == 8
    assert cfg.TRAINER.GRAM.FORK_ONLY == "x"
    assert cfg.TRAINER.GRAM.N_CTX_VISION == 4
    assert cfg.DATASET.SUBSAMPLE_CLASSES == "base"
    cfg.freeze()
    with pytest.raises(RuntimeError, match="frozen"):
        extend_cfg(cfg)


def test_backbone_name_and_default_weights_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert open_clip_name("ViT-B/16") == "ViT-B-16"
    assert default_weights_path("ViT-B/16") == str(tmp_path / ".cache" / "clip" / "ViT-B-16.pt")
    s = gram_settings(minimal_cfg())
    assert s.model_name == "ViT-B-16"
    assert s.weights == str(tmp_path / ".cache" / "clip" / "ViT-B-16.pt")
    assert s.quick_gelu is None  # auto: load_clip turns QuickGELU on for OpenAI TorchScript files


def test_explicit_model_name_weights_and_random():
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.MODEL_NAME = "GRAM-Test-Tiny"
    cfg.TRAINER.GRAM.WEIGHTS = "none"
    cfg.TRAINER.GRAM.QUICK_GELU = "on"
    s = gram_settings(cfg)
    assert (s.model_name, s.weights, s.quick_gelu) == ("GRAM-Test-Tiny", None, True)
    cfg.TRAINER.GRAM.WEIGHTS = "~/w/model.pt"
    assert gram_settings(cfg).weights == os.path.expanduser("~/w/model.pt")
    cfg.TRAINER.GRAM.WEIGHTS = "laion2b_s34b_b88k"  # an open_clip tag passes through
    assert gram_settings(cfg).weights == "laion2b_s34b_b88k"


@pytest.mark.parametrize(
    "trainer,text,vision",
    [("GRAM_CoOp", 4, 0), ("GRAM_VPT", 0, 3), ("UNIGRAM", 4, 3), ("GRAM_IVLP", 4, 3), ("GRAM_MaPLe", 4, 0)],
)
def test_trainer_decides_which_prompts_are_learned(trainer, text, vision):
    cfg = minimal_cfg(trainer)
    cfg.TRAINER.GRAM.N_CTX_VISION = 3
    s = gram_settings(cfg)
    assert (s.n_ctx_text, s.n_ctx_vision) == (text, vision)
    assert TRAINER_PROMPTS[trainer] == (text > 0, vision > 0)


def test_text_depth_and_coupling_follow_the_trainer():
    cfg = minimal_cfg("GRAM_MaPLe")
    cfg.TRAINER.GRAM.TEXT_DEPTH = 9
    s = gram_settings(cfg)
    assert (s.text_depth, s.coupling, s.n_ctx_vision) == (9, "maple", 0)
    assert gram_settings(cfg, "GRAM_IVLP").coupling == "none"
    assert gram_settings(minimal_cfg("GRAM_VPT")).text_depth == 0  # no text context: no depth
    cfg.TRAINER.GRAM.TEXT_DEPTH = -1
    with pytest.raises(ValueError, match="TRAINER.GRAM.TEXT_DEPTH"):
        gram_settings(cfg)
    cfg.TRAINER.GRAM.TEXT_DEPTH = 3
    with pytest.raises(ValueError, match="TRAINER.GRAM.TEXT_DEPTH.*GRAM_VPT"):
        gram_settings(cfg, "GRAM_VPT")


def test_vision_depth_shallow_deep_and_all_layers():
    cfg = minimal_cfg("GRAM_VPT")
    assert gram_settings(cfg).vision_depth(12) == 1
    cfg.TRAINER.GRAM.VPT_DEEP = True
    assert gram_settings(cfg).vision_depth(12) == 12
    cfg.TRAINER.GRAM.VPT_DEPTH = 9
    assert gram_settings(cfg).vision_depth(12) == 9
    cfg.TRAINER.GRAM.VPT_DEPTH = 13
    with pytest.raises(ValueError, match="TRAINER.GRAM.VPT_DEPTH"):
        gram_settings(cfg).vision_depth(12)
    assert gram_settings(minimal_cfg("GRAM_CoOp")).vision_depth(12) == 0


def test_the_start_holds_the_depth_prompt_spec_reads_and_build_start_names_vpt_depth():
    """GramSettings.start is the engine's StartSpec: shallow VPT is depth 1, deep with VPT_DEPTH 0 is PromptSpec's 0
    (every layer), a set depth is itself; a depth past the tower stops build_start naming TRAINER.GRAM.VPT_DEPTH."""
    from meta.finetune.engine import build_start
    from meta.model.backbone import load_clip

    cfg = minimal_cfg("GRAM_VPT")
    assert gram_settings(cfg).start.prompt.vision_depth == 1
    cfg.TRAINER.GRAM.VPT_DEEP = True
    assert gram_settings(cfg).start.prompt.vision_depth == 0
    cfg.TRAINER.GRAM.VPT_DEPTH = 3
    assert gram_settings(cfg).start.prompt.vision_depth == 3
    clip, dims = load_clip("GRAM-Test-Tiny", None)
    cfg.TRAINER.GRAM.VPT_DEPTH = dims.vision_layers + 1
    with pytest.raises(
        ValueError, match=f"^TRAINER.GRAM.VPT_DEPTH: expected 0 \\(all\\) or 1..{dims.vision_layers}, got"
    ):
        build_start(gram_settings(cfg).start, clip, dims)


@pytest.mark.parametrize(
    "key, value, error, expected",
    [
        ("N_CTX_TEXT", "4", ValueError, "an integer"),
        ("N_CTX_TEXT", True, ValueError, "an integer"),
        ("CTX_INIT", 5, ValueError, "a string"),
        ("INIT_PROMPTS", 1, TypeError, "True or False"),
        ("REG_WINDOW_IMAGES", 2.5, ValueError, "an integer"),
        ("CONSISTENCY_TEXT", "8", ValueError, "a finite number"),
    ],
)
def test_a_table_read_key_of_the_wrong_type_is_one_line_naming_it(key, value, error, expected):
    cfg = minimal_cfg("GRAM_CoOp")
    cfg.TRAINER.GRAM[key] = value
    with pytest.raises(error, match=f"^TRAINER.GRAM.{key}: expected {expected}"):
        gram_settings(cfg)


def test_gram_on_needs_init_and_off_refuses_one():
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.ENABLED = True
    with pytest.raises(ValueError, match="TRAINER.GRAM.INIT"):
        gram_settings(cfg)
    cfg.TRAINER.GRAM.INIT = "/some/init.safetensors"
    s = gram_settings(cfg)
    assert s.enabled and s.regulate and s.init_path == "/some/init.safetensors"
    cfg.TRAINER.GRAM.CTX_INIT = "a photo of a"
    with pytest.raises(ValueError, match="CTX_INIT"):
        gram_settings(cfg)
    cfg.TRAINER.GRAM.CTX_INIT = ""
    cfg.TRAINER.GRAM.ENABLED = False
    with pytest.raises(ValueError, match="ENABLED is False"):
        gram_settings(cfg)
    cfg.TRAINER.GRAM.INIT = ""
    assert gram_settings(cfg).regulate is False  # baselines never regulate


def test_bad_values_name_the_key():
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.PREC = "bf8"
    with pytest.raises(ValueError, match="TRAINER.GRAM.PREC"):
        gram_settings(cfg)
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.QUICK_GELU = "maybe"
    with pytest.raises(ValueError, match="TRAINER.GRAM.QUICK_GELU"):
        gram_settings(cfg)
    for key, value in (("CONSISTENCY_TEXT", -1.0), ("CONSISTENCY_IMAGE", float("nan"))):
        cfg = minimal_cfg()
        cfg.TRAINER.GRAM[key] = value
        with pytest.raises(ValueError, match=rf"^TRAINER.GRAM.{key}: expected a finite number >= 0"):
            gram_settings(cfg)
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.CONSISTENCY_TEXT = 8.0
    assert gram_settings(cfg).consistency.text_weight == 8.0
    cfg = minimal_cfg()
    assert gram_settings(cfg).exif_upright is False
    cfg.TRAINER.GRAM.EXIF_UPRIGHT = True
    assert gram_settings(cfg).exif_upright is True
    cfg.TRAINER.GRAM.EXIF_UPRIGHT = "yes"
    with pytest.raises(TypeError, match="^TRAINER.GRAM.EXIF_UPRIGHT: expected True or False"):
        gram_settings(cfg)
    with pytest.raises(KeyError, match="not a GRAM trainer"):
        gram_settings(minimal_cfg("CoOp"))
    bare = CN()
    bare.TRAINER = CN()
    bare.TRAINER.NAME = "UNIGRAM"
    with pytest.raises(KeyError, match="extend_cfg"):
        gram_settings(bare)


def test_cpu_forces_fp32_and_caps_workers_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one log line instead (effective_settings_line), no warning per run
        assert resolve_precision("fp16", "cpu") == "fp32"
        assert resolve_precision("amp", "cpu") == "fp32"
        assert resolve_precision("fp32", "cpu") == "fp32"
        assert resolve_precision("fp16", "cuda") == "fp16"
        assert resolve_precision("amp", "cuda") == "amp"
    assert effective_num_workers(8, "cpu", 2) == 1 and effective_num_workers(8, "cuda", 2) == 2
    assert effective_num_workers(8, "cuda", 16) == 8 and effective_num_workers(0, "cpu", 1) == 0
    assert effective_num_workers(8, "cpu", 1) == 0
    line = effective_settings_line("cpu", ("fp16", "fp32"), (8, 1), 2)
    assert line == (
        "GRAM effective settings on cpu: TRAINER.GRAM.PREC fp32 (config fp16); "
        "DATALOADER.NUM_WORKERS 1 (config 8, 2 CPUs)"
    )
    assert effective_settings_line("cuda", ("fp16", "fp16"), (8, 8), 16).endswith(": as configured")


def _method_yaml(key: str) -> dict:
    return yaml.safe_load((REPO / methods.get(key).config).read_text())


# Protocols: the GRAM paper's (§4: CoCoOp's ViT-B/16 schedule) for the configs in configs/trainers/, and the
# fork's own published config for those in a fork-named folder (configs/trainers/<TRAINER>/): the MaPLe
# repository's IVLP and MaPLe base-to-new configs (muzairkhattak/multimodal-prompt-learning @ 69bce21,
# configs/trainers/{IVLP/vit_b16_c2_ep5_batch4_2+2ctx,MaPLe/vit_b16_c2_ep5_batch4_2ctx}.yaml).
PAPER_PROTOCOL = {"lr": 0.002, "epochs": 10, "batch": 1}
FORK_PROTOCOL = {
    "GRAM_IVLP": {"lr": 0.0035, "epochs": 5, "batch": 4},
    "GRAM_MaPLe": {"lr": 0.0035, "epochs": 5, "batch": 4},
    # CoCoOp's own (KaiyangZhou/CoOp configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml) is the paper's
    "GRAM_CoCoOp": PAPER_PROTOCOL,
}


def _protocol_group(key: str) -> str:
    """ "paper" for configs/trainers/*.yaml, else the fork-named folder (= the trainer)."""
    folder = Path(methods.get(key).config).parent
    return "paper" if folder == Path("configs/trainers") else folder.name


@pytest.mark.parametrize("key", sorted(METHOD_TRAINER))
def test_method_configs_follow_their_protocol_and_only_use_known_gram_keys(key):
    """Paper §4: ViT-B/16, CoCoOp schedule (SGD 0.002, cosine, 10 epochs, 1 warm-up epoch at 1e-5, batch 1);
    fork-named configs: the fork's published schedule (FORK_PROTOCOL)."""
    doc = _method_yaml(key)
    known = set(minimal_cfg().TRAINER.GRAM.keys())
    assert set(doc["TRAINER"]["GRAM"]) <= known
    assert doc["MODEL"]["BACKBONE"]["NAME"] == "ViT-B/16"
    group = _protocol_group(key)
    want = PAPER_PROTOCOL if group == "paper" else FORK_PROTOCOL[group]
    optim = doc["OPTIM"]
    assert (optim["NAME"], optim["LR"], optim["MAX_EPOCH"], optim["LR_SCHEDULER"]) == (
        "sgd",
        want["lr"],
        want["epochs"],
        "cosine",
    )
    assert (optim["WARMUP_EPOCH"], optim["WARMUP_TYPE"], float(optim["WARMUP_CONS_LR"])) == (1, "constant", 1e-5)
    assert doc["DATALOADER"]["TRAIN_X"]["BATCH_SIZE"] == want["batch"]
    cfg = minimal_cfg(METHOD_TRAINER[key])
    for k, v in doc["TRAINER"]["GRAM"].items():
        cfg.TRAINER.GRAM[k] = v
    if cfg.TRAINER.GRAM.ENABLED:
        cfg.TRAINER.GRAM.INIT = "/given/on/the/command/line.safetensors"
    s = gram_settings(cfg)
    row = methods.get(key)
    assert s.enabled == (row.init or row.regulate)  # the file gives θ* and / or R_φ
    assert (s.enabled and s.init_prompts) == row.init and s.regulate == row.regulate
    if row.zero_shot:  # Dassl's zero-shot CLIP: 4 word-initialised tokens, never trained
        assert (s.n_ctx_text, s.n_ctx_vision, s.ctx_init) == (4, 0, "a photo of a")
    else:
        assert (s.n_ctx_text, s.n_ctx_vision) == (row.text_tokens, row.visual_tokens)
        assert s.coupling == row.coupling
        if group in ("paper", "GRAM_CoCoOp"):
            assert (s.text_depth or 1, s.vision_depth(12) or 1) == (row.text_depth or 1, row.vision_depth or 1)
        elif group == "GRAM_MaPLe":  # the fork's PROMPT_DEPTH 9 (the preset: every layer of a small CLIP)
            assert s.text_depth == 9 and s.n_ctx_vision == 0
        else:  # IVLP 2+2: every layer of both towers
            assert s.text_depth == 0 and s.vision_depth(12) == 12
    # the header names the trainer the table gives (the comment is read by people choosing a config)
    header = (REPO / row.config).read_text()
    assert f'# Trainer: {row.trainer} (row "{key}" of the method table meta/method/methods.yaml).' in header


def test_method_configs_share_one_protocol_block():
    """Dassl's yacs has no base-file include and CoOp users copy single YAMLs into their fork, so each
    trainer config repeats the protocol; every block other than TRAINER must be the same in all configs of
    one protocol group (the paper's configs/trainers/*.yaml; each fork-named folder follows that fork's own
    published config, which legitimately differs: batch 4, lr 0.0035, 5 epochs for MaPLe / IVLP)."""
    groups: dict[str, list[str]] = {}
    for key in sorted(METHOD_TRAINER):
        groups.setdefault(_protocol_group(key), []).append(key)
    assert set(groups) == {"paper", *FORK_PROTOCOL}
    for keys in groups.values():
        docs = {k: _method_yaml(k) for k in keys}
        reference = {s: v for s, v in docs[keys[0]].items() if s != "TRAINER"}
        assert set(reference) >= {"DATALOADER", "INPUT", "OPTIM", "MODEL"}
        for key, doc in docs.items():
            assert {s: v for s, v in doc.items() if s != "TRAINER"} == reference, methods.get(key).config


def test_learner_modules_key_imports_the_module_that_registers_a_users_learner(tmp_path, monkeypatch):
    """``TRAINER.GRAM.LEARNER_MODULES`` is imported before ``TRAINER.GRAM.LEARNER`` is checked; not a list, or a module
    that fails to import, is one error naming the key."""
    from meta.method.learners import learner_keys, unregister_learner

    (tmp_path / "dassl_side_learners_for_test.py").write_text(
        "from meta.method.learners import register_learner\n"
        "from meta.method.prompts import ClipPrompts\n\n"
        "class Plugged(ClipPrompts):\n"
        "    key = 'plugged_for_dassl'\n\n"
        "register_learner(Plugged())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = minimal_cfg()
    cfg.TRAINER.GRAM.LEARNER = "plugged_for_dassl"
    with pytest.raises(ValueError, match="TRAINER.GRAM.LEARNER: expected one of"):
        gram_settings(cfg, "GRAM_CoOp")
    cfg.TRAINER.GRAM.LEARNER_MODULES = "dassl_side_learners_for_test"
    with pytest.raises(ValueError, match="TRAINER.GRAM.LEARNER_MODULES: expected a list"):
        gram_settings(cfg, "GRAM_CoOp")
    cfg.TRAINER.GRAM.LEARNER_MODULES = ["dassl_side_learners_for_test"]
    try:
        assert gram_settings(cfg, "GRAM_CoOp").learner == "plugged_for_dassl" and "plugged_for_dassl" in learner_keys()
    finally:
        unregister_learner("plugged_for_dassl")


@pytest.mark.parametrize("key", ["coop", "gram_coop", "vpt", "gram_vpt", "joint", "unigram"])
def test_a_method_starts_from_one_view_in_the_dassl_trainer_and_the_evaluator(key):
    """The method's Dassl config (TRAINER.GRAM keys) and the evaluator's preset build the same engine StartSpec:
    prompts, init file, R_φ, window and launch; only how errors name the fields differs (and the launch flag of a
    baseline, which has no file to launch from)."""
    from dataclasses import replace

    from meta.evaluation.spec import method_preset

    row = methods.get(key)
    cfg = minimal_cfg(row.trainer)
    for k, v in _method_yaml(key)["TRAINER"]["GRAM"].items():
        cfg.TRAINER.GRAM[k] = v
    if cfg.TRAINER.GRAM.ENABLED:
        cfg.TRAINER.GRAM.INIT = "/given/on/the/command/line.safetensors"
    dassl = gram_settings(cfg).start
    evaluator = method_preset(key, init_path=dassl.init_path).start_spec()
    assert dassl.naming.full("reg_window") == "TRAINER.GRAM.REG_WINDOW_IMAGES"
    assert evaluator.naming.full("reg_window") == f"method {method_preset(key, in_memory=True).name!r} reg_window"
    if not dassl.init_path:
        evaluator = replace(evaluator, launch=False)
    assert replace(dassl, naming=evaluator.naming) == evaluator
