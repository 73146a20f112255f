"""Helpers shared by several test files (import them from here, never from a test file)."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from PIL import Image
from yacs.config import CfgNode as CN


def flat_tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten nested dicts / lists / tuples (state dicts, checkpoints) into ``{path: tensor}``."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """``a`` and ``b`` hold the same, non-empty set of keys and bit-identical tensors under each."""
    assert a, "nothing to compare: the first state holds no tensors"
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def optim_cfg(**overrides) -> CN:
    """Dassl's OPTIM defaults for the keys schedules read, with CoCoOp's schedule on top."""
    cfg = CN()
    cfg.LR = 0.002
    cfg.LR_SCHEDULER = "cosine"
    cfg.MAX_EPOCH = 10
    cfg.STEPSIZE = (-1,)
    cfg.GAMMA = 0.1
    cfg.WARMUP_EPOCH = 1
    cfg.WARMUP_TYPE = "constant"
    cfg.WARMUP_CONS_LR = 1e-5
    cfg.WARMUP_MIN_LR = 1e-5
    cfg.WARMUP_RECOUNT = True
    for k, v in overrides.items():
        cfg[k] = v
    return cfg


# ------------------------------------------------------------------ tiny CoOp-layout datasets
def write_image(path: Path, value: int = 0, size: int = 8) -> None:
    """A ``size``x``size`` RGB PNG/JPEG whose pixels all equal ``value`` (mod 256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (value % 256, (3 * value) % 256, (7 * value) % 256)).save(path)


