"""Timing of the standalone evaluator: ``python -m gram_tools.bench_eval --dataset DIR [...]``.

Runs one base-to-new evaluation per method on one dataset and prints, per method: seconds to
encode frozen image features (first run; cached afterwards), training seconds per epoch, test
seconds per evaluation and the total.  Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Optional, Sequence

from meta.evaluation.datasets import DatasetRef
from meta.evaluation.protocol import EvaluationSession, evaluate_base_to_new
from meta.evaluation.spec import PRESET_NAMES, TrainSpec, method_preset
from meta.infra.cli_errors import int_flag_problem


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gram_tools.bench_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True, help="dataset folder in CoOp/DTD layout")
    p.add_argument("--model", default="GRAM-Test-Tiny")
    p.add_argument("--pretrained", default="")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["zsclip", "coop", "vpt", "joint"],
        choices=[m for m in PRESET_NAMES if not m.endswith("_gram") and m != "unigram"],
    )
    p.add_argument("--shots", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--aug-views", type=int, default=10)
    args = p.parse_args(argv)
    problem = int_flag_problem(args, {"epochs": 0, "batch_size": 1, "aug_views": 1})  # --shots < 1: all images
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    import torch

    from meta.model.backbone import load_clip

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(args.model, args.pretrained or None)
    ds = DatasetRef.from_dir(args.dataset)
    spec = TrainSpec(epochs=args.epochs, batch_size=args.batch_size, aug_views=args.aug_views)
    t0 = time.perf_counter()
    session = EvaluationSession(clip, dims, log=lambda m: None)
    fingerprint_s = time.perf_counter() - t0
    print(f"torch threads {torch.get_num_threads()}  model {args.model}  CLIP fingerprint {fingerprint_s:.2f} s")
    print(f"{'method':<10} {'n_train':>7} {'total s':>8} {'train s/ep':>10} {'eval s/ep':>9} {'encode+rest s':>13}")
    for key in args.methods:
        rec = evaluate_base_to_new(
            ds,
            clip,
            dims,
            method_preset(key),
            1,
            args.shots,
            spec,
            session=session,
            use_split_cache=False,
            log=lambda m: None,
        )
        rows = [r for r in rec["history"] if "train_loss" in r]
        train_ep = statistics.mean(r["seconds"] for r in rows) if rows else 0.0
        eval_ep = statistics.mean(r["eval_seconds"] for r in rows) if rows else 0.0
        rest = rec["seconds"] - sum(r["seconds"] + r.get("eval_seconds", 0.0) for r in rows)
        print(
            f"{rec['method']:<10} {rec['n_train']:>7} {rec['seconds']:>8.2f} {train_ep:>10.2f} {eval_ep:>9.2f} "
            f"{rest:>13.2f}   (base {rec['base']:.1f} new {rec['new']:.1f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
