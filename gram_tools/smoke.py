"""A one-minute wiring check of GRAM inside a CoOp-style fork: ``python -m gram_tools.smoke --fork DIR``.

Run it with the interpreter that runs the fork's ``train.py`` (the one ``scripts/setup.sh --with-dassl``
built), after the four steps of ``docs/dassl_plugin.md`` (install, copy ``trainers/gram``, call
``extend_gram_cfg``, add the configs).  Nothing is downloaded.  Into ``--out`` (default
``<fork>/output/gram_smoke``) it writes, shared by every method:

* ``data/dtd/``: a tiny dataset in CoOp's DTD layout (``images/<class>/*.jpg`` and
  ``split_zhou_DescribableTextures.json``), 4 generated classes, 32 x 32 JPEGs;
* ``clip/GRAM-Test-Tiny.pt``: the 3.4 M-parameter ``GRAM-Test-Tiny`` CLIP with random weights (seed 0), as a
  state dict;

and one folder per method, ``<out>/<method>/`` (so each ``--method`` runs on its own, in any order, any number of
times; a method's folder holds the file ``.gram_smoke``, and its two run folders are emptied before each run, so
Dassl never resumes an earlier run's checkpoint):

* ``init.safetensors``: a GRAM init file of the method's prompt shapes for that CLIP: θ as the learner starts
  it from scratch and R_φ at its own initialisation.  **It is a placeholder for wiring, not a meta-trained
  θ***; ``python -m meta train`` makes a real one;
* ``train_base/`` and ``test_new/`` with their logs ``train_base.log`` and ``test_new.log``: the fork's own
  ``train.py`` run twice, as the base-to-new protocol does (train on the base classes for one epoch;
  ``--eval-only`` on the new classes from that checkpoint), with the fork's ``configs/datasets/dtd.yaml`` and the
  method's trainer config.

It checks in their output that the GRAM trainer ran with GRAM on, read the init file and printed an accuracy.
The last line is ``smoke ok: ...`` (exit 0) or ``error: ...`` naming what was missing (exit 2).
Accuracies on random weights mean nothing; the check is that every piece is found and runs.

``python -m gram_tools.smoke --write-init FILE --method KEY --model NAME`` writes only such a placeholder init
file, for the open_clip architecture NAME (default ``ViT-B-16``; random weights, nothing downloaded), to wire up
a fork's own command before a meta-trained θ* exists.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TINY_MODEL = "GRAM-Test-Tiny"
PLACEHOLDER_MODEL = "ViT-B-16"  # --write-init's default architecture: the paper's and CoOp's configs'
N_CLASSES = 4  # CoOp's base / new split of 4 sorted labels: base = first 2, new = last 2
COUNTS = {"train": 3, "val": 2, "test": 3}  # images per class and split
IMAGE_PX = 32
ACCURACY = re.compile(r"^\* accuracy: ([\d.]+)%", re.M)
RESUMED = re.compile(r"^Found checkpoint at (.+) \(will resume training\)$", re.M)  # Dassl's resume line
MARKER = ".gram_smoke"  # in each method folder: written by this check, so its run folders may be emptied
RUN_FOLDERS = ("train_base", "test_new")
TRAIN_TIMEOUT_S = 600
# what `python -m meta export` records, for a 2-way 2-shot support and one inner step of 0.1 (the regulation
# window and the launch step read it); "note" says the file was never meta-trained
PLACEHOLDER_PROVENANCE = {
    "mode": "gram",
    "note": "gram_tools.smoke placeholder: random θ and R_φ, not meta-trained",
    "tasks": {"k_way": 2, "n_support": 2},
    "meta": {"inner_lr": 0.1, "inner_steps": 1},
}


class SmokeError(RuntimeError):
    """A missing piece of the fork's wiring, worded for the one-line error."""


@dataclass(frozen=True)
class SmokeFiles:
    """What the smoke check writes before it runs the fork."""

    data_root: Path  # holds dtd/
    clip_file: Path
    init_file: Path
    image_size: int = 0  # the CLIP's input resolution (px) when it is not the tiny one's; 0: IMAGE_PX


