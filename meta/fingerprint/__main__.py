"""``python -m meta.fingerprint [--check | --write] [--perturb-ulp] [--learners ...] [--loops ...]``: the golden
numerics fingerprint (:mod:`meta.fingerprint.golden`) on this machine, under the kernel pins
(:func:`meta.infra.numerics.pin_process`, set before torch starts)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from meta.infra.numerics import NumericsError, numerics_record, pin_process


def fingerprint_main(argv: Optional[list[str]] = None) -> int:
    """The command's work, the pins already set."""
    import time

    from meta.fingerprint.golden import GOLDEN, LEARNERS, LOOPS, compare, fingerprint

    ap = argparse.ArgumentParser(
        prog="python -m meta.fingerprint", description="The golden numerics fingerprint (meta.fingerprint.golden)."
    )
    ap.add_argument("--check", action="store_true", help=f"compare with {GOLDEN.name}; exit 1 on a mismatch")
    ap.add_argument("--write", action="store_true", help=f"replace {GOLDEN.name} with this machine's digests")
    ap.add_argument("--perturb-ulp", action="store_true", help="move one start element by one ulp")
    ap.add_argument("--learners", nargs="+", choices=list(LEARNERS), default=list(LEARNERS))
    ap.add_argument("--loops", nargs="+", choices=list(LOOPS), default=list(LOOPS))
    args = ap.parse_args(argv)
    partial = set(args.learners) != set(LEARNERS) or set(args.loops) != set(LOOPS)
    if partial and args.write:
        ap.error("--write needs every learner and loop")
    start = time.perf_counter()
    found = fingerprint(perturb_ulp=args.perturb_ulp, learners=args.learners, loops=args.loops)
    record = numerics_record()
    out = {**found, "seconds": round(time.perf_counter() - start, 1), "numerics": record}
    print(json.dumps(out, indent=1, sort_keys=True))
    if args.write:
        golden = {
            "digest": found["digest"],
            "runs": found["runs"],
            "written_on": {k: record[k] for k in ("cpu_model", "cpu_kernel_flags", "pins", "torch", "mode")},
        }
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    if args.check:
        try:
            golden = json.loads(GOLDEN.read_text())
        except (OSError, ValueError) as err:
            print(f"error: {GOLDEN}: cannot read the golden fingerprint ({err})", file=sys.stderr)
            return 2
        if partial:
            golden = {"runs": {k: v for k, v in golden["runs"].items() if k in found["runs"]}}
        differ = compare(found, golden)
        if differ:
            print(
                f"error: numerics fingerprint differs from {GOLDEN.name} in {len(differ)} of "
                f"{len(golden['runs'])} runs ({', '.join(differ)}) on {record['cpu_model']} "
                f"(mode {record['mode']}, ATen {record['aten_cpu_capability']})",
                file=sys.stderr,
            )
            return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        pin_process()  # before the golden run imports torch
    except NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return fingerprint_main(argv)


if __name__ == "__main__":
    sys.exit(main())
