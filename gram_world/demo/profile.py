"""The demo's stage profile: each stage's wall time, the numerics mode, and the share of matrix products in it.

Written by :func:`gram_world.demo.cli.run` as ``stage_profile.json`` and ``stage_profile.md`` beside
``results.md``.  Product seconds are those of the pinned products (:mod:`meta.infra.products`) in the demo's
process and in its pool workers; with ``GRAM_NUMERICS=fast`` torch's own kernels run and no product time is
counted.  Pool stages run on ``jobs`` processes, so their product seconds can exceed the stage's wall time: the
share is product seconds over (wall seconds x processes).  The baseline runs of the background process
(:mod:`gram_world.demo.background`) overlap CHC and meta-training and are not counted.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from meta.infra import numerics, products

from . import pool


class StageProfile:
    """Stages in the order run: ``{stage, seconds, processes, product_seconds, product_gflop, product_share}``."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    @contextmanager
    def stage(self, name: str, processes: int = 1) -> Iterator[None]:
        """Time the block as stage ``name`` run on ``processes`` processes (1 = the demo's own)."""
        mine, workers, start = products.usage(), dict(pool.WORKER_PRODUCTS), time.perf_counter()
        yield
        wall = time.perf_counter() - start
        now, pooled = products.usage(), pool.WORKER_PRODUCTS
        seconds = now["seconds"] - mine["seconds"] + pooled["seconds"] - workers["seconds"]
        gflop = now["gflop"] - mine["gflop"] + pooled["gflop"] - workers["gflop"]
        self.rows.append(
            {
                "stage": name,
                "seconds": round(wall, 1),
                "processes": processes,
                "product_seconds": round(seconds, 3),
                "product_gflop": round(gflop, 3),
                "product_share": round(seconds / (wall * processes), 3) if wall > 0 else 0.0,
            }
        )

    def seconds(self) -> dict:
        """``{stage: wall seconds}`` (what ``results.json`` records as ``timings``)."""
        return {r["stage"]: r["seconds"] for r in self.rows}

    def write(self, out: Path) -> Path:
        """``stage_profile.json`` and ``stage_profile.md`` into ``out``; returns the markdown file."""
        record = {
            "mode": numerics.mode(),
            "matrix_products": products.state()["kernel"],
            "total_seconds": round(sum(r["seconds"] for r in self.rows), 1),
            "stages": self.rows,
        }
        (out / "stage_profile.json").write_text(json.dumps(record, indent=1) + "\n")
        lines = [
            f"# Stage profile ({record['mode']} numerics; products: {record['matrix_products']})",
            "",
            "| stage | wall s | processes | product s | product GFLOP | product share |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in self.rows:
            lines.append(
                f"| {r['stage']} | {r['seconds']:.0f} | {r['processes']} | {r['product_seconds']:.0f} | "
                f"{r['product_gflop']:.0f} | {100 * r['product_share']:.0f} % |"
            )
        lines += [
            f"| total | {record['total_seconds']:.0f} | | | | |",
            "",
            "Product share = product seconds / (wall seconds x processes). Fast numerics count no product time; "
            "the background baseline runs beside CHC and meta-training are not counted.",
        ]
        md = out / "stage_profile.md"
        md.write_text("\n".join(lines) + "\n")
        return md