def smoke_methods() -> tuple[str, ...]:
    """The ``--method`` each Dassl learner is checked with: its first row of the method table with θ* and R_φ
    (``meta/method/methods.yaml``, table order; e.g. ``gram_coop``, ``gram_vpt``, ``unigram``)."""
    from meta.method.methods import methods

    first: dict[str, str] = {}
    for m in methods().values():
        if m.trainer and m.init and m.regulate and not m.one_step:
            first.setdefault(m.trainer, m.key)
    return tuple(first.values())


def _random_clip(model_name: str):
    """``(clip, dims)`` of open_clip's ``model_name`` with random weights (torch seed 0); nothing is downloaded."""
    import torch

    from meta.model.backbone import load_clip

    logging.disable(logging.WARNING)  # open_clip logs "no pretrained weights": random weights are the point here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            return load_clip(model_name, pretrained=None)
    finally:
        logging.disable(logging.NOTSET)


def write_placeholder_init(path: Path, method_key: str, clip, dims, weights: str = "") -> Path:
    """A GRAM init file of ``method_key``'s prompt shapes for ``clip``: scratch θ (torch seed 1) and R_φ at its own
    initialisation, one regulator per θ tensor at its last dimension; provenance says it is a placeholder."""
    import torch

    from meta.evaluation.spec import method_preset
    from meta.finetune.init_io import export_gram_init
    from meta.method.prompts import PromptParams
    from meta.method.regulator import GradientRegulator, RegulatorSpec

    spec = method_preset(method_key, in_memory=True).prompt_spec()
    torch.manual_seed(1)
    prompts = PromptParams.from_spec(spec, clip, dims)
    regulators = {name: GradientRegulator(int(p.shape[-1]), RegulatorSpec()) for name, p in prompts.named_parameters()}
    return export_gram_init(path, prompts, regulators, dims, provenance=PLACEHOLDER_PROVENANCE, weights=weights)


def write_inputs(out: Path, method_key: str, model_name: str = TINY_MODEL) -> SmokeFiles:
    """Write the tiny dataset and the CLIP file under ``out`` (shared by every method; ``model_name``: the place
    for a ``--backbone`` option) and a placeholder init file for ``method_key`` in ``out/<method_key>/``."""
    import torch

    from gram_tools.synthetic import write_synthetic_dtd
    from meta.infra.fileio import atomic_path

    data_root = out / "data"
    if not (data_root / "dtd" / "split_zhou_DescribableTextures.json").is_file():
        write_synthetic_dtd(data_root, N_CLASSES, COUNTS, size=(IMAGE_PX, IMAGE_PX), seed=0)
    clip, dims = _random_clip(model_name)
    clip_file = out / "clip" / f"{model_name}.pt"
    clip_file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(clip_file) as tmp:  # a run killed while writing leaves no half file for the next one
        torch.save(clip.state_dict(), tmp)
    init_file = write_placeholder_init(out / method_key / "init.safetensors", method_key, clip, dims, str(clip_file))
    size = 0 if dims.image_size == IMAGE_PX else int(dims.image_size)
    return SmokeFiles(data_root=data_root, clip_file=clip_file, init_file=init_file, image_size=size)


def fresh_method_folder(out: Path, method_key: str) -> Path:
    """``out/<method_key>/`` with its run folders removed (an earlier run's checkpoint would be resumed by Dassl);
    a folder this check did not write (no ``.gram_smoke`` file) is refused, never emptied."""
    folder = out / method_key
    marker = folder / MARKER
    if folder.exists() and not marker.is_file():
        raise SmokeError(f"{folder}: exists but was not written by the smoke check (no {MARKER}); pick another --out")
    folder.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"written by python -m gram_tools.smoke --method {method_key}; its run folders are redone\n")
    for name in RUN_FOLDERS:
        shutil.rmtree(folder / name, ignore_errors=True)
    return folder