def make_dtd(root: Path, n_classes: int = 5, counts: dict[str, int] | None = None, real_images: bool = True) -> dict:
    """Write ``root/dtd/images/<class>/*.jpg`` and ``split_zhou_DescribableTextures.json``.

    Class ``c`` (0-based) is named ``texture_<c>``; split ``s`` gets ``counts[s] + c`` images of
    class ``c`` so the classes have different sizes.  Returns the split dict as written.
    """
    counts = counts or {"train": 6, "val": 3, "test": 2}
    image_dir = root / "dtd" / "images"
    split: dict[str, list] = {}
    k = 0
    for s, n in counts.items():
        rows = []
        for c in range(n_classes):
            for i in range(n + c):
                rel = f"texture_{c}/{s}_{i:03d}.jpg"
                if real_images:
                    write_image(image_dir / rel, k)
                else:
                    (image_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    (image_dir / rel).touch()
                rows.append([rel, c, f"texture_{c}"])
                k += 1
        split[s] = rows
    with open(root / "dtd" / "split_zhou_DescribableTextures.json", "w") as f:
        json.dump(split, f)
    return split


def make_imagenet_tree(image_dir: Path, folders: list[str], per_class: int) -> None:
    """``image_dir/<folder>/img_<i>.jpg`` for every folder (empty files)."""
    for folder in folders:
        (image_dir / folder).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (image_dir / folder / f"img_{i}.jpg").touch()


def write_classnames(path: Path, mapping: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} {v}\n" for k, v in mapping.items()))


def relpaths(records, base: Path) -> list[str]:
    return [os.path.relpath(r.impath, base) for r in records]


def lr_per_epoch(opt, sched, epochs: int) -> list[float]:
    """The learning rate of each of ``epochs`` epochs: read it, then take one optimiser and one scheduler step."""
    lrs = []
    for _ in range(epochs):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


SHAPE_NAMES = ["circle", "square", "triangle"]


def class_batch(
    n_per_class: int,
    image_size: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    names: list[str] = SHAPE_NAMES,
) -> dict:
    """A loss-function batch of random images: ``images`` ``[n_per_class * K, 3, S, S]`` drawn from ``gen``,
    ``label`` ``[n_per_class * K]`` cycling over the K ``names`` (``classnames``)."""
    k = len(names)
    return {
        "classnames": names,
        "images": torch.randn(n_per_class * k, 3, image_size, image_size, generator=gen, dtype=dtype),
        "label": torch.arange(k).repeat(n_per_class),
    }


def tiny_chc_args(out_dir: Path, *opts: str) -> list[str]:
    """``python -m meta cluster`` arguments: CPU, the tiny test CLIP, output in ``out_dir``, then ``opts``."""
    return [
        "--no-progress",
        "MODEL.BACKBONE",
        "GRAM-Test-Tiny",
        "MODEL.DEVICE",
        "cpu",
        "CHC.OUTPUT_DIR",
        str(out_dir),
        *opts,
    ]


def tiny_meta_opts(*opts: str) -> list[str]:
    """``python -m meta train`` ``KEY VALUE`` options: the tiny test CLIP on the CPU, no progress bar, no
    TensorBoard and no golden run for ``computed_by`` (one test covers it), then ``opts`` (steps, task sizes, ...)."""
    return [
        "MODEL.BACKBONE",
        "GRAM-Test-Tiny",
        "MODEL.DEVICE",
        "cpu",
        "META.PROGRESS",
        "False",
        "META.TENSORBOARD",
        "False",
        "META.FINGERPRINT",
        "False",
        *opts,
    ]


def tiny_task_opts(meta_batch: int = 2, way: int = 3, support: int = 2, query: int = 3, val_fraction: float = 0.25):
    """``KEY VALUE`` options of tiny meta-tasks: ``meta_batch`` tasks per step of ``way`` classes with ``support`` +
    ``query`` shots, ``val_fraction`` of the topics held out for validation."""
    return [
        "META.META_BATCH",
        str(meta_batch),
        "TASKS.K_WAY",
        str(way),
        "TASKS.N_SUPPORT",
        str(support),
        "TASKS.N_QUERY",
        str(query),
        "TASKS.VAL_FRACTION",
        f"{val_fraction:g}",
    ]


def train_argv(root: Path, out: Path, trainer: str, config: str, *opts: str, seed: int = 1) -> list[str]:
    """``train.py``'s arguments for ``trainer`` on the DTD layout under ``root`` (``configs/datasets/dtd.yaml``) with
    the trainer config ``config`` (repository-relative), writing to ``out``, then the ``KEY VALUE`` ``opts``."""
    repo = Path(__file__).resolve().parents[1]
    return [
        *("--root", str(root), "--seed", str(seed), "--trainer", trainer, "--output-dir", str(out)),
        *("--dataset-config-file", str(repo / "configs/datasets/dtd.yaml"), "--config-file", str(repo / config)),
        *opts,
    ]


def tiny_dassl_opts(model: str = "GRAM-Test-Tiny", shots: int = 2) -> list[str]:
    """Dassl ``KEY VALUE`` options of a one-epoch GRAM-trainer run on the tiny test CLIP ``model`` (no weights file,
    32 x 32 images, batches of 2, no loader workers) at ``shots`` images per class."""
    return [
        "TRAINER.GRAM.MODEL_NAME",
        model,
        "TRAINER.GRAM.WEIGHTS",
        "none",
        "INPUT.SIZE",
        "(32, 32)",
        "DATALOADER.NUM_WORKERS",
        "0",
        "DATALOADER.TRAIN_X.BATCH_SIZE",
        "2",
        "OPTIM.MAX_EPOCH",
        "1",
        "DATASET.NUM_SHOTS",
        str(shots),
    ]


def run_methods_module():
    """``scripts/run_methods.py`` imported as a module (the runner behind base2new.sh, xd.sh and xdomain.sh)."""
    import sys

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        import run_methods
    finally:
        sys.path.remove(scripts)
    return run_methods


def run_bench_script(script: str, args: list, env: dict, timeout: int = 300, **extra) -> "subprocess.CompletedProcess":
    """``bash scripts/<script> args`` with ``env`` plus ``extra`` variables (values as strings)."""
    import subprocess

    e = dict(env, **{k: str(v) for k, v in extra.items()})
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    return subprocess.run(
        ["bash", str(scripts / script), *args], env=e, capture_output=True, text=True, timeout=timeout
    )


def recorded_calls(env: dict) -> list:
    """The command lines the fake interpreter of the script tests recorded (one JSON list per line) in
    ``env["FAKE_RECORD"]``; the record is removed after reading."""
    path = Path(env["FAKE_RECORD"])
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return out


# ------------------------------------------------------------------ caches shared by the pytest-xdist workers
def shared_dir(tmp_path_factory, name: str) -> Path:
    """``<name>/`` in a folder every pytest-xdist worker of this run shares: the controller's base temp folder,
    the parent of each worker's own (``.../pytest-N/popen-gw0``); without xdist, this test run's base temp folder.

    An expensive artefact cached on disk by its settings (the quick world, its CLIP) is then built once per run,
    not once per worker; build it under :func:`file_lock` so that a second worker waits for it instead."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = base / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent) for the ``with`` block: processes (pytest-xdist
    workers) that take the same lock wait until it is released, or until its holder dies."""
    import fcntl

    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def quick_world(tmp_path_factory):
    """The quick world of seed 0 (``gram_world.build_world(quick=True)``), built once per test run in
    :func:`shared_dir` ``worlds/`` (the other workers wait for it, then load it)."""
    from gram_world import build_world

    root = shared_dir(tmp_path_factory, "worlds")
    with file_lock(root / ".quick_world.lock"):
        return build_world(quick=True, root=root, seed=0)


def quick_world_weights(world) -> Path:
    """The quick world's tiny CLIP (the quick schedule, ``pretrain_clip(world, quick=True)``) and its zero-shot
    sidecar ``<stem>.zeroshot.json`` (which the demo reads), computed once per test run under a lock.

    Nothing else writes them afterwards: a worker may read them while another runs its tests."""
    from gram_world.pretrain import pretrain_clip
    from gram_world.zeroshot import zeroshot_accuracy

    with file_lock(world.root.parent / ".quick_world_clip.lock"):
        weights = pretrain_clip(world, quick=True)
        if not weights.with_suffix(".zeroshot.json").is_file():
            zeroshot_accuracy(world, weights)
    return weights


def minimal_cfg(trainer: str = "GRAM_CoOp", backbone: str = "ViT-B/16") -> CN:
    """The few Dassl default keys gram_settings reads, without Dassl, then ``trainers.gram.config.extend_cfg``."""
    from trainers.gram.config import extend_cfg

    cfg = CN()
    cfg.TRAINER = CN()
    cfg.TRAINER.NAME = trainer
    cfg.MODEL = CN()
    cfg.MODEL.BACKBONE = CN()
    cfg.MODEL.BACKBONE.NAME = backbone
    return extend_cfg(cfg)


def one_error_line(capsys_or_text, *names: str, progress: bool = False, warnings: bool = False) -> str:
    """The single non-empty stderr line; it starts with ``error:`` and names every one of ``names``.

    ``progress``: ignore tqdm bar lines (transformers' "Loading weights" bar ignores ``--no-progress``);
    ``warnings``: ignore one-line ``warning: ...`` notes before it (``train.py`` prints Python warnings so)."""
    text = capsys_or_text if isinstance(capsys_or_text, str) else capsys_or_text.readouterr().err
    lines = [line for line in text.splitlines() if line.strip()]
    if progress:
        lines = [line for line in lines if not (line.startswith("Loading weights") and "it/s]" in line)]
    if warnings:
        lines = [line for line in lines if not line.startswith("warning: ")]
    assert len(lines) == 1, text
    assert lines[0].startswith("error: "), lines[0]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def resave_tensors(src: Path, dst: Path, dtype: torch.dtype, only: str = "") -> Path:
    """``src``'s tensors (all, or the one named ``only``) in ``dtype``, same metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
    tensors = {k: (v.to(dtype) if not only or k == only else v) for k, v in load_file(str(src)).items()}
    save_file(tensors, str(dst), metadata=metadata)
    return dst


def fake_run_cell(ran: list, effect):
    """A stand-in for ``gram_world.study.run_cell``: H of a row = 50 + ``effect(world, unit variant, key, seed)``
    (base = new = H); each call is appended to ``ran`` as (world, variant, keys, world seed, world fields)."""

    def fake(cell, root, keys, world_root=None):
        ran.append((cell.world, cell.variant, tuple(keys), cell.settings.world_seed, cell.settings.world))
        return [
            {"key": k, "seed": s, "base": h, "new": h, "dataset": "d"}
            for k in keys
            for s in cell.settings.seeds
            for h in [50.0 + effect(cell.world, cell.variant, k, s)]
        ]

    return fake


def central_difference(objective, params: list, direction: list, eps: float) -> float:
    """``(f(p + eps d) - f(p - eps d)) / (2 eps)`` of ``objective()`` along ``direction`` (one tensor per parameter),
    the parameters moved in place and restored."""

    def shifted(step: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(step * d)
        value = objective()
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.sub_(step * d)
        return value

    return (shifted(eps) - shifted(-eps)) / (2 * eps)


def assert_matches_central_differences(
    objective, params: list, grads: list, groups: dict, gen: torch.Generator, eps: float = 1e-6, rtol: float = 1e-6
) -> None:
    """For random float64 directions along each ``groups`` entry (``{name: [bool per parameter]}``: which parameters
    the direction moves), ``Σ grad · d`` (the analytic directional derivative, non-zero) equals the central
    difference of ``objective()`` within ``rtol`` (relative, floored at 1)."""
    for name, mask in groups.items():
        direction = [
            torch.randn(p.shape, generator=gen, dtype=torch.float64) * float(on) for p, on in zip(params, mask)
        ]
        want = float(sum((g * d).sum() for g, d in zip(grads, direction)))
        numeric = central_difference(objective, params, direction, eps)
        assert abs(want) > 1e-8, name
        assert abs(numeric - want) <= rtol * max(1.0, abs(numeric)), (name, numeric, want)


def quick_demo_settings(**overrides):
    """The quick demo cut to a few steps (meta-training, fine-tuning, validation) for end-to-end tests."""
    from dataclasses import replace

    from gram_world.demo import DemoSettings

    fields = dict(shots=2, meta_steps=2, checkpoint_every=1, log_detail_every=1, epochs=1, val_tasks=2, jobs=1)
    return replace(DemoSettings.preset(quick=True), **{**fields, **overrides})


def worlds_in(obj) -> set:
    """World names a committed study file holds: its cells' ``world/meta seed`` names and any ``worlds`` list."""
    out: set = set()
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "cells" and isinstance(value, dict):
                out |= {name.split("/")[-2] if name.count("/") >= 1 else name for name in value}
            elif key == "worlds" and isinstance(value, list) and all(isinstance(w, str) for w in value):
                out |= set(value)
            out |= worlds_in(value)
    elif isinstance(obj, list):
        for value in obj:
            out |= worlds_in(value)
    return out
