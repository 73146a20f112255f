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
    p.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
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


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    from meta.config import load_meta_cfg

    cfg = load_meta_cfg(args.config_file, args.opts)
    cfg.freeze()
    rank, world, barrier = _distributed()
    from meta.chc.pipeline import run_chc

    try:
        out = run_chc(cfg, rank, world, barrier, show_progress=not args.no_progress)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if out is not None:
        print(f"CHC done: {out}/hierarchy.json, report {out}/chc_report.md")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point.  Bad input: one ``error: <file or KEY>: ...`` line, exit 2 (``--debug``: traceback)."""
    from meta.cli_errors import run_cli

    return run_cli(_main, argv)
