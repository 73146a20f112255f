#!/usr/bin/env python
"""Benchmark runner behind scripts/base2new.sh, xd.sh and xdomain.sh (they exec it with $PYTHON).

    python scripts/run_methods.py {base2new|xd|xdomain} METHOD [DATASETS] [SEEDS...] [--] [KEY VALUE...]

METHOD is a key of the method table ``meta/method/methods.yaml`` that has a Dassl trainer; DATASETS
(base2new only) is ``all`` (default: the 11 benchmarks), one name or ``a,b,c``; SEEDS default to
1 2 3; trailing ``KEY VALUE`` pairs go to ``train.py`` as yacs options.  Dataset lists come from
``meta.data.coop_data``; log markers and checkpoint names from ``meta.infra.dassl_runs`` (the parser's reader).

Conventions follow CoOp's ``scripts/cocoop/*.sh`` (KaiyangZhou/CoOp @ ff61507): ``python train.py
--root --seed --trainer --dataset-config-file --config-file --output-dir [--model-dir --load-epoch
--eval-only] KEY VALUE...``, one output folder per seed, and an existing result is skipped.  Unlike
CoOp, every output folder gets ``gram_run.txt`` holding a SHA-256 of the resolved arguments and
config contents and the id of the process running it; a folder is skipped only when that hash
matches and its log is finished.  A run with the same hash whose process is gone without a finished
log (it crashed or was killed) is moved aside to ``<dir>.crashed-<time>`` and run again.  A folder
with another hash or no ``gram_run.txt`` is refused with a message (``REDO=1`` moves it aside to
``<dir>.old-<time>`` and runs again).  ``train.py``'s stderr is kept in ``<dir>/stderr.txt``.

Environment: DATA (dataset root, default <repo>/data), OUTPUT (output root, default <repo>/output),
SHOTS (default 16), EPOCHS (sets OPTIM.MAX_EPOCH and the epoch loaded for evaluation), LOAD_EPOCH
(epoch to evaluate; default EPOCHS, else read from the checkpoints), PYTHON (interpreter of
train.py; default this one), TRAIN_PY (default <repo>/train.py), CONFIGS (default <repo>/configs),
INIT (meta-learned init file for the methods that start from one: adds TRAINER.GRAM.INIT <abs
path>), REDO=1 (redo refused jobs), DRY_RUN=1 (print commands only), CHECK_PATHS (auto, 1 or 0; below).

Before the first job starts (and under DRY_RUN=1 too), the paths the runs will read are checked once,
as this repository's train.py and trainers resolve them: the folder ``<DATA>/<dataset_dir>`` of every
dataset the job list needs (``meta.data.coop_data`` layouts, e.g. ``<DATA>/dtd``; a dataset without a known
layout is not checked), the CLIP weights file (``TRAINER.GRAM.WEIGHTS`` from the dataset and method
configs and the trailing options; "" = ``~/.cache/clip/<backbone>.pt``, ``none``/``random`` = no file,
an open_clip tag is not checked) and, for methods that read a GRAM init file, INIT (or the option
``TRAINER.GRAM.INIT``): set, and a file ``meta.finetune.init_io.load_gram_init`` loads (``python -m meta export``
writes one; ``python -m gram_tools.smoke --write-init`` a placeholder for wiring checks).  The first problem stops
the runner with one ``error: ...`` line and exit status 2, before any folder is written.
CHECK_PATHS=auto (default) checks only when TRAIN_PY is this repository's train.py (another program may
read other paths); 1 checks with any TRAIN_PY, 0 never checks.

Exit status: 0 when every result is present, 1 when a job failed or was refused, 2 for bad input.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from meta.data import coop_data  # noqa: E402
from meta.infra.dassl_runs import LOG, RUN_INFO, last_checkpoint_epoch, log_finished, read_run_info  # noqa: E402
from meta.method import methods  # noqa: E402
from meta.model.clip_weights import looks_like_file, open_clip_name, resolve_weights_key  # noqa: E402

USAGE = {
    "base2new": "bash scripts/base2new.sh METHOD [DATASET|all|a,b,c] [SEEDS...] [--] [KEY VALUE ...]",
    "xd": "bash scripts/xd.sh METHOD [SEEDS...] [--] [KEY VALUE ...]",
    "xdomain": "bash scripts/xdomain.sh METHOD [SEEDS...] [--] [KEY VALUE ...]",
}
TARGETS = {
    "xd": ("xd/test", coop_data.CROSS_DATASET_TARGETS),
    "xdomain": ("xdomain/test", coop_data.CROSS_DOMAIN_TARGETS),
}
_SEED = re.compile(r"^[0-9]+$")
_YACS_KEY = re.compile(r"^[A-Z_]+\.")


class InputError(Exception):
    """Bad command line or environment (exit 2, one line)."""


class PathError(InputError):
    """A folder or file the runs would read is missing or unusable (exit 2, one ``error: ...`` line)."""


@dataclass
class Job:
    """The parsed command line: method row, dataset argument, seeds and extra yacs options."""

    protocol: str
    method: methods.Method
    dataset_arg: str = ""
    seeds: list[str] = field(default_factory=lambda: ["1", "2", "3"])
    opts: list[str] = field(default_factory=list)


@dataclass
class Env:
    """The environment variables of the module docstring, resolved."""

    data: str
    output: Path
    shots: str
    epochs: str
    load_epoch: str
    python: str
    train_py: str
    configs: Path
    init: str
    redo: bool
    dry_run: bool
    check_paths: str = "auto"

    @classmethod
    def from_environ(cls, environ: Optional[dict] = None) -> "Env":
        e = os.environ if environ is None else environ
        epochs = e.get("EPOCHS", "")
        if epochs and not _SEED.match(epochs):
            raise InputError(f"EPOCHS must be a positive integer, got '{epochs}'")
        check_paths = e.get("CHECK_PATHS") or "auto"
        if check_paths not in ("auto", "1", "0"):
            raise InputError(f"CHECK_PATHS must be auto, 1 or 0, got '{check_paths}'")
        return cls(
            data=e.get("DATA") or str(REPO / "data"),
            output=Path(e.get("OUTPUT") or REPO / "output"),
            shots=e.get("SHOTS") or "16",
            epochs=epochs,
            load_epoch=e.get("LOAD_EPOCH", ""),
            python=e.get("PYTHON") or sys.executable,
            train_py=e.get("TRAIN_PY") or str(REPO / "train.py"),
            configs=Path(e.get("CONFIGS") or REPO / "configs"),
            init=e.get("INIT", ""),
            redo=e.get("REDO", "0") == "1",
            dry_run=e.get("DRY_RUN", "0") == "1",
            check_paths=check_paths,
        )


def parse_args(protocol: str, argv: Sequence[str], env: Env) -> Job:
    """METHOD [DATASETS] [SEEDS...] [--] [KEY VALUE...] as the scripts have always read it."""
    args = list(argv)
    if not args:
        raise InputError("missing METHOD")
    try:
        row = methods.get(args.pop(0))
    except methods.MethodTableError as err:
        raise InputError(str(err)) from None
    if not row.dassl:
        raise InputError(f"method '{row.key}' has no Dassl trainer: expected one of {' '.join(methods.dassl_keys())}")
    job = Job(protocol, row)
    if (
        protocol == "base2new"
        and args
        and args[0] != "--"
        and not _SEED.match(args[0])
        and not _YACS_KEY.match(args[0])
    ):
        job.dataset_arg = args.pop(0)
    seeds = []
    while args and _SEED.match(args[0]):
        seeds.append(args.pop(0))
    job.seeds = seeds or job.seeds
    if args and args[0] == "--":
        args.pop(0)
    if len(args) % 2:
        raise InputError(f"extra options must be yacs KEY VALUE pairs, got an odd count: {' '.join(args)}")
    job.opts = args
    if env.init:  # the init file's content enters the run hash (run_hash hashes file arguments)
        if not row.gram_file:
            print(f"Warning: INIT is ignored for method '{row.key}' (GRAM off)", file=sys.stderr)
        elif not Path(env.init).is_file():
            raise InputError(f"INIT file not found: {env.init}")
        else:
            job.opts += ["TRAINER.GRAM.INIT", str(Path(env.init).resolve())]
    return job


def config_file(env: Env, row: methods.Method) -> Path:
    """The method's trainer config under CONFIGS (the table names it relative to the repository)."""
    path = env.configs / Path(row.config).relative_to("configs")
    if not path.is_file():
        raise InputError(f"missing trainer config {path} (method '{row.key}')")
    return path


