"""A one-minute wiring check of GRAM inside a CoOp-style fork: ``python -m gram_tools.smoke --fork DIR``.

Run it with the interpreter that runs the fork's ``train.py`` (the one ``scripts/setup.sh --with-dassl``
built), after the four steps of ``docs/dassl_plugin.md`` (install, copy ``trainers/gram``, call
``extend_gram_cfg``, add the configs).  Nothing is downloaded.  Into ``--out`` (default
``<fork>/output/gram_smoke``) it writes:

* ``data/dtd/``: a tiny dataset in CoOp's DTD layout (``images/<class>/*.jpg`` and
  ``split_zhou_DescribableTextures.json``), 4 generated classes, 32 x 32 JPEGs;
* ``tiny_clip.pt``: the 3.4 M-parameter ``GRAM-Test-Tiny`` CLIP with random weights (seed 0), as a state dict;
* ``init.safetensors``: a GRAM init file of the method's prompt shapes for that CLIP: θ as the learner starts
  it from scratch and R_φ at its own initialisation.  **It is a placeholder for wiring, not a meta-trained
  θ***; ``python -m meta train`` makes a real one;

then runs the fork's own ``train.py`` twice, as the base-to-new protocol does (train on the base classes
for one epoch; ``--eval-only`` on the new classes from that checkpoint), with the fork's
``configs/datasets/dtd.yaml`` and the method's trainer config, and checks in their output that the GRAM
trainer ran with GRAM on, read the init file and printed an accuracy.  The last line is
``smoke ok: ...`` (exit 0) or ``error: ...`` naming what was missing (exit 2).

Accuracies on random weights mean nothing; the check is that every piece is found and runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

TINY_MODEL = "GRAM-Test-Tiny"
N_CLASSES = 4  # CoOp's base / new split of 4 sorted labels: base = first 2, new = last 2
COUNTS = {"train": 3, "val": 2, "test": 3}  # images per class and split
IMAGE_PX = 32
ACCURACY = re.compile(r"^\* accuracy: ([\d.]+)%", re.M)
TRAIN_TIMEOUT_S = 600


class SmokeError(RuntimeError):
    """A missing piece of the fork's wiring, worded for the one-line error."""


@dataclass(frozen=True)
class SmokeFiles:
    """What the smoke check writes before it runs the fork."""

    data_root: Path  # holds dtd/
    clip_file: Path
    init_file: Path


def _tiny_clip():
    import torch

    from meta.model.backbone import load_clip

    logging.disable(logging.WARNING)  # open_clip logs "no pretrained weights": random weights are the point here
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)
            return load_clip(TINY_MODEL, pretrained=None)
    finally:
        logging.disable(logging.NOTSET)


def write_inputs(out: Path, method_key: str) -> SmokeFiles:
    """Write the tiny dataset, the tiny CLIP file and a placeholder init file for ``method_key`` under ``out``."""
    import torch

    from gram_tools.synthetic import write_synthetic_dtd
    from meta.evaluation.spec import method_preset
    from meta.finetune.init_io import export_gram_init
    from meta.method.prompts import PromptParams
    from meta.method.regulator import GradientRegulator, RegulatorSpec

    out.mkdir(parents=True, exist_ok=True)
    data_root = out / "data"
    if not (data_root / "dtd" / "split_zhou_DescribableTextures.json").is_file():
        write_synthetic_dtd(data_root, N_CLASSES, COUNTS, size=(IMAGE_PX, IMAGE_PX), seed=0)
    clip, dims = _tiny_clip()
    clip_file = out / "tiny_clip.pt"
    torch.save(clip.state_dict(), clip_file)
    spec = method_preset(method_key, in_memory=True).prompt_spec()
    torch.manual_seed(1)
    prompts = PromptParams.from_spec(spec, clip, dims)
    regulators = {name: GradientRegulator(int(p.shape[-1]), RegulatorSpec()) for name, p in prompts.named_parameters()}
    init_file = export_gram_init(
        out / "init.safetensors",
        prompts,
        regulators,
        dims,
        # what `python -m meta export` records, for a 2-way 2-shot support and one inner step of 0.1 (the
        # regulation window and the launch step read it); "note" says the file was never meta-trained
        provenance={
            "mode": "gram",
            "note": "gram_tools.smoke placeholder: random θ and R_φ, not meta-trained",
            "tasks": {"k_way": 2, "n_support": 2},
            "meta": {"inner_lr": 0.1, "inner_steps": 1},
        },
        weights=str(clip_file),
    )
    return SmokeFiles(data_root=data_root, clip_file=clip_file, init_file=init_file)


