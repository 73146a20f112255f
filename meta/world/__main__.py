"""``python -m meta.world generate|pretrain|zeroshot [--quick] [--root DIR] [--seed N]``.

Each stage runs the stages before it when their outputs are missing and skips
itself when its own output is cached.  ``--root`` is the parent directory of
worlds (default ``<repo>/.cache/world``); each world lives in ``<root>/<settings hash>``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")   # 2 threads on 2 cores are many times slower here

import torch  # noqa: E402

from .build import build_world  # noqa: E402
from .pretrain import pretrain_clip, pretrain_settings, weights_path  # noqa: E402
from .zeroshot import style_clustering, zeroshot_accuracy  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meta.world", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("generate", "pretrain", "zeroshot"))
    p.add_argument("--quick", action="store_true", help="the small world and short pretraining used by tests")
    p.add_argument("--root", type=Path, default=None, help="parent directory of worlds")
    p.add_argument("--seed", type=int, default=0, help="world and pretraining seed")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    t0 = time.time()
    world = build_world(quick=args.quick, root=args.root, seed=args.seed)
    print(f"world {world.settings_hash}: {world.root} ({time.time() - t0:.1f} s)")
    if args.stage == "generate":
        return 0
    cached = weights_path(world, pretrain_settings(args.quick, args.seed)).is_file()
    t1 = time.time()
    weights = pretrain_clip(world, quick=args.quick)
    print(f"tiny CLIP weights: {weights} ({'cached' if cached else f'{time.time() - t1:.1f} s'})")
    if args.stage == "pretrain":
        return 0
    result = zeroshot_accuracy(world, weights)
    print("zero-shot accuracy (%), prompt 'a photo of a {}.':")
    for name, r in result.items():
        print(f"  {name:18s} {r['accuracy']:6.2f}  (chance {r['chance']:.2f}, {r['classes']} classes, n={r['n']})")
    styles = style_clustering(world, weights)
    print(f"k-means (k={styles['k']}) on image features of {styles['n']} CHC images vs true style: "
          f"ARI {styles['ari']:.3f}, NMI {styles['nmi']:.3f}")
    print(json.dumps({"zeroshot": result, "style_clustering": styles}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