# ------------------------------------------------------------------ path checks before the first job
_MISSING = object()


def dataset_names(job: Job) -> list[str]:
    """Config keys of the datasets the job list reads, in run order."""
    if job.protocol == "base2new":
        arg = job.dataset_arg
        return list(coop_data.BENCHMARK_KEYS) if arg in ("", "all") else arg.split(",")
    return [coop_data.TRANSFER_SOURCE, *TARGETS[job.protocol][1]]


def _decode(value: object) -> object:
    """A yaml or command-line value as yacs stores it (strings through ``ast.literal_eval`` when they parse)."""
    if isinstance(value, str):
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
    return value


def _read_yaml(path: Path) -> dict:
    import yaml  # PyYAML comes with yacs, which train.py needs anyway

    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PathError(f"cannot read config {path}: {' '.join(str(err).split())}") from None
    return tree if isinstance(tree, dict) else {}


class ResolvedConfig:
    """The few keys the checks need, merged as train.py merges them: dataset yaml, method yaml, options."""

    def __init__(self, files: Sequence[Path], opts: Sequence[str]):
        self.files = [(path, _read_yaml(path)) for path in files]
        self.opts = list(opts)

    def get(self, key: str, default: object = "") -> tuple[object, str]:
        """(value, where it came from): ``option KEY``, a config file's path, or ``""`` for the default."""
        value, where = default, ""
        for path, tree in self.files:
            node: object = tree
            for part in key.split("."):
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                value, where = _decode(node), str(path)
        for k, v in zip(self.opts[::2], self.opts[1::2]):
            if k == key:
                value, where = _decode(v), f"option {key}"
        return value, where


