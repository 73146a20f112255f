"""The Dassl side of the tests that run a trainer as ``train.py`` builds it: a tiny CoOp-layout DTD, the provenance
an exported init file carries, and :func:`dassl_run` (the engine agreement test and the image-conditioned learner's
test both use them).  Needs Dassl: import it after ``pytest.importorskip("dassl")``."""

from __future__ import annotations

import io
import json
import sys
import warnings
from pathlib import Path

import numpy as np
from dassl.engine import build_trainer
from dassl.utils import Logger, set_random_seed
from PIL import Image

import train
from meta.method import methods

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["apple", "boat", "cat", "drum"]  # CoOp's base = the first two, new = the last two
SIZES = {"train": 5, "val": 2, "test": 10}
SHOTS, SEED, BATCH = 3, 1, 2
# one file per learner: θ*, a non-identity R_φ, and the provenance `python -m meta export` writes (the support of
# 2 ways x 2 shots sets the default window; inner_lr the launch step)
PROVENANCE = {"mode": "gram", "tasks": {"k_way": 2, "n_support": 2}, "meta": {"inner_lr": 0.1, "inner_steps": 1}}


def write_dtd(root: Path) -> None:
    """DTD's on-disk layout with 32-px PNGs: one colour per class plus noise (the tiny CLIP tells them apart)."""
    rng = np.random.default_rng(0)
    colours = rng.uniform(0, 255, (len(CLASSES), 3))
    split = {}
    for name, n in SIZES.items():
        rows = []
        for label, cname in enumerate(CLASSES):
            for k in range(n):
                rel = f"{cname}/{name}_{k:02d}.png"
                path = root / "dtd" / "images" / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                pixels = np.clip(colours[label] + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(path)
                rows.append([rel, label, cname])
        split[name] = rows
    (root / "dtd" / "split_zhou_DescribableTextures.json").write_text(json.dumps(split))


def dassl_run(root: Path, key: str, opts: list[str], subsample: str, output: Path):
    """A Dassl trainer of method ``key`` as ``train.py`` builds it (seeded, the tiny CLIP's weights file)."""
    row = methods.get(key)
    argv = [
        "--root",
        str(root / "data"),
        "--seed",
        str(SEED),
        "--trainer",
        row.trainer,
        "--output-dir",
        str(output),
        "--dataset-config-file",
        str(REPO / "configs/datasets/dtd.yaml"),
        "--config-file",
        str(REPO / row.config),
        "TRAINER.GRAM.MODEL_NAME",
        "GRAM-Test-Tiny",
        "TRAINER.GRAM.WEIGHTS",
        str(root / "tiny_clip.pt"),
        "TRAINER.GRAM.QUICK_GELU",
        "off",
        "INPUT.SIZE",
        "(32, 32)",
        "INPUT.TRANSFORMS",
        "['normalize']",
        "DATALOADER.NUM_WORKERS",
        "0",
        "DATALOADER.TRAIN_X.BATCH_SIZE",
        str(BATCH),
        "DATALOADER.TRAIN_X.SAMPLER",
        "SequentialSampler",
        "OPTIM.MAX_EPOCH",
        "1",
        "OPTIM.WARMUP_EPOCH",
        "0",
        "DATASET.NUM_SHOTS",
        str(SHOTS),
        "DATASET.SUBSAMPLE_CLASSES",
        subsample,
        *opts,
    ]
    cfg = train.setup_cfg(train.build_parser().parse_args(argv))
    set_random_seed(cfg.SEED)
    saved = sys.stdout
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = build_trainer(cfg)
    finally:
        restore_stdout(saved)
    return trainer, cfg


def restore_stdout(saved) -> None:
    """Undo Dassl's ``setup_logger``: close the log files of the ``Logger`` chain on ``sys.stdout`` and put
    ``saved`` back (each ``Logger``'s console becomes a buffer, so its ``__del__`` cannot close the real stdout)."""
    tee, sys.stdout = sys.stdout, saved
    while isinstance(tee, Logger):
        if tee.file is not None:
            tee.file.close()
            tee.file = None
        tee.console, tee = io.StringIO(), tee.console


def evaluator_train_spec(cfg, epochs: int = 1):
    """The evaluator's :class:`meta.evaluation.TrainSpec` that replays the Dassl run of ``cfg``: its optimiser and
    test batch, no warm-up or augmentation, Dassl's sequential order, one final test."""
    from meta.evaluation import TrainSpec

    return TrainSpec(
        epochs=epochs,
        batch_size=BATCH,
        lr=float(cfg.OPTIM.LR),
        momentum=float(cfg.OPTIM.MOMENTUM),
        weight_decay=float(cfg.OPTIM.WEIGHT_DECAY),
        warmup_epochs=0,
        augment="none",
        order="sequential",
        eval_every_epoch=False,
        test_batch_size=int(cfg.DATALOADER.TEST.BATCH_SIZE),
    )


def agreement_world(root: Path, clip, dims, shapes: dict) -> dict:
    """``root`` with DTD's layout under ``data``, the frozen CLIP's weights (``tiny_clip.pt``) and one GRAM init file
    per trainer of ``shapes`` (``{trainer: {tensor: shape}}``: θ* ~ N(0, 0.02²), R_φ normal-initialised); returns
    ``{trainer: init file}``."""
    import torch

    from meta.finetune.init_io import export_gram_init
    from meta.method.prompts import PromptParams
    from meta.method.regulator import GradientRegulator, RegulatorSpec

    write_dtd(root / "data")
    torch.save(clip.state_dict(), root / "tiny_clip.pt")
    g = torch.Generator().manual_seed(5)
    inits = {}
    for trainer, tensor_shapes in shapes.items():
        tensors = {k: torch.randn(*s, generator=g) * 0.02 for k, s in tensor_shapes.items()}
        torch.manual_seed(9)
        regs = {
            k: GradientRegulator(dims.text_width, RegulatorSpec(init="normal", init_std=0.2)) for k in tensor_shapes
        }
        inits[trainer] = export_gram_init(
            root / f"{trainer}.safetensors", PromptParams(**tensors), regs, dims, provenance=PROVENANCE
        )
    return inits