def trainer_config(fork: Path, trainer: str, config: str) -> Path:
    """The method's trainer config inside the fork: ``configs/trainers/<TRAINER>/<file>`` (the forks' layout,
    ``docs/dassl_plugin.md`` step 4), else the path of the method table (this repository's layout)."""
    candidates = [fork / "configs" / "trainers" / trainer / Path(config).name, fork / config]
    for path in candidates:
        if path.is_file():
            return path
    raise SmokeError(f"{candidates[0]}: no trainer config for {trainer}; copy it as docs/dassl_plugin.md step 4 says")


def tiny_options(files: SmokeFiles, trainer: str, model_name: str = TINY_MODEL) -> list[str]:
    """yacs options that shrink a run to the CLIP file, one epoch and two shots (appended last)."""
    options = [
        "TRAINER.GRAM.MODEL_NAME", model_name,
        "TRAINER.GRAM.WEIGHTS", str(files.clip_file),
        "TRAINER.GRAM.INIT", str(files.init_file),
        "INPUT.SIZE", f"({files.image_size or IMAGE_PX}, {files.image_size or IMAGE_PX})",
        "DATALOADER.NUM_WORKERS", "0",
        "OPTIM.MAX_EPOCH", "1",
        "DATASET.NUM_SHOTS", "2",
    ]  # fmt: skip
    if trainer == "GRAM_MaPLe":  # the config's 9 text layers > the tiny CLIP's 2
        options += ["TRAINER.GRAM.TEXT_DEPTH", "2"]
    return options


def failure_line(fork: Path, returncode: int, output: str, log: Path) -> str:
    """The one-line error of a failed ``train.py`` run: its last output line, and the checkpoint folder Dassl
    resumed when it did (``Found checkpoint at DIR (will resume training)``): an earlier run's, not this one's."""
    last = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
    resumed = RESUMED.findall(output)
    note = f"; Dassl resumed the checkpoint in {resumed[-1]}, left there by an earlier run" if resumed else ""
    return f"{fork / 'train.py'} exited with {returncode}: {last[0][:300]}{note} (full log: {log})"


def _run(fork: Path, argv: list[str], log: Path) -> str:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "train.py", *argv],
        cwd=fork,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TRAIN_TIMEOUT_S,
    )
    log.write_text(proc.stdout, encoding="utf-8")
    if proc.returncode != 0:
        raise SmokeError(failure_line(fork, proc.returncode, proc.stdout, log))
    return proc.stdout


def _check_output(text: str, trainer: str, init_file: Path, log: Path) -> float:
    """The GRAM trainer's own lines in one run's output; returns its accuracy (%)."""
    if f"GRAM trainer {trainer}: GRAM on" not in text:
        raise SmokeError(f"{log}: no 'GRAM trainer {trainer}: GRAM on' line; is 'import trainers.gram' in train.py?")
    if f"GRAM init: {init_file}" not in text:
        raise SmokeError(f"{log}: the trainer did not read TRAINER.GRAM.INIT {init_file}")
    found = ACCURACY.findall(text)
    if not found:
        raise SmokeError(f"{log}: no '* accuracy:' line")
    return float(found[-1])


def _gram_method(method_key: str):
    from meta.method.methods import get

    method = get(method_key)
    if not method.trainer or not method.gram_file:
        raise SmokeError(
            f"--method {method_key}: expected a GRAM method with a Dassl trainer, e.g. {' '.join(smoke_methods())} "
            "(python -m meta.method.methods)"
        )
    return method