def _repo_path(value: str) -> Path:
    """A path as train.py sees it: ``~`` expanded, relative paths relative to the repository (its cwd)."""
    path = Path(os.path.expanduser(value))
    return path if path.is_absolute() else REPO / path


def check_datasets(env: Env, job: Job) -> None:
    """Every dataset with a known CoOp layout needs the folder ``<DATASET.ROOT>/<dataset_dir>``."""
    root_value, root_from = env.data, "DATA"
    for k, v in zip(job.opts[::2], job.opts[1::2]):
        if k == "DATASET.ROOT":  # merged after --root, so it wins
            root_value, root_from = v, "option DATASET.ROOT"
    root = _repo_path(root_value).resolve()
    missing = []
    for name in dataset_names(job):
        ds_yaml = env.configs / "datasets" / f"{name}.yaml"
        if not ds_yaml.is_file():
            continue  # reported by the runner as an unknown dataset
        ds_name, _ = ResolvedConfig([ds_yaml], job.opts).get("DATASET.NAME", name)
        try:
            layout = coop_data.get_layout(str(ds_name))
        except KeyError:
            try:
                layout = coop_data.get_layout(name)
            except KeyError:
                continue  # a dataset registered elsewhere: its folder is not known here
        folder = root / layout.dataset_dir
        if not folder.is_dir():
            missing.append((name, folder))
    if missing:
        name, folder = missing[0]
        root_note = "" if root.is_dir() else ", which does not exist"
        more = f"; also missing: {', '.join(n for n, _ in missing[1:])}" if len(missing) > 1 else ""
        raise PathError(
            f"dataset '{name}' not found: expected the folder {folder} ({root_from}={root_value}{root_note}; "
            f"layout: CoOp's DATASETS.md){more}"
        )


