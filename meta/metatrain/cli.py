"""``python -m meta train|export`` (dispatched here by ``meta/__main__.py``).

    python -m meta train --config-file configs/meta/train_unigram.yaml [--resume] [--output-dir D] [KEY VALUE ...]
    python -m meta export --run-dir D [--out F]

``KEY VALUE`` pairs override the config CoOp style (``META.STEPS 200 TASKS.K_WAY 10``).
``torchrun --nproc_per_node N -m meta train ...`` splits each meta-batch over N processes
(:mod:`meta.infra.distributed`); rank 0 alone prints and writes files.
Input errors end in one ``error:`` line, exit 2 (:mod:`meta.infra.cli_errors`); a run stopped by SIGTERM / Ctrl-C
exits with :data:`EXIT_STOPPED` (143) after checkpointing, as does a SIGTERM during ``export``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from yacs.config import CfgNode as CN

from meta.config import get_meta_cfg_default, load_meta_cfg
from meta.infra import distributed
from meta.infra.cli_errors import run_cli

EXIT_STOPPED = 128 + 15  # 143: stopped before the last step (a scheduler must not read it as finished)


def default_cfg() -> CN:
    """Every meta default (``meta.config``), the ``META`` node included."""
    return get_meta_cfg_default()


def build_cfg(config_file: str = "", opts: Sequence[str] = (), output_dir: Optional[str] = None) -> CN:
    """Defaults <- ``config_file`` <- ``KEY VALUE`` overrides <- ``--output-dir`` (when given, even empty:
    :func:`meta.metatrain.settings.check_meta_cfg` refuses an empty OUTPUT_DIR); frozen."""
    cfg = load_meta_cfg(config_file, opts)
    if output_dir is not None:
        cfg.OUTPUT_DIR = output_dir
    cfg.freeze()
    return cfg


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meta", description="GRAM meta-training")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser(
        "train",
        help="meta-train (or pre-train) prompts; resumable; exports at the end",
        usage="python -m meta train [--config-file F] [--resume] [--output-dir D] [KEY VALUE ...]",
    )
    tr.add_argument("--config-file", default="", help="yaml with MODEL / CHC / TASKS / META settings")
    tr.add_argument("--resume", action="store_true", help="continue OUTPUT_DIR/checkpoint.pt")
    tr.add_argument("--output-dir", default=None, help="run directory (overrides OUTPUT_DIR)")
    tr.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    ex = sub.add_parser("export", help="write the init file (and CoOp ctx) from a run's checkpoint")
    ex.add_argument("--run-dir", required=True)
    ex.add_argument("--out", default="", help="init file path (default RUN_DIR/gram_init.safetensors)")
    ex.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    return parser


def _main(argv: list[str], recorder: Optional[Callable[[Optional[str]], dict]] = None) -> int:
    parser = _parser()
    args, opts = parser.parse_known_args(argv)
    flags = [o for o in opts if o.startswith("--")]
    if flags or (opts and args.command != "train"):
        parser.error(f"unrecognized arguments: {' '.join(flags or opts)}")
    args.opts = opts  # KEY VALUE overrides, anywhere on the line
    created = distributed.init_from_env() if args.command == "train" else False
    try:
        if args.command == "train":
            from meta.metatrain.trainer import (
                train,  # lazy, as export below: learn2learn and the model code, only for the command
            )

            cfg = build_cfg(args.config_file, args.opts, args.output_dir)
            result = train(cfg, resume=args.resume, recorder=recorder)
            return EXIT_STOPPED if result.get("stopped") else 0
        from meta.metatrain.export import export_run, exported_files

        try:
            with _sigterm_raises():
                paths = export_run(args.run_dir, args.out or None)
        except _Terminated:
            print(
                f"error: --run-dir {args.run_dir}: export stopped by SIGTERM before it finished; the files are written "
                "atomically, so none was left half-written: run it again",
                file=sys.stderr,
            )
            return EXIT_STOPPED
        # absolute: these paths are pasted into forks that run from their own folders
        print("exported " + exported_files({k: Path(paths[k]).resolve() for k in ("init", "coop_ctx") if paths.get(k)}))
        if paths.get("coop_usage"):
            print(paths["coop_usage"])
    finally:
        distributed.shutdown(created)
    return 0


class _Terminated(Exception):
    """SIGTERM arrived while the export ran (:func:`_sigterm_raises`)."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises :class:`_Terminated` (the writes in progress unwind: their temporary files
    are removed or cleaned by the next run), instead of killing the process without a word; the previous handler
    comes back after.  Only from the main thread (where Python delivers signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(_signum, _frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Optional[Sequence[str]] = None, recorder: Optional[Callable[[Optional[str]], dict]] = None) -> int:
    """Entry point; ``argv`` starts with the command (``train`` or ``export``); ``--debug`` anywhere
    shows tracebacks.  ``recorder``: what computed the run, for ``run.json`` (``python -m meta`` passes
    :func:`meta.fingerprint.record.computed_by`; see :func:`meta.metatrain.trainer.train`).  Returns 0, 2 (user
    error, one line on stderr) or 143 (stopped early)."""
    return run_cli(lambda args: _main(args, recorder), argv)
