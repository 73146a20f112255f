"""Standalone few-shot evaluation: ``python -m meta.evaluation {base2new,transfer} ...``.

The library lives in :mod:`meta.evaluation`; this module is its command line.

Examples::

    # base-to-new, 3 seeds, zero-shot CLIP + CoOp + CoOp + GRAM on two world datasets
    python -m meta.evaluation base2new --dataset .cache/world/<hash>/downstream/world_curves \\
        --dataset .cache/world/<hash>/downstream/world_icons --model GRAM-World-ViT-T \\
        --pretrained .cache/world/<hash>/clip/<weights>.safetensors \\
        --methods zsclip coop gram_coop --init gram_coop=output/gram_text.safetensors \\
        --seeds 1 2 3 --shots 16 --output output/eval/b2n.jsonl

    # cross-dataset: train on one dataset (all classes), test on others
    python -m meta.evaluation transfer --source DIR --targets DIR2 DIR3 --methods coop ...

Each (dataset, method, seed) record is appended as one JSON line to ``--output`` and a summary line is printed; a mean ±
std table over seeds closes the run.  Bad input (init file, CLIP weights, image or split file) ends the run with one
``error:`` line, exit 2 (:mod:`meta.infra.cli_errors`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Optional, Sequence

from meta.config import KEY_FIELDS, TEST_TIME_SPEC, TRAIN_SPEC
from meta.evaluation import (
    PRESET_ALIASES,
    PRESET_NAMES,
    DatasetRef,
    EvaluationSession,
    MethodSpec,
    TrainSpec,
    evaluate_base_to_new,
    evaluate_transfer,
    is_gram_preset,
    method_preset,
    preset_key,
)
from meta.evaluation.spec import OPTIMIZERS
from meta.evaluation.summary import format_row, summarise
from meta.finetune.testtime import ADAPTS as TEST_TIME_ADAPTS
from meta.finetune.testtime import NO_PROMPTS, TestTimeSpec, spec_from
from meta.finetune.testtime import OPTIMIZERS as TEST_TIME_OPTIMIZERS
from meta.infra.cli_errors import int_flag_problem, run_cli
from meta.infra.provenance import results_record
from meta.method.prompts import VPT_INITS, PromptSpec
from meta.method.prototypes import FORMS as PROTOTYPE_FORMS
from meta.model.backbone import check_model_name, check_visual_prompts, load_clip, quick_gelu_flag, resolve_device


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meta.evaluation", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default="", help="CoOp DATASET.ROOT, for registered dataset names")
    common.add_argument("--model", default="ViT-B-16", help="open_clip architecture (e.g. GRAM-World-ViT-T)")
    common.add_argument("--pretrained", default="", help="local CLIP weights file or cached open_clip tag")
    common.add_argument("--quick-gelu", choices=("auto", "on", "off"), default="auto")
    common.add_argument("--device", default="cpu")
    common.add_argument(
        "--methods", nargs="+", default=["zsclip", "coop"], choices=PRESET_NAMES + tuple(PRESET_ALIASES)
    )
    common.add_argument(
        "--init",
        nargs="*",
        default=[],
        metavar="[PRESET=]PATH",
        help="GRAM init file for the gram_* / unigram presets (PATH for all, or PRESET=PATH)",
    )
    common.add_argument(
        "--ctx-init", default=PromptSpec.ctx_init, help="initialise CoOp-style text context from these words"
    )
    common.add_argument(
        "--vpt-init",
        choices=VPT_INITS,
        default=PromptSpec.vpt_init,
        help="how scratch visual prompt tokens start (vpt, joint); GRAM presets use their init file",
    )
    common.add_argument(
        "--vision-depth", type=int, default=PromptSpec.vision_depth, help="layers with visual prompts (1 = shallow VPT)"
    )
    common.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    common.add_argument("--shots", type=int, default=16)
    common.add_argument("--epochs", type=int, default=TrainSpec.epochs)
    common.add_argument("--batch-size", type=int, default=TrainSpec.batch_size)
    common.add_argument("--optimizer", choices=OPTIMIZERS, default=TrainSpec.optimizer)
    common.add_argument("--lr", type=float, default=TrainSpec.lr)
    common.add_argument("--weight-decay", type=float, default=TrainSpec.weight_decay)
    common.add_argument("--warmup-epochs", type=int, default=TrainSpec.warmup_epochs)
    common.add_argument("--warmup-lr", type=float, default=TrainSpec.warmup_lr)
    common.add_argument(
        "--aug-views",
        type=int,
        default=TrainSpec.aug_views,
        help="pre-computed augmented views per train image when the image tower is frozen",
    )
    common.add_argument("--no-augment", action="store_true", help="train on test-transformed images")
    common.add_argument(
        "--rrcrop-scale",
        nargs=2,
        type=float,
        default=list(TrainSpec.rrcrop_scale),
        metavar=("LO", "HI"),
        help="area range of the random resized crop (the demo uses 0.5 1 on its 32-px images)",
    )
    common.add_argument("--final-eval-only", action="store_true", help="skip the per-epoch test curves")
    common.add_argument("--cache-dir", default="", help="on-disk frozen-feature cache (e.g. .cache/features)")
    common.add_argument(
        "--exif-upright",
        action="store_true",
        help="turn images upright by their EXIF orientation (default: as stored, as Dassl reads them; "
        "TRAINER.GRAM.EXIF_UPRIGHT True makes train.py read them the same way)",
    )
    common.add_argument("--no-split-cache", action="store_true", help="do not read/write few-shot split caches")
    common.add_argument(
        "--test-time",
        action="store_true",
        help="score each test image after TPT from the fine-tuned θ (R_φ on the entropy gradient for a regulating "
        "method); records gain test_time with ECE and the plain numbers; --test-time-optimizer meta steps with the "
        "init file's meta-trained rule (needs the method's launch step)",
    )
    common.add_argument("--test-time-views", type=int, default=TestTimeSpec.views, help="views per image (it first)")
    common.add_argument("--test-time-confident-share", type=float, default=TestTimeSpec.confident_share)
    common.add_argument("--test-time-optimizer", choices=TEST_TIME_OPTIMIZERS, default=TestTimeSpec.optimizer)
    common.add_argument("--test-time-steps", type=int, default=TestTimeSpec.steps, help="optimiser steps per image")
    common.add_argument("--test-time-lr", type=float, default=TestTimeSpec.lr, help="AdamW's lr (adamw)")
    common.add_argument("--test-time-weight-decay", type=float, default=TestTimeSpec.weight_decay)
    common.add_argument(
        "--test-time-prototypes",
        choices=PROTOTYPE_FORMS,
        default=TestTimeSpec.prototypes,
        help="nearest: R_φ reads the image's relation to the init file's CHC prototypes (META.TEST_TIME.PROTOTYPES)",
    )
    common.add_argument(
        "--test-time-adapt",
        choices=TEST_TIME_ADAPTS,
        default=TestTimeSpec.adapt,
        help="tpt: tune θ on each image; cache: tune nothing, TDA's positive/negative feature caches over the "
        "shuffled test stream (zero-shot methods too; reads --test-time-views and --test-time-confident-share)",
    )
    common.add_argument("--output", default="", help="append one JSON line per run to this file")
    common.add_argument("--no-progress", action="store_true")
    common.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    b2n = sub.add_parser("base2new", parents=[common], help="CoCoOp base-to-new protocol")
    b2n.add_argument(
        "--eval-split",
        choices=("test", "val"),
        default="test",
        help="score the base/new test splits (the protocol) or their few-shot val splits (model selection)",
    )
    b2n.add_argument(
        "--dataset",
        action="append",
        required=True,
        help="dataset folder in CoOp/DTD layout, or a registered name with --root (repeatable)",
    )
    tr = sub.add_parser("transfer", parents=[common], help="train on a source dataset, test on targets")
    tr.add_argument("--source", required=True)
    tr.add_argument("--targets", nargs="+", required=True)
    tr.add_argument("--protocol", default="transfer", help="label of the records (cross_dataset, cross_domain)")
    return p


def _init_paths(values: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        key, sep, path = v.partition("=")
        if sep and (key in PRESET_NAMES or key in PRESET_ALIASES):
            out[preset_key(key)] = path
        else:
            out["*"] = v
    return out


def _methods(args: argparse.Namespace) -> list[MethodSpec]:
    inits = _init_paths(args.init)
    changed = {k: getattr(args, k) for k in ("vision_depth", "vpt_init") if getattr(args, k) != getattr(PromptSpec, k)}
    methods = []
    for key in map(preset_key, args.methods):
        ctx = {"ctx_init": args.ctx_init} if args.ctx_init and key in ("coop", "joint") else {}
        path = inits.get(key, inits.get("*", "")) if is_gram_preset(key) else ""
        methods.append(method_preset(key, init_path=path, **changed, **ctx))
    return methods


def _flag_problem(args: argparse.Namespace) -> str:
    """``--flag: expected ...`` for the first numeric flag out of range; ``""`` when all are in range.

    :class:`TrainSpec` and :class:`MethodSpec` check the same rules under their field names
    (``TrainSpec.epochs``); checking the flags first names what was typed on the command line."""
    minimums = {"epochs": 0, "batch_size": 1, "warmup_epochs": 0, "vision_depth": 0}
    if not args.no_augment:
        minimums["aug_views"] = 1  # pre-computed views exist only with augmentation
    problem = int_flag_problem(args, minimums)
    if problem:
        return problem
    for dest in ("lr", "warmup_lr"):
        value = getattr(args, dest)
        if not value >= 0:  # NaN too
            return f"--{dest.replace('_', '-')}: expected a number >= 0, got {value:g}"
    lo, hi = args.rrcrop_scale
    if not 0 < lo <= hi <= 1:
        return f"--rrcrop-scale: expected LO HI with 0 < LO <= HI <= 1, got {lo:g} {hi:g}"
    return ""


def _train_spec(args: argparse.Namespace) -> TrainSpec:
    """The flags :data:`meta.config.KEY_FIELDS` links to :class:`TrainSpec` fields, under those fields' names."""
    flags = {k.field: getattr(args, k.field) for k in KEY_FIELDS if k.key[:2] == "--" and k.owner == TRAIN_SPEC}
    return TrainSpec(
        **{**flags, "rrcrop_scale": tuple(args.rrcrop_scale)},
        augment="none" if args.no_augment else "coop",
        eval_every_epoch=not args.final_eval_only,
    )