def clip_names(cfg: ResolvedConfig) -> tuple[str, str]:
    """``(MODEL.BACKBONE.NAME, the open_clip architecture the trainers build)``, as ``gram_settings`` reads them."""
    backbone = str(cfg.get("MODEL.BACKBONE.NAME")[0] or "")
    return backbone, str(cfg.get("TRAINER.GRAM.MODEL_NAME")[0] or "") or open_clip_name(backbone)


def clip_weights_file(cfg: ResolvedConfig) -> tuple[Optional[Path], str]:
    """The CLIP weights file the GRAM trainers load (``None``: random weights or an open_clip tag) and a
    note on where ``TRAINER.GRAM.WEIGHTS`` came from; as ``trainers.gram.config.gram_settings`` resolves it."""
    backbone, model_name = clip_names(cfg)
    weights, where = cfg.get("TRAINER.GRAM.WEIGHTS")
    if not str(weights).strip() and not model_name:
        raise PathError(
            "MODEL.BACKBONE.NAME and TRAINER.GRAM.MODEL_NAME are both empty, so no CLIP weights file is known "
            f"(configs: {', '.join(str(p) for p, _ in cfg.files)}; expected e.g. MODEL.BACKBONE.NAME ViT-B/16)"
        )
    value = resolve_weights_key(weights, backbone, model_name)  # the trainer's own rule (meta.model.clip_weights)
    if value is None:
        return None, ""
    if str(weights).strip():
        note = f"TRAINER.GRAM.WEIGHTS from {where}"
    else:
        arch = open_clip_name(backbone or model_name)
        note = (
            f"TRAINER.GRAM.WEIGHTS is unset: the default for {backbone or model_name}; put OpenAI's {arch}.pt "
            "there, or pass TRAINER.GRAM.WEIGHTS /path/to/weights.pt after the arguments"
        )
    if not looks_like_file(value):
        return None, f"open_clip tag {value!r}"  # meta.model.backbone.load_clip: a cached tag, not a file
    return _repo_path(value), note


def check_weights(env: Env, job: Job, cfg_path: Path) -> None:
    seen = set()
    for name in dataset_names(job):
        ds_yaml = env.configs / "datasets" / f"{name}.yaml"
        files = ([ds_yaml] if ds_yaml.is_file() else []) + [cfg_path]
        path, note = clip_weights_file(ResolvedConfig(files, job.opts))
        if path is None or path in seen:
            continue
        seen.add(path)
        if not path.is_file():
            raise PathError(f"CLIP weights file not found: {path} ({note})")


def check_init(env: Env, job: Job, cfg_path: Path) -> None:
    """Methods that read a GRAM init file need INIT (or TRAINER.GRAM.INIT) naming a loadable one."""
    row = job.method
    if not row.gram_file:
        return
    resolved = ResolvedConfig([cfg_path], job.opts)
    value, where = resolved.get("TRAINER.GRAM.INIT")
    value = str(value or "").strip()
    if not value:
        model = clip_names(resolved)[1]
        raise PathError(
            f"method '{row.key}' starts from a GRAM init file but INIT is unset: set "
            "INIT=/path/to/gram_init.safetensors (python -m meta export --run-dir <meta-training run> writes it; "
            f"a placeholder for wiring checks: python -m gram_tools.smoke --write-init FILE --method {row.key}"
            f"{' --model ' + model if model else ''})"
        )
    key = (
        "INIT" if env.init else ("TRAINER.GRAM.INIT" if where.startswith("option") else f"TRAINER.GRAM.INIT in {where}")
    )
    path = _repo_path(value)
    if not path.is_file():
        raise PathError(f"{key} file not found: {path}")
    try:
        from meta.finetune.init_io import load_gram_init
    except ImportError as err:  # train.py could not load it either
        raise PathError(f"{key} cannot be checked: meta.finetune.init_io does not import ({err})") from None
    try:
        load_gram_init(path, config_key=key)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise PathError(
            f"{' '.join(str(err).split())} (expected a GRAM init file, as python -m meta export writes)"
        ) from None


