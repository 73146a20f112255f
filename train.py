"""CoOp-style entry point: ``python train.py --root DATA --trainer GRAM_CoOp --config-file ... [KEY VALUE ...]``.

Same flags and the same set-up order as CoOp's ``train.py`` (KaiyangZhou/CoOp @ ff61507, L105-150):
Dassl defaults, ``extend_cfg``, dataset config, method
config, command-line flags, ``KEY VALUE`` options, freeze; then seed, logger (``OUTPUT_DIR/log.txt``),
environment, trainer, and ``--eval-only`` (load + test) or training.

Differences from CoOp's file:

* ``--seed 0`` is honoured (CoOp tests ``if args.seed:``, so seed 0 silently meant "no seed");
* the datasets and trainers come from this repository's ``datasets`` and ``trainers`` packages;
* what is written to stderr (Python warnings, ``warning:`` lines such as fewer images than shots, a final
  ``error:`` line) is copied into the log as well and still shown on stderr (:mod:`trainers.gram.log_tee`), so
  such notes are on record next to the numbers;
* bad input (a misspelled config key, a missing or unfit ``TRAINER.GRAM.INIT`` or weights file, an unknown
  trainer, a config file with a YAML alias) ends with one ``error: <key or file>: <what>`` line on stderr and
  exit status 2, as the ``meta`` commands do (:mod:`meta.infra.cli_errors`); ``--debug`` or ``GRAM_DEBUG=1`` shows
  the traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional, Sequence

from meta.infra.numerics import pin_process

pin_process()  # CPU kernel pins before torch starts (meta.infra.numerics)

import torch  # noqa: E402
from dassl.config import get_cfg_default  # noqa: E402
from dassl.engine import build_trainer  # noqa: E402
from dassl.utils import collect_env_info, set_random_seed, setup_logger  # noqa: E402

import datasets.coop_layout  # noqa: F401, E402  (registers the CoOp benchmark datasets)
import trainers  # noqa: F401, E402  (registers every trainer of meta/method/methods.yaml's learners:)
from trainers import extend_cfg as extend_gram_cfg  # noqa: E402
from trainers.gram.log_tee import log_stderr  # noqa: E402


def print_args(args: argparse.Namespace, cfg) -> None:
    print("***************")
    print("** Arguments **")
    print("***************")
    for key in sorted(vars(args)):
        print(f"{key}: {getattr(args, key)}")
    print("************")
    print("** Config **")
    print("************")
    print(cfg)


def reset_cfg(cfg, args: argparse.Namespace) -> None:
    """Command-line flags into cfg (CoOp's ``reset_cfg``, with ``--seed 0`` honoured)."""
    if args.root:
        cfg.DATASET.ROOT = args.root
    if args.output_dir:
        cfg.OUTPUT_DIR = args.output_dir
    if args.resume:
        cfg.RESUME = args.resume
    if args.seed is not None:
        cfg.SEED = args.seed
    if args.source_domains:
        cfg.DATASET.SOURCE_DOMAINS = args.source_domains
    if args.target_domains:
        cfg.DATASET.TARGET_DOMAINS = args.target_domains
    if args.transforms:
        cfg.INPUT.TRANSFORMS = args.transforms
    if args.trainer:
        cfg.TRAINER.NAME = args.trainer
    if args.backbone:
        cfg.MODEL.BACKBONE.NAME = args.backbone
    if args.head:
        cfg.MODEL.HEAD.NAME = args.head


def extend_cfg(cfg) -> None:
    """Add every key our trainers and datasets read (``TRAINER.GRAM.*``, ``DATASET.SUBSAMPLE_CLASSES``)."""
    extend_gram_cfg(cfg)


def _merge(where: str, merge, source) -> None:
    """``merge(source)``, with yacs' refusals (a ``KeyError`` from a file, an ``AssertionError`` from the
    command line) turned into a :class:`meta.infra.cli_errors.UserError` naming ``where``."""
    from meta.infra.cli_errors import UserError, one_line

    try:
        merge(source)
    except (KeyError, AssertionError, ValueError) as err:
        raise UserError(where, f"{one_line(err)} (keys come from Dassl's defaults and extend_cfg)") from None


def _merge_file(cfg, path: str) -> None:
    """Merge the yaml file ``path`` into ``cfg`` after a scan that refuses YAML aliases in one line naming it:
    yacs copies every alias into a tree of its own, so nested aliases grow exponentially
    (:func:`meta.config.refuse_yaml_aliases`)."""
    from meta.config import refuse_yaml_aliases

    refuse_yaml_aliases(path)
    _merge(path, cfg.merge_from_file, path)


def setup_cfg(args: argparse.Namespace):
    cfg = get_cfg_default()
    extend_cfg(cfg)
    if args.dataset_config_file:
        _merge_file(cfg, args.dataset_config_file)
    if args.config_file:
        _merge_file(cfg, args.config_file)
    reset_cfg(cfg, args)
    _merge("command-line options", cfg.merge_from_list, args.opts)
    cfg.freeze()
    return cfg


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Python warnings as one ``warning: <category>: <message>`` line, like this repository's own notes."""
    return f"warning: {category.__name__}: {' '.join(str(message).split())}\n"


def main(args: argparse.Namespace) -> None:
    cfg = setup_cfg(args)
    if cfg.SEED >= 0:
        print(f"Setting fixed seed: {cfg.SEED}")
        set_random_seed(cfg.SEED)
    setup_logger(cfg.OUTPUT_DIR)
    log_stderr()  # stderr (warnings included) into log.txt too; the trainers' check_cfg does the same
    warnings.formatwarning = _one_line_warning

    if torch.cuda.is_available() and cfg.USE_CUDA:
        torch.backends.cudnn.benchmark = True

    print_args(args, cfg)
    print(f"Seed: {cfg.SEED}" + ("" if cfg.SEED >= 0 else " (no fixed seed)"))
    print("Collecting env info ...")
    print(f"** System info **\n{collect_env_info()}\n")

    trainer = build_trainer(cfg)
    if args.eval_only:
        trainer.load_model(args.model_dir, epoch=args.load_epoch)
        trainer.test()
        return
    if not args.no_train:
        trainer.train()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=str, default="", help="path to dataset")
    parser.add_argument("--output-dir", type=str, default="", help="output directory")
    parser.add_argument("--resume", type=str, default="", help="checkpoint directory (from which the training resumes)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="fixed seed (0 included); a negative value disables seeding; default: the config's SEED",
    )
    parser.add_argument("--source-domains", type=str, nargs="+", help="source domains for DA/DG")
    parser.add_argument("--target-domains", type=str, nargs="+", help="target domains for DA/DG")
    parser.add_argument("--transforms", type=str, nargs="+", help="data augmentation methods")
    parser.add_argument("--config-file", type=str, default="", help="path to config file")
    parser.add_argument("--dataset-config-file", type=str, default="", help="path to config file for dataset setup")
    parser.add_argument("--trainer", type=str, default="", help="name of trainer")
    parser.add_argument("--backbone", type=str, default="", help="name of CNN backbone")
    parser.add_argument("--head", type=str, default="", help="name of head")
    parser.add_argument("--eval-only", action="store_true", help="evaluation only")
    parser.add_argument("--model-dir", type=str, default="", help="load model from this directory for eval-only mode")
    parser.add_argument("--load-epoch", type=int, help="load model weights at this epoch for evaluation")
    parser.add_argument("--no-train", action="store_true", help="do not call trainer.train()")
    parser.add_argument(
        "opts", default=None, nargs=argparse.REMAINDER, help="modify config options using the command-line"
    )
    return parser


def cli(argv: Optional[Sequence[str]] = None) -> None:
    main(build_parser().parse_args(argv))


if __name__ == "__main__":
    from meta.infra.cli_errors import run_cli

    sys.exit(run_cli(cli, sys.argv[1:]))
