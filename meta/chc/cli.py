"""``python -m meta cluster --config-file F [KEY VALUE ...]`` (also under ``torchrun``).

Under ``torchrun --nproc_per_node G -m meta cluster ...`` the image-feature stage is
sharded over the G processes (each takes a disjoint set of tar shards); rank 0 does
the rest.  Re-running the same command resumes from the last finished stage / chunk.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meta cluster",
                                description="Cross-modal Hierarchical Clustering of image-text pairs")
    p.add_argument("--config-file", default="", help="yaml config (configs/meta/*.yaml)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides, e.g. CHC.OUTPUT_DIR out/chc")
    return p


def _distributed():
    """(rank, world_size, barrier) from torchrun's environment; a gloo/nccl group when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Ranks wait for each other after the feature stage, which can take hours.
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(hours=48))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist.get_rank(), dist.get_world_size(), dist.barrier


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    from meta.config import load_meta_cfg

    try:
        cfg = load_meta_cfg(args.config_file, args.opts)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg.freeze()
    rank, world, barrier = _distributed()
    from meta.chc.pipeline import run_chc
    from meta.chc.text_embed import DatasetsShadowError

    try:
        out = run_chc(cfg, rank, world, barrier, show_progress=not args.no_progress)
    except (FileNotFoundError, KeyError, ValueError, OSError, DatasetsShadowError) as err:
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {msg}", file=sys.stderr)
        return 2
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if out is not None:
        print(f"CHC done: {out}/hierarchy.json, report {out}/chc_report.md")
    return 0
