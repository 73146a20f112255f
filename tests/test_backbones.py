"""Backbones: text-prompt learners on ResNet and ViT image towers (the Dassl trainers, the evaluator, meta-training),
visual-prompt learners refused on a ResNet before any work, and the learner x backbone table of docs/learners.md.

The tiny ResNet CLIP ``GRAM-Test-RN`` (open_clip's ModifiedResNet, 4 one-block stages, 32 px) stands in for RN50 /
RN101; the real open_clip architectures are built on the ``meta`` device (shapes only, no weights)."""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_dassl_opts, train_argv

from gram_tools.backbone_table import BACKBONES, BEGIN, END, shape_only_clip, table
from meta.evaluation.spec import method_preset
from meta.method.learners import learner_of
from meta.method.prompts import PromptedCLIP, PromptParams
from meta.model.backbone import clip_dims, image_tower, load_clip

REPO = Path(__file__).resolve().parents[1]
TINY_RN = "GRAM-Test-RN"
VISUAL_TRAINERS = ("GRAM_VPT", "UNIGRAM", "GRAM_IVLP", "GRAM_MaPLe")


@pytest.fixture(scope="module")
def rn_clip():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return load_clip(TINY_RN, None)


def test_dims_and_tower_of_every_backbone_from_the_built_model_and_the_config():
    # (text width, vision width, embed dim, vision layers, image px, patches / pooled cells, tower): open_clip's
    # configs RN50 / RN101 (vision_cfg.layers [3, 4, 6, 3] / [3, 4, 23, 3], width 64 -> 2048 pooled) and the ViTs
    expected = {
        "RN50": (512, 2048, 1024, 16, 224, 49, "ResNet"),
        "RN101": (512, 2048, 512, 33, 224, 49, "ResNet"),
        "ViT-B-32": (512, 768, 512, 12, 224, 49, "ViT"),
        "ViT-B-16": (512, 768, 512, 12, 224, 196, "ViT"),
        "ViT-L-14": (768, 1024, 768, 24, 224, 256, "ViT"),
        TINY_RN: (64, 256, 64, 4, 32, 1, "ResNet"),
        "GRAM-Test-Tiny": (64, 64, 64, 2, 32, 16, "ViT"),
    }
    for name, (d_t, d_v, e, layers, px, patches, tower) in expected.items():
        clip, dims = shape_only_clip(name)
        got = (dims.text_width, dims.vision_width, dims.embed_dim, dims.vision_layers, dims.image_size)
        assert got + (dims.num_patches, image_tower(name)) == (d_t, d_v, e, layers, px, patches, tower), name
        assert type(clip.visual).__name__ == {"ResNet": "ModifiedResNet", "ViT": "VisionTransformer"}[tower]
        assert dims == clip_dims(clip, name)
    assert image_tower("no-such-model") == ""


@pytest.mark.parametrize("key", ["coop", "gram_coop", "cocoop"])
def test_text_prompt_learners_train_on_a_resnet_tower(rn_clip, key):
    clip, dims = rn_clip
    spec = method_preset(key, in_memory=True).prompt_spec()
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(0))
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template)
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    learner = learner_of(theta)
    logits = learner.logits(pclip, theta, ["cat", "dog"], images=images)
    # the image side is the ResNet's own encode_image, so cached frozen features give the same logits
    cached = F.normalize(clip.encode_image(images), dim=-1)
    assert torch.allclose(logits, learner.logits(pclip, theta, ["cat", "dog"], image_features=cached), atol=1e-5)
    F.cross_entropy(logits, torch.tensor([0, 1, 0])).backward()
    grads = {n: p.grad for n, p in theta.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()) and grads["ctx"].abs().sum() > 0
    assert theta.ctx.shape == (4, dims.text_width)


