"""``python -m meta cluster --config-file F [KEY VALUE ...]`` (also under ``torchrun``).

Under ``torchrun --nproc_per_node G -m meta cluster ...`` the image-feature stage is
sharded over the G processes (each takes a disjoint set of tar shards), and so is the
sentence-embedding stage (each takes a block of caption chunks); rank 0 runs the filter
and the fitting stages while the others wait at a barrier.  Re-running the same command
resumes from the last finished stage / chunk.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

from meta.chc.pipeline import run_chc
from meta.config import load_meta_cfg
from meta.infra import distributed
from meta.infra.cli_errors import run_cli


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m meta cluster", description="Cross-modal Hierarchical Clustering of image-text pairs"
    )
    p.add_argument("--config-file", default="", help="yaml config (configs/meta/*.yaml)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    p.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    p.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE overrides, e.g. CHC.OUTPUT_DIR out/chc")
    return p


def _distributed():
    """(rank, world_size, barrier, created) from torchrun's environment (:mod:`meta.infra.distributed`)."""
    created = distributed.init_from_env()
    if not distributed.is_distributed():
        return 0, 1, None, created
    return distributed.rank(), distributed.world_size(), distributed.barrier, created


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_meta_cfg(args.config_file, args.opts)
    cfg.freeze()
    rank, world, barrier, created = _distributed()
    try:
        out = run_chc(cfg, rank, world, barrier, show_progress=not args.no_progress)
    finally:
        distributed.shutdown(created)
    if out is not None:
        print(f"CHC done: {out}/hierarchy.json, report {out}/chc_report.md")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point.  Bad input: one ``error: <file or KEY>: ...`` line, exit 2 (``--debug``: traceback)."""
    return run_cli(_main, argv)