def check_paths(env: Env, job: Job, cfg_path: Path) -> bool:
    """Run the checks once (CHECK_PATHS rule of the module docstring); True when they ran."""
    if env.check_paths == "0":
        return False
    if env.check_paths == "auto" and Path(env.train_py).resolve() != (REPO / "train.py").resolve():
        return False
    check_datasets(env, job)
    check_weights(env, job, cfg_path)
    check_init(env, job, cfg_path)
    return True


def run_hash(mode: str, args: Sequence[str]) -> str:
    """SHA-256 over what defines a result: every argument but --root/--output-dir and their values,
    the contents of file arguments and the run hash of a ``--model-dir``.

    Byte for byte the stream the former bash runner hashed, so its finished folders are still reused.
    """
    lines = [f"mode {mode}"]
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--root", "--output-dir"):
            skip = True
            continue
        lines.append(f"arg {a}")
        path = REPO / a  # relative paths are relative to the repository root, where train.py runs
        if path.is_file():
            lines.append(f"file-sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}")
        elif (path / RUN_INFO).is_file():
            lines.append(f"model-run {read_run_info(path).get('hash', '')}")
    return hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()


def pid_alive(pid: str) -> bool:
    """True when ``pid`` is a live benchmark runner (its command line mentions ``scripts/``)."""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, OverflowError):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # no /proc (macOS): ask ps
        cmdline = subprocess.run(["ps", "-o", "args=", "-p", pid], capture_output=True, text=True).stdout
    return "scripts/" in cmdline


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