def test_chc_image_features_and_meta_training_on_a_resnet_tower(tmp_path):
    from helpers_metatrain import BASE, N_TOPICS, NAMES, colour_pixels

    from meta.chc.hierarchy import Hierarchy
    from meta.chc.imaging import CLIP_MEAN, CLIP_STD, encode_images
    from meta.metatrain import build_cfg
    from meta.metatrain.trainer import train

    pixels, topic, domain = colour_pixels()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)  # the trainer's random tower for SEED 0
        clip, _ = load_clip(TINY_RN, None)
    with torch.no_grad():  # CHC's image stage (meta.chc.image_features) encodes with this function
        feats = encode_images(clip, pixels, CLIP_MEAN, CLIP_STD)
    meta = {"backbone": TINY_RN, "pretrained": None, "weights_sha256": None, "image_size": 32}
    meta.update(mean=list(CLIP_MEAN), std=list(CLIP_STD))
    h = Hierarchy(NAMES[:N_TOPICS], topic, domain, feats, meta, image_loader=lambda idx: pixels[idx])
    opts = [*BASE, "MODEL.BACKBONE", TINY_RN, "META.PROMPT.N_CTX_TEXT", "4", "META.STEPS", "2", "SEED", "0"]
    opts += ["META.TENSORBOARD", "False"]
    train(build_cfg(opts=opts, output_dir=str(tmp_path / "run")), hierarchy=h, echo=lambda _m: None)
    from meta.finetune.init_io import load_gram_init

    init = load_gram_init(tmp_path / "run" / "gram_init.safetensors")
    assert init.metadata["backbone"]["model_name"] == TINY_RN
    assert init.metadata["backbone"]["vision_width"] == 256 and tuple(init.prompt["ctx"].shape) == (4, 64)


def test_evaluator_runs_coop_on_a_resnet_tower(tmp_path, capsys):
    from gram_tools.synthetic import write_synthetic_dtd
    from meta.evaluation.cli import main

    write_synthetic_dtd(tmp_path / "data", 4, {"train": 3, "val": 2, "test": 2}, size=(32, 32), seed=0)
    out = tmp_path / "b2n.jsonl"
    argv = ["base2new", "--dataset", str(tmp_path / "data" / "dtd"), "--model", TINY_RN, "--methods", "coop"]
    argv += ["--shots", "2", "--seeds", "1", "--epochs", "1", "--final-eval-only", "--no-progress"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*argv, "--output", str(out)]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["clip"]["model_name"] == TINY_RN and row["clip"]["dims"]["vision_width"] == 256
    assert 0 <= row["base"] <= 100 and 0 <= row["new"] <= 100


def test_learner_backbone_table_in_docs_is_current():
    text = (REPO / "docs" / "learners.md").read_text(encoding="utf-8")
    committed = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert committed == table(), "run: python -m gram_tools.backbone_table --write docs/learners.md"
    rows = {r.split("|")[1].strip(" `"): [c.strip() for c in r.split("|")[2:-1]] for r in committed.splitlines()[2:]}
    resnets = [i for i, b in enumerate(BACKBONES) if image_tower(b) == "ResNet"]
    assert resnets == [0, 1]
    for trainer in VISUAL_TRAINERS:
        assert [rows[trainer][i] for i in resnets] == ["refused", "refused"]
    for trainer in ("GRAM_CoOp", "GRAM_CoCoOp"):
        assert all(cell.startswith("θ ") for cell in rows[trainer])
    assert rows["GRAM_CoOp"][:4] == ["θ 2,048"] * 4 and rows["GRAM_CoOp"][4] == "θ 3,072"  # ctx [4, 512] / [4, 768]


# ------------------------------------------------------------------------------------------ Dassl trainers
def _train_py(argv: list[str], monkeypatch) -> int:
    """``python train.py argv`` in this process as a user runs it (``run_cli``: 0, or 2 with one line)."""
    pytest.importorskip("dassl", reason="Dassl not installed")
    from dassl.utils import Logger

    import train
    from meta.infra.cli_errors import run_cli

    monkeypatch.setattr(train, "collect_env_info", lambda: "(not collected by tests/test_backbones.py)")
    saved = sys.stdout
    try:
        return run_cli(train.cli, argv)
    finally:
        tee, sys.stdout = sys.stdout, saved
        while isinstance(tee, Logger):  # undo Dassl's stdout tee; its __del__ must not close the real stdout
            if tee.file is not None:
                tee.file.close()
                tee.file = None
            tee.console, tee = io.StringIO(), tee.console


