"""``python -m gram_world generate|pretrain|zeroshot|probe|captures [--quick] [--root DIR] [--seed N]``.

Each stage runs the stages before it when their outputs are missing and skips
itself when its own output is cached.  ``--root`` is the parent directory of
worlds (default ``$GRAM_WORLD_CACHE``, else ``./.cache/world``); each world lives in ``<root>/<settings hash>``.
``probe`` reports, per base-to-new dataset, zero-shot against linear probes on the frozen image
features (``gram_world.probe``; ``--coop`` / ``--vpt`` add a text / visual prompt fitted on all train
images); ``--weights`` probes another weights file of the world CLIP.  ``captures`` scans every capture
condition for the room it leaves a text and a visual prompt (``gram_world.capture_scan``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 threads on 2 cores are many times slower here
from meta.infra.numerics import pin_process  # noqa: E402

pin_process()  # kernel pins before torch starts (meta.infra.numerics)

import torch  # noqa: E402

from .build import build_world  # noqa: E402
from .pretrain import pretrain_clip, pretrain_settings, weights_path  # noqa: E402
from .settings import world_settings  # noqa: E402
from .zeroshot import style_clustering, zeroshot_accuracy  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gram_world", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("generate", "pretrain", "zeroshot", "probe", "captures"))
    p.add_argument("--quick", action="store_true", help="the small world and short pretraining used by tests")
    p.add_argument(
        "--root",
        type=Path,
        default=None,
        help="parent directory of worlds (default: $GRAM_WORLD_CACHE, else ./.cache/world)",
    )
    p.add_argument("--seed", type=int, default=0, help="world and pretraining seed")
    p.add_argument("--weights", type=Path, default=None, help="probe: CLIP weights (default: the pretrained ones)")
    p.add_argument("--coop", action="store_true", help="probe: also fit CoOp's context on all train images")
    p.add_argument("--vpt", action="store_true", help="probe: also fit VPT's visual tokens on all train images")
    p.add_argument(
        "--captures",
        nargs="+",
        default=(),
        metavar="CONDITION",
        help="captures: the conditions to scan (default: every one in gram_world.render.CAPTURES)",
    )
    p.add_argument("--out", type=Path, default=None, help="probe / captures: write the result as JSON here")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.time()
    world = build_world(quick=args.quick, root=args.root, seed=args.seed)
    print(f"world {world.settings_hash}: {world.root} ({time.time() - t0:.1f} s)")
    if args.stage == "generate":
        return 0
    if args.stage in ("probe", "captures") and args.weights is not None:
        if not args.weights.is_file():
            print(f"error: --weights {args.weights}: no such file", file=sys.stderr)
            return 2
        return _probe(world, args.weights, args) if args.stage == "probe" else _captures(world, args.weights, args)
    cached = weights_path(world, pretrain_settings(args.quick, args.seed)).is_file()
    t1 = time.time()
    weights = pretrain_clip(world, quick=args.quick)
    print(f"tiny CLIP weights: {weights} ({'cached' if cached else f'{time.time() - t1:.1f} s'})")
    if args.stage == "pretrain":
        return 0
    if args.stage == "probe":
        return _probe(world, weights, args)
    if args.stage == "captures":
        return _captures(world, weights, args)
    result = zeroshot_accuracy(world, weights)
    print("zero-shot accuracy (%), prompt 'a photo of a {}.':")
    for name, r in result.items():
        print(f"  {name:18s} {r['accuracy']:6.2f}  (chance {r['chance']:.2f}, {r['classes']} classes, n={r['n']})")
    styles = style_clustering(world, weights)
    print(
        f"k-means (k={styles['k']}) on image features of {styles['n']} CHC images vs true style: "
        f"ARI {styles['ari']:.3f}, NMI {styles['nmi']:.3f}"
    )
    print(json.dumps({"zeroshot": result, "style_clustering": styles}))
    return 0


def _probe(world, weights: Path, args) -> int:
    from .probe import probe_table, probe_world

    seeds = (1,) if args.quick else (1, 2, 3)
    shots = 4 if args.quick else 16  # the quick world has 16 train images per class
    result = probe_world(world, weights, seeds=seeds, shots=shots, with_coop=args.coop, with_vpt=args.vpt)
    print(probe_table(result, shots))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"weights": str(weights), "shots": shots, "seeds": list(seeds), "datasets": result}, indent=1)
        )
    return 0


def _captures(world, weights: Path, args) -> int:
    from .capture_scan import scan_captures, scan_table

    try:
        result = scan_captures(weights, args.captures, settings=world_settings(args.quick, args.seed))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(scan_table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"weights": str(weights), "captures": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
