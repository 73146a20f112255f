"""Pinned against fast numerics, in alternation on one machine: ``python -m gram_tools.pin_ratio {bench,demo}``.

What the pins cost is a ratio, and a shared machine's speed drifts, so each target runs ``--repeats`` times as
pinned, fast, pinned, fast, ... in fresh child processes, and the table gives each run's seconds and the ratio
pinned / fast of the medians:

- ``bench``: ``python -m gram_tools.bench`` (a ViT-B/16-size meta-step, its defaults); rows are the bench's
  ``second_order_s``, ``first_order_s``, ``plain_step_s`` and ``linear_forward_s`` + ``linear_backward_s``;
- ``demo``: ``python -m gram_world.demo --quick`` (``--full``: the default demo) from nothing, each run in a fresh
  output folder and a fresh world cache (a world or CLIP built under other numerics is another world); rows are
  the stages of its ``stage_profile.json`` (:mod:`gram_world.demo.profile`).

The fast child gets ``GRAM_NUMERICS=fast`` and none of the pins; the pinned child gets the pins
(:func:`meta.infra.numerics.pinned_env`).  ``--json F`` writes every run's numbers.  Nothing else should run
on the machine meanwhile (the table says how many cores it saw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from meta.infra.cli_errors import UserError, run_cli
from meta.infra.numerics import PINS, SWITCH, pinned_env

MODES = ("pinned", "fast")
BENCH_ROWS = ("second_order_s", "first_order_s", "plain_step_s", "linear_s")


def child_env(mode: str) -> dict[str, str]:
    """The environment of a ``mode`` child: the pins, or ``GRAM_NUMERICS=fast`` without any pin."""
    base = {k: v for k, v in os.environ.items() if k not in PINS and k != SWITCH}
    base.setdefault("OMP_NUM_THREADS", "1")
    if mode == "fast":
        return {**base, SWITCH: "fast"}
    return pinned_env(base)


def _run(argv: list[str], mode: str, env: Optional[dict] = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, env={**child_env(mode), **(env or {})}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(" ".join(argv[:4]), f"the {mode} run failed with exit {done.returncode}: {tail[0]}")
    return seconds, done.stdout


def bench_run(mode: str, extra: list[str]) -> dict[str, float]:
    """One ``gram_tools.bench`` run: ``{row: seconds}`` from its last (JSON) line, plus ``wall``."""
    wall, stdout = _run([sys.executable, "-m", "gram_tools.bench", *extra], mode)
    result = json.loads(stdout.strip().splitlines()[-1])
    rows = {k: float(result[k]) for k in BENCH_ROWS if k in result}
    if result.get("linear_forward_s") is not None:
        rows["linear_s"] = float(result["linear_forward_s"]) + float(result["linear_backward_s"])
    return {**rows, "wall": wall}


def demo_run(mode: str, extra: list[str], full: bool) -> dict[str, float]:
    """One demo run from nothing in a fresh folder: ``{stage: seconds}`` from its stage profile, plus ``wall``."""
    with tempfile.TemporaryDirectory(prefix=f"pin_ratio_{mode}_") as tmp:
        out = Path(tmp) / "demo"
        argv = [sys.executable, "-m", "gram_world.demo", "--out", str(out), *([] if full else ["--quick"]), *extra]
        wall, _ = _run(argv, mode, {"GRAM_WORLD_CACHE": str(Path(tmp) / "worlds")})
        profile = json.loads((out / "stage_profile.json").read_text())
    return {**{r["stage"]: float(r["seconds"]) for r in profile["stages"]}, "wall": wall}


def alternate(run, repeats: int) -> list[dict]:
    """``run(mode)`` for pinned, fast, pinned, fast, ... (``repeats`` of each): ``[{mode, numbers}]``."""
    out = []
    for i in range(repeats):
        for mode in MODES:
            print(f"[pin_ratio] run {i + 1}/{repeats} {mode} ...", flush=True)
            out.append({"mode": mode, "numbers": run(mode)})
    return out


def table(runs: list[dict]) -> str:
    """Markdown: one row per measured quantity, each run's seconds in run order, medians' ratio pinned / fast."""
    keys = list(dict.fromkeys(k for r in runs for k in r["numbers"]))
    head = " | ".join(f"{r['mode']} {i // 2 + 1}" for i, r in enumerate(runs))
    lines = [f"| quantity (s) | {head} | pinned / fast |", "| --- |" + " ---: |" * (len(runs) + 1)]
    for key in keys:
        cells = [f"{r['numbers'][key]:.3f}" if key in r["numbers"] else "-" for r in runs]
        medians = {m: [r["numbers"][key] for r in runs if r["mode"] == m and key in r["numbers"]] for m in MODES}
        ratio = (
            f"{statistics.median(medians['pinned']) / statistics.median(medians['fast']):.2f}"
            if all(medians.values()) and statistics.median(medians["fast"]) > 0
            else "-"
        )
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gram_tools.pin_ratio", description=__doc__.splitlines()[0])
    p.add_argument("target", choices=("bench", "demo"))
    p.add_argument("--repeats", type=int, default=2, help="runs per mode (>= 1), alternated")
    p.add_argument("--full", action="store_true", help="demo: the default demo instead of --quick")
    p.add_argument("--json", default="", help="write every run's numbers to this file")
    p.epilog = "Arguments after -- go to the bench or the demo."
    return p


def _main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = _parser().parse_args(argv[:cut]), argv[cut + 1 :]
    if args.repeats < 1:
        raise UserError("--repeats", f"expected an integer >= 1, got {args.repeats}")
    if args.target == "bench":
        runs = alternate(lambda mode: bench_run(mode, extra), args.repeats)
    else:
        runs = alternate(lambda mode: demo_run(mode, extra, args.full), args.repeats)
    print(f"\n{args.target}, {os.cpu_count()} cores seen, runs in order:\n")
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "runs": runs}, indent=1) + "\n")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point; bad input: one ``error:`` line and exit 2."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