def _tiny_argv(trainer: str, config: str, root: Path, out: Path, *opts: str) -> list[str]:
    return train_argv(root, out, trainer, config, *tiny_dassl_opts(TINY_RN, shots=2), *opts)


@pytest.mark.parametrize("trainer", VISUAL_TRAINERS)
def test_dassl_refuses_visual_prompts_on_a_resnet_before_any_work(trainer, tmp_path, monkeypatch, capsys):
    from meta.method import methods

    config = next(methods.get(k).config for k in methods.dassl_keys() if methods.get(k).trainer == trainer)
    # the dataset root does not exist: the refusal must come before Dassl reads any data or builds any model
    argv = _tiny_argv(trainer, config, tmp_path / "no-data", tmp_path / "out", "TRAINER.GRAM.ENABLED", "False")
    assert _train_py(argv, monkeypatch) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: TRAINER.GRAM.MODEL_NAME: {TINY_RN} has a ResNet image tower")
    assert f"{trainer} prompts it" in lines[0] and "run GRAM_CoOp, GRAM_CoCoOp (text prompts only)" in lines[0]


def test_dassl_gram_coop_trains_and_evaluates_on_a_resnet_tower(rn_clip, tmp_path, monkeypatch, capsys):
    from gram_tools.synthetic import write_synthetic_dtd
    from meta.finetune.init_io import export_gram_init
    from meta.method.regulator import GradientRegulator, RegulatorSpec

    clip, dims = rn_clip
    write_synthetic_dtd(tmp_path / "data", 4, {"train": 3, "val": 2, "test": 2}, size=(32, 32), seed=0)
    torch.save(clip.state_dict(), tmp_path / "rn.pt")
    theta = PromptParams.from_spec(method_preset("gram_coop", in_memory=True).prompt_spec(), clip, dims)
    provenance = {"mode": "gram", "tasks": {"k_way": 2, "n_support": 2}, "meta": {"inner_lr": 0.1, "inner_steps": 1}}
    init = export_gram_init(
        tmp_path / "init.safetensors",
        theta,
        {"ctx": GradientRegulator(dims.text_width, RegulatorSpec())},
        dims,
        provenance=provenance,
        weights=str(tmp_path / "rn.pt"),
    )
    opts = ["TRAINER.GRAM.WEIGHTS", str(tmp_path / "rn.pt"), "TRAINER.GRAM.INIT", str(init)]
    opts += ["DATASET.SUBSAMPLE_CLASSES", "base"]
    argv = _tiny_argv("GRAM_CoOp", "configs/trainers/gram_coop.yaml", tmp_path / "data", tmp_path / "out", *opts)
    assert _train_py(argv, monkeypatch) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"GRAM backbone: {TINY_RN}" in printed and "vision=256 image=32px" in printed
    assert "* accuracy:" in printed
    assert (tmp_path / "out" / "prompt_learner" / "model.pth.tar-1").is_file()


def test_meta_training_and_the_evaluator_refuse_visual_prompts_on_a_resnet_before_any_work(tmp_path, capsys):
    """The same refusal as the Dassl trainers', at the other two edges: ``python -m meta train`` (check_meta_cfg)
    and ``python -m meta.evaluation`` name their backbone key and what does run there, before any model is built."""
    from meta.config import get_meta_cfg_default
    from meta.evaluation.cli import main as evaluate
    from meta.metatrain.settings import check_meta_cfg

    cfg = get_meta_cfg_default()
    cfg.MODEL.BACKBONE = "GRAM-Test-RN"
    cfg.META.PROMPT.N_CTX_VISION = 4
    with pytest.raises(ValueError, match=r"^MODEL.BACKBONE: GRAM-Test-RN has a ResNet image tower.*N_CTX_VISION 0"):
        check_meta_cfg(cfg)
    cfg.META.PROMPT.N_CTX_VISION = 0
    check_meta_cfg(cfg)  # text prompts only: accepted
    argv = ["base2new", "--dataset", str(tmp_path), "--model", "GRAM-Test-RN", "--methods", "coop", "vpt"]
    assert evaluate(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("error: --model: GRAM-Test-RN has a ResNet image tower")
        and "coop" in err[0]
    )