def _test_time_spec(args: argparse.Namespace) -> Optional[TestTimeSpec]:
    """The ``--test-time-*`` flags :data:`meta.config.KEY_FIELDS` links to :class:`TestTimeSpec` fields (None
    without ``--test-time``); a bad value is a one-line error naming the flag."""
    if not args.test_time:
        return None
    links = [k for k in KEY_FIELDS if k.key[:2] == "--" and k.owner == TEST_TIME_SPEC]
    values = {k.field: getattr(args, k.key[2:].replace("-", "_")) for k in links}
    return spec_from(values, lambda field: f"--test-time-{field.replace('_', '-')}")


def _summary(record: dict) -> str:
    if record["protocol"] == "base2new":
        nums = f"base {record['base']:.2f}  new {record['new']:.2f}  H {record['H']:.2f}"
    else:
        targets = "  ".join(f"{k} {v:.2f}" for k, v in record["targets"].items())
        nums = f"source {record['source']:.2f}  {targets}  mean {record['target_mean']:.2f}"
    return f"{record['dataset']:<20} {record['method']:<12} seed {record['seed']}: {nums}  ({record['seconds']:.1f} s)"


def _table(records: list[dict]) -> str:
    several = len({r["dataset"] for r in records if r["protocol"] == "base2new"}) > 1
    rows = summarise(records, average="Average" if several else "")
    return "\n".join(format_row(r) for r in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: 0, or 2 with one ``error:`` line on stderr for bad input."""
    return run_cli(_main, argv)


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    problem = _flag_problem(args)
    if problem:
        raise ValueError(problem)
    methods = _methods(args)
    text_only = [key for key, m in zip(args.methods, methods) if not m.zero_shot and not m.visual_prompts]
    for key, method in zip(args.methods, methods):
        if method.visual_prompts:
            check_visual_prompts(args.model, "--model", f"--methods {key}", text_only or ["coop", "cocoop"])
    spec = _train_spec(args)
    test_time = _test_time_spec(args)
    if test_time is not None and test_time.adapt == "tpt" and any(m.zero_shot for m in methods):
        raise ValueError(f"--test-time: {NO_PROMPTS}")
    if args.command == "base2new":
        datasets = [DatasetRef.parse(d, args.root) for d in args.dataset]
    else:
        source = DatasetRef.parse(args.source, args.root)
        targets = [DatasetRef.parse(t, args.root) for t in args.targets]
    check_model_name(args.model, "--model")
    args.device = resolve_device(args.device, "--device")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not args.pretrained else "default")
        build = {"device": args.device, "quick_gelu": quick_gelu_flag(args.quick_gelu), "config_key": "--pretrained"}
        clip, dims = load_clip(args.model, args.pretrained or None, **build)
    if not args.pretrained:
        print("warning: --pretrained not given: CLIP has RANDOM weights, numbers are meaningless", file=sys.stderr)
    clip_info = {"pretrained": os.path.abspath(args.pretrained) if args.pretrained else ""}
    views = {"progress": not args.no_progress, "exif_upright": args.exif_upright, "clip_info": clip_info}
    session = EvaluationSession(clip, dims, cache_dir=args.cache_dir or None, **views)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    out = open(args.output, "a", encoding="utf-8") if args.output else None
    computed = None  # what computed the records of --output (meta.infra.provenance.results_record), once per process
    records = []
    try:
        for method in methods:
            for seed in args.seeds:
                # what every run of this method and seed shares: (clip, dims, method, seed, shots, spec) and the cache
                shared = (clip, dims, method, seed, args.shots, spec)
                cache = {"session": session, "use_split_cache": not args.no_split_cache, "test_time": test_time}
                if args.command == "base2new":
                    runs = [evaluate_base_to_new(ds, *shared, **cache, eval_split=args.eval_split) for ds in datasets]
                else:
                    runs = [evaluate_transfer(source, targets, *shared, **cache, protocol=args.protocol)]
                for record in runs:
                    records.append(record)
                    print(_summary(record), flush=True)
                    if out is not None:
                        if computed is None:
                            computed = results_record(str(args.device))
                        out.write(json.dumps({**record, "computed_by": computed}) + "\n")
                        out.flush()
    finally:
        if out is not None:
            out.close()
    print(_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