class Runner:
    """Runs ``train.py`` jobs into output folders with the skip / refuse / crashed-rerun rules."""

    def __init__(self, env: Env, job: Job):
        self.env, self.job = env, job
        self.failed = False

    def fail(self, message: str) -> None:
        print(message, file=sys.stderr)
        self.failed = True

    def run(self, mode: str, run_dir: Path, args: list[str]) -> bool:
        """Run ``$PYTHON $TRAIN_PY args`` into ``run_dir`` (mode train|eval) unless an identical
        finished run is there; True when the result is (now) present."""
        env = self.env
        digest = run_hash(mode, args)
        why = ""
        if run_dir.exists():
            info = read_run_info(run_dir)
            old, old_pid = info.get("hash", ""), info.get("pid", "")
            finished = log_finished(run_dir, mode)
            if old and old == digest and not finished and not pid_alive(old_pid):
                crashed = Path(f"{run_dir}.crashed-{_stamp()}")
                print(
                    f"Rerunning {run_dir}: its earlier run did not finish and its process is gone (moved to {crashed})"
                )
                if not env.dry_run:
                    run_dir.rename(crashed)
            elif not old:
                why = "it has no gram_run.txt, so its configuration is unknown"
            elif old != digest:
                why = (
                    f"it was run with different arguments or configs (hash {old[:12]} != {digest[:12]}; "
                    f"see {run_dir / RUN_INFO})"
                )
            elif not finished:
                why = f"it is still running (process {old_pid})"
            else:
                print(f"The results exist at {run_dir} (same configuration, so skip this job)")
                return True
        if why:
            if not env.redo:
                self.fail(f"Refusing to reuse {run_dir}: {why}. Rerun with REDO=1 to move it aside and redo the job.")
                return False
            aside = Path(f"{run_dir}.old-{_stamp()}")
            print(f"REDO=1: moving {run_dir} to {aside} ({why})")
            if not env.dry_run:
                run_dir.rename(aside)
        print(f"+ {env.python} {env.train_py} {' '.join(args)}", flush=True)
        if env.dry_run:
            return True
        run_dir.mkdir(parents=True, exist_ok=True)
        info_lines = [
            f"hash {digest}",
            f"mode {mode}",
            f"pid {os.getpid()}",
            f"python {env.python}",
            f"date {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        ] + [f"arg {a}" for a in args]
        (run_dir / RUN_INFO).write_text("".join(line + "\n" for line in info_lines))
        stderr_path = run_dir / "stderr.txt"
        with open(
            stderr_path, "w", errors="replace"
        ) as kept:  # train.py's stderr: on the terminal and kept in the folder
            proc = subprocess.Popen([env.python, env.train_py, *args], cwd=REPO, stderr=subprocess.PIPE)
            for chunk in iter(lambda: proc.stderr.read1(65536), b""):  # read1: progress bars pass at once
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
                kept.write(chunk.decode(errors="replace"))
                kept.flush()
            code = proc.wait()
        if code != 0:
            log = run_dir / LOG
            see = f"{log} and {stderr_path}" if log.is_file() and log.stat().st_size > 0 else str(stderr_path)
            self.fail(f"FAILED ({mode}): {run_dir} (see {see})")
            return False
        return True

    def load_epoch(self, train_dir: Path) -> Optional[str]:
        """Epoch to evaluate: LOAD_EPOCH, EPOCHS, else the last checkpoint (a placeholder under DRY_RUN)."""
        env = self.env
        if env.load_epoch or env.epochs:
            return env.load_epoch or env.epochs
        if env.dry_run:  # nothing was trained, so there is no checkpoint to read
            return "LAST"
        epoch = last_checkpoint_epoch(train_dir)
        if epoch is None:
            self.fail(f"no checkpoint found under {train_dir} and neither LOAD_EPOCH nor EPOCHS is set")
            return None
        return str(epoch)

    def dataset_config(self, name: str) -> Optional[Path]:
        path = self.env.configs / "datasets" / f"{name}.yaml"
        if not path.is_file():
            self.fail(f"unknown dataset '{name}': missing {path}")
            return None
        return path

    def epoch_opts(self) -> list[str]:
        return ["OPTIM.MAX_EPOCH", self.env.epochs] if self.env.epochs else []

    def base_args(self, seed: str, cfg: Path) -> list[str]:
        return [
            "--root",
            self.env.data,
            "--seed",
            seed,
            "--trainer",
            self.job.method.trainer,
            "--config-file",
            str(cfg),
        ]

    def base2new(self, cfg: Path) -> None:
        """CoCoOp's base-to-new protocol (CoOp scripts/cocoop/base2new_{train,test}.sh): train on the base
        half with SHOTS shots, evaluate the last checkpoint on the new half (zero-shot: both halves)."""
        job, env = self.job, self.env
        for name in dataset_names(job):
            ds_cfg = self.dataset_config(name)
            if ds_cfg is None:
                continue
            for seed in job.seeds:
                common = f"{name}/shots_{env.shots}/{job.method.key}/seed{seed}"
                train_dir = env.output / "base2new" / "train_base" / common
                test_dir = env.output / "base2new" / "test_new" / common
                base = self.base_args(seed, cfg)
                base[6:6] = ["--dataset-config-file", str(ds_cfg)]  # CoOp's argument order (run hashes rely on it)

                def half(sub: str) -> list[str]:
                    return ["DATASET.NUM_SHOTS", env.shots, "DATASET.SUBSAMPLE_CLASSES", sub]

                if job.method.zero_shot:
                    self.run(
                        "eval",
                        train_dir,
                        base + ["--output-dir", str(train_dir), "--eval-only"] + half("base") + job.opts,
                    )
                    self.run(
                        "eval", test_dir, base + ["--output-dir", str(test_dir), "--eval-only"] + half("new") + job.opts
                    )
                    continue
                if not self.run(
                    "train",
                    train_dir,
                    base + ["--output-dir", str(train_dir)] + half("base") + self.epoch_opts() + job.opts,
                ):
                    continue
                epoch = self.load_epoch(train_dir)
                if epoch is None:
                    continue
                self.run(
                    "eval",
                    test_dir,
                    base
                    + [
                        "--output-dir",
                        str(test_dir),
                        "--model-dir",
                        str(train_dir),
                        "--load-epoch",
                        epoch,
                        "--eval-only",
                    ]
                    + half("new")
                    + job.opts,
                )

    def transfer(self, cfg: Path) -> None:
        """Train on all ImageNet classes with SHOTS shots (into $OUTPUT/xd/train_imagenet/..., shared by
        xd and xdomain), then evaluate on every target (CoOp scripts/cocoop/xd_{train,test}.sh)."""
        job, env = self.job, self.env
        subdir, targets = TARGETS[job.protocol]
        source = coop_data.TRANSFER_SOURCE
        src_cfg = self.dataset_config(source)
        if src_cfg is None:
            return
        for seed in job.seeds:
            train_dir = env.output / "xd" / f"train_{source}" / f"shots_{env.shots}" / job.method.key / f"seed{seed}"
            base = self.base_args(seed, cfg)
            if job.method.zero_shot:
                self.run(
                    "eval",
                    train_dir,
                    base
                    + ["--dataset-config-file", str(src_cfg), "--output-dir", str(train_dir), "--eval-only"]
                    + job.opts,
                )
                model_args: list[str] = []
            else:
                if not self.run(
                    "train",
                    train_dir,
                    base
                    + [
                        "--dataset-config-file",
                        str(src_cfg),
                        "--output-dir",
                        str(train_dir),
                        "DATASET.NUM_SHOTS",
                        env.shots,
                    ]
                    + self.epoch_opts()
                    + job.opts,
                ):
                    continue
                epoch = self.load_epoch(train_dir)
                if epoch is None:
                    continue
                model_args = ["--model-dir", str(train_dir), "--load-epoch", epoch]
            for target in targets:
                ds_cfg = self.dataset_config(target)
                if ds_cfg is None:
                    continue
                test_dir = env.output / subdir / target / f"shots_{env.shots}" / job.method.key / f"seed{seed}"
                self.run(
                    "eval",
                    test_dir,
                    base
                    + ["--dataset-config-file", str(ds_cfg), "--output-dir", str(test_dir)]
                    + model_args
                    + ["--eval-only"]
                    + job.opts,
                )


def main(argv: Optional[Sequence[str]] = None) -> int:
    sys.stdout.reconfigure(line_buffering=True)  # our lines and train.py's stay in order
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in USAGE:
        print(f"usage: python scripts/run_methods.py {{{'|'.join(USAGE)}}} METHOD ...", file=sys.stderr)
        return 2
    protocol, rest = args[0], args[1:]
    if rest[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE[protocol]}\n\n{__doc__.split(chr(10) * 2, 2)[2]}")
        return 0
    try:
        env = Env.from_environ()
        job = parse_args(protocol, rest, env)
        cfg = config_file(env, job.method)
        check_paths(env, job, cfg)
    except PathError as err:  # not a usage problem: no usage line
        print(f"error: {err}", file=sys.stderr)
        return 2
    except InputError as err:
        print(err, file=sys.stderr)
        print(f"usage: {USAGE[protocol]}", file=sys.stderr)
        return 2
    runner = Runner(env, job)
    if protocol == "base2new":
        runner.base2new(cfg)
    else:
        runner.transfer(cfg)
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