def trainer_config(fork: Path, trainer: str, config: str) -> Path:
    """The method's trainer config inside the fork: ``configs/trainers/<TRAINER>/<file>`` (the forks' layout,
    ``docs/dassl_plugin.md`` step 4), else the path of the method table (this repository's layout)."""
    candidates = [fork / "configs" / "trainers" / trainer / Path(config).name, fork / config]
    for path in candidates:
        if path.is_file():
            return path
    raise SmokeError(f"{candidates[0]}: no trainer config for {trainer}; copy it as docs/dassl_plugin.md step 4 says")


def tiny_options(files: SmokeFiles, trainer: str) -> list[str]:
    """yacs options that shrink a run to the tiny CLIP, one epoch and two shots (appended last)."""
    options = [
        "TRAINER.GRAM.MODEL_NAME", TINY_MODEL,
        "TRAINER.GRAM.WEIGHTS", str(files.clip_file),
        "TRAINER.GRAM.INIT", str(files.init_file),
        "INPUT.SIZE", f"({IMAGE_PX}, {IMAGE_PX})",
        "DATALOADER.NUM_WORKERS", "0",
        "OPTIM.MAX_EPOCH", "1",
        "DATASET.NUM_SHOTS", "2",
    ]  # fmt: skip
    if trainer == "GRAM_MaPLe":  # the config's 9 text layers > the tiny CLIP's 2
        options += ["TRAINER.GRAM.TEXT_DEPTH", "2"]
    return options


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
        last = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise SmokeError(f"{fork / 'train.py'} exited with {proc.returncode}: {last[0][:300]} (full log: {log})")
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


def run_smoke(fork: Path, out: Path, method_key: str = "gram_coop", seed: int = 1) -> dict:
    """Write the inputs, train on base classes, evaluate on new ones; returns accuracies and paths."""
    from meta.method.methods import get

    fork = fork.resolve()
    out = out.resolve()
    if not (fork / "train.py").is_file():
        raise SmokeError(f"{fork}: no train.py here; --fork names the root of a CoOp-style fork")
    method = get(method_key)
    if not method.trainer or not method.gram_file:
        raise SmokeError(
            f"--method {method_key}: expected a GRAM method with a Dassl trainer (python -m meta.method.methods)"
        )
    dataset_cfg = fork / "configs" / "datasets" / "dtd.yaml"
    if not dataset_cfg.is_file():
        raise SmokeError(f"{dataset_cfg}: missing; the smoke dataset uses the fork's DTD config")
    config = trainer_config(fork, method.trainer, method.config)
    files = write_inputs(out, method_key)
    common = [
        "--root", str(files.data_root), "--seed", str(seed), "--trainer", method.trainer,
        "--dataset-config-file", str(dataset_cfg), "--config-file", str(config),
    ]  # fmt: skip
    train_dir, test_dir = out / "train_base", out / "test_new"
    base_log, new_log = out / "train_base.log", out / "test_new.log"
    opts = tiny_options(files, method.trainer)
    text = _run(fork, [*common, "--output-dir", str(train_dir), *opts, "DATASET.SUBSAMPLE_CLASSES", "base"], base_log)
    base = _check_output(text, method.trainer, files.init_file, base_log)
    evaluate = ["--model-dir", str(train_dir), "--load-epoch", "1", "--eval-only"]
    text = _run(
        fork,
        [*common, "--output-dir", str(test_dir), *evaluate, *opts, "DATASET.SUBSAMPLE_CLASSES", "new"],
        new_log,
    )
    new = _check_output(text, method.trainer, files.init_file, new_log)
    return {"trainer": method.trainer, "config": str(config), "base_acc": base, "new_acc": new, "out": str(out)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--fork", type=Path, default=Path("."), help="root of the fork (its train.py); default: .")
    parser.add_argument("--method", default="gram_coop", help="a GRAM method key (python -m meta.method.methods)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default <fork>/output/gram_smoke)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.fork / "output" / "gram_smoke"
    try:
        result = run_smoke(args.fork, out, args.method)
    except (SmokeError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"smoke ok: {result['trainer']} ({result['config']}) trained on base classes and evaluated on new ones: "
        f"accuracy {result['base_acc']:.1f} % / {result['new_acc']:.1f} % (random weights; logs in {result['out']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