def run_smoke(fork: Path, out: Path, method_key: str = "gram_coop", seed: int = 1, backbone: str = TINY_MODEL) -> dict:
    """Write the inputs, train on base classes, evaluate on new ones, in ``out/<method_key>/``, on a randomly
    initialised CLIP of architecture ``backbone``; returns accuracies and paths."""
    from meta.method.methods import get, learners
    from meta.model.backbone import check_model_name, check_visual_prompts

    fork = fork.resolve()
    out = out.resolve()
    if not (fork / "train.py").is_file():
        raise SmokeError(f"{fork}: no train.py here; --fork names the root of a CoOp-style fork")
    method = _gram_method(method_key)
    check_model_name(backbone, "--backbone")
    rows = learners()
    if rows[method.trainer].prompts_image:  # visual prompts need a ViT tower: said before anything is written
        text_only = [m for m in smoke_methods() if not rows[get(m).trainer].prompts_image]
        check_visual_prompts(backbone, "--backbone", method.key, text_only)
    dataset_cfg = fork / "configs" / "datasets" / "dtd.yaml"
    if not dataset_cfg.is_file():
        raise SmokeError(f"{dataset_cfg}: missing; the smoke dataset uses the fork's DTD config")
    config = trainer_config(fork, method.trainer, method.config)
    folder = fresh_method_folder(out, method.key)
    files = write_inputs(out, method.key, backbone)
    common = [
        "--root", str(files.data_root), "--seed", str(seed), "--trainer", method.trainer,
        "--dataset-config-file", str(dataset_cfg), "--config-file", str(config),
    ]  # fmt: skip
    train_dir, test_dir = (folder / name for name in RUN_FOLDERS)
    base_log, new_log = folder / "train_base.log", folder / "test_new.log"
    opts = tiny_options(files, method.trainer, backbone)
    text = _run(fork, [*common, "--output-dir", str(train_dir), *opts, "DATASET.SUBSAMPLE_CLASSES", "base"], base_log)
    base = _check_output(text, method.trainer, files.init_file, base_log)
    evaluate = ["--model-dir", str(train_dir), "--load-epoch", "1", "--eval-only"]
    text = _run(
        fork,
        [*common, "--output-dir", str(test_dir), *evaluate, *opts, "DATASET.SUBSAMPLE_CLASSES", "new"],
        new_log,
    )
    new = _check_output(text, method.trainer, files.init_file, new_log)
    return {"trainer": method.trainer, "config": str(config), "base_acc": base, "new_acc": new, "out": str(folder)}


def write_init_command(path: Path, method_key: str, model_name: str) -> str:
    """``--write-init``: a placeholder init file for ``method_key`` on ``model_name``; returns the line to print."""
    from meta.model.backbone import check_model_name

    method = _gram_method(method_key)
    check_model_name(model_name, "--model")
    if path.is_dir():
        raise SmokeError(f"--write-init {path}: is a folder; expected a file name such as gram_init.safetensors")
    clip, dims = _random_clip(model_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_placeholder_init(path, method.key, clip, dims)
    return (
        f"wrote {path}: a placeholder GRAM init for {method.key} ({method.trainer}) on {model_name}, random θ and "
        f"R_φ, NOT meta-trained (for wiring checks; pass it as TRAINER.GRAM.INIT {path})"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--fork", type=Path, default=Path("."), help="root of the fork (its train.py); default: .")
    parser.add_argument(
        "--method",
        default="gram_coop",
        help=f"a GRAM method key with a Dassl trainer: one per learner is {' '.join(smoke_methods())} "
        "(python -m meta.method.methods lists them all)",
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default <fork>/output/gram_smoke)")
    parser.add_argument("--write-init", type=Path, metavar="FILE", help="only write a placeholder init file FILE")
    parser.add_argument(
        "--model",
        default=PLACEHOLDER_MODEL,
        help=f"with --write-init: open_clip architecture (default {PLACEHOLDER_MODEL})",
    )
    parser.add_argument(
        "--backbone",
        default=TINY_MODEL,
        help=f"open_clip architecture of the random-weight CLIP the smoke runs on (default {TINY_MODEL}; e.g. RN50, "
        "RN101, ViT-B-16: real sizes, minutes on a CPU); visual-prompt methods need a ViT",
    )
    args = parser.parse_args(argv)
    try:
        if args.write_init is not None:
            print(write_init_command(args.write_init, args.method, args.model))
            return 0
        out = args.out if args.out is not None else args.fork / "output" / "gram_smoke"
        result = run_smoke(args.fork, out, args.method, backbone=args.backbone)
    except (SmokeError, KeyError, ValueError, OSError) as err:
        from meta.infra.cli_errors import one_line

        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    print(
        f"smoke ok: {result['trainer']} ({result['config']}) trained on base classes and evaluated on new ones: "
        f"accuracy {result['base_acc']:.1f} % / {result['new_acc']:.1f} % (random weights; logs in {result['out']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
