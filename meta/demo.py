"""The main job: GRAM end to end in the CPU-sized world, ``python -m meta.demo [--quick]``.

Stages (each cached on disk, so a rerun or an interrupted run redoes only what is missing):

1. generate the procedural world (``meta.world.build_world``);
2. pretrain the tiny open_clip CLIP on its pretraining corpus and measure zero-shot accuracy;
3. Cross-modal Hierarchical Clustering of the unlabelled image-text corpus (``meta.chc``);
4. meta-train θ*/φ for CoOp, VPT and UNIGRAM, plus the paper's Table 4 ablations
   (no domain-shift simulation, no regulator, prompt pre-training, supervised meta-learning);
5. base-to-new evaluation (CoOp's protocol, ``meta.evaluation``) of zero-shot CLIP, CoOp, CoOp+GRAM,
   VPT, VPT+GRAM, UNIGRAM, the ablations and joint text+visual tuning, over seeds and datasets,
   split over ``--jobs`` worker processes (meta-training too);
6. ``results.md`` / ``results.json`` (Table-1-style base / new / H, mean ± std over seeds) and PNG plots:
   accuracy bars, gradient cosine over meta-training (Fig. 3b), accuracy vs fine-tuning epoch (Fig. 3a).

Every hyper-parameter the paper does not give is in :class:`DemoSettings` with where it came from.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class MetaVariant:
    """One meta-training run: its name, prompt shape and META/TASKS overrides."""

    name: str
    n_ctx_text: int
    n_ctx_vision: int
    overrides: tuple = ()        # extra KEY, VALUE, ... for the meta config
    regulated: bool = True       # whether the exported file carries φ


# θ shapes follow the paper (section 4.1): 4 tokens for CoOp / VPT, 2 + 2 for UNIGRAM.
META_VARIANTS = (
    MetaVariant("gram_coop", 4, 0),
    MetaVariant("gram_vpt", 0, 4),
    MetaVariant("unigram", 2, 2),
    MetaVariant("unigram_no_shift", 2, 2, ("TASKS.DOMAIN_SHIFT", False)),                  # Table 4 row 1
    MetaVariant("unigram_no_reg", 2, 2, ("META.REGULATE", False), regulated=False),         # Table 4 row 2
    MetaVariant("unigram_pretrain", 2, 2, ("META.MODE", "pretrain"), regulated=False),      # Table 4 row 3
    MetaVariant("unigram_supervised", 2, 2, ("TASKS.SOURCE", "image_folder")),              # Table 4 row 4
)

# (row label, evaluation preset, meta variant whose init it starts from or None)
EVAL_METHODS = (
    ("CLIP (zero-shot)", "zsclip", None),
    ("CoOp", "coop", None),
    ("CoOp + GRAM", "coop_gram", "gram_coop"),
    ("VPT", "vpt", None),
    ("VPT + GRAM", "vpt_gram", "gram_vpt"),
    ("UNIGRAM", "unigram", "unigram"),
    ("- domain shift simulating", "unigram", "unigram_no_shift"),
    ("- gradient regulating", "unigram", "unigram_no_reg"),
    ("- meta-learning = prompt pre-training", "unigram", "unigram_pretrain"),
    ("- CHC = supervised meta-learning", "unigram", "unigram_supervised"),
    ("joint textual & visual tuning", "joint", None),
)


@dataclass(frozen=True)
class DemoSettings:
    """Everything the demo's numbers depend on (besides the world and the CLIP settings)."""

    quick: bool = False
    seeds: tuple = (1, 2, 3)              # CoOp / CoCoOp report the mean of seeds 1, 2, 3
    datasets: tuple = ()                  # () = every world dataset with the base2new role
    shots: int = 16                       # paper: 16 shots
    epochs: int = 10                      # paper section 4.1: 10 epochs, CoCoOp's schedule
    batch_size: int = 1                   # CoCoOp's (paper: CoCoOp's schedule); batch 4 gave the same CoOp base (docs/world_baseline.md)
    eval_every_epoch: bool = True         # needed for the accuracy-vs-epoch plot
    # meta-training (values the paper does not give; ours, chosen for the CPU budget)
    meta_steps: int = 300
    meta_batch: int = 4                   # [SUPMER] / MAML miniImageNet: 4 tasks per outer step
    k_way: int = 5
    n_support: int = 4
    n_query: int = 8
    inner_lr: float = 0.1                 # core default
    checkpoint_every: int = 50
    log_detail_every: int = 25            # grad cosine (Fig. 3b) sampled every 25 steps (a detailed step costs ~1.5x a plain one)
    domains: int = 4                      # U visual domains per topic (world has 4 seen styles)
    min_per_domain: int = 8               # CHC default: fewer images per domain -> fewer domains
    min_cluster_size: int = 40            # HDBSCAN: smallest topic wanted (corpus ~ 6000 / 40 categories)
    val_tasks: int = 20                   # held-out meta-validation tasks (evaluated at step 0 and at the end)
    # Random-resized-crop area range for fine-tuning.  CoOp/Dassl use (0.08, 1) on 224-px photos; on
    # 32-px world images an 8 % crop is ~9 px and often misses the object.  Measured with the earlier
    # patch-4 world CLIP (zero-shot 18-34 %; CoOp, 16 shots, seeds 1-2, H): (0.08, 1) 30.8 / 30.3 / 36.0 on Mixed / Polygons / Icons,
    # (0.5, 1) 34.2 / 32.7 / 41.9, no augmentation 34.7 / 37.6 / 41.6.  Same setting for every method.
    rrcrop_scale: tuple = (0.5, 1.0)
    jobs: int = 2                         # worker processes for meta-training and evaluation (2 cores)

    @classmethod
    def preset(cls, quick: bool) -> "DemoSettings":
        if not quick:
            return cls()
        # the quick world has 10 labelled images per class: small tasks, small domains
        return cls(quick=True, seeds=(1,), datasets=("WorldMixed",), shots=4, epochs=2, meta_steps=10,
                   meta_batch=2, n_support=2, n_query=4, checkpoint_every=5, log_detail_every=5,
                   min_cluster_size=15, domains=2, min_per_domain=4, val_tasks=4)


def _log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ stages 1-2: world + CLIP
def stage_world(settings: DemoSettings, out: Path, world_root: Optional[Path] = None):
    from .world import build_world
    from .world.clip_io import WORLD_MODEL
    from .world.pretrain import pretrain_clip
    from .world.zeroshot import zeroshot_accuracy

    t = time.time()
    world = build_world(quick=settings.quick, root=world_root)
    _log(f"world ready at {world.root} ({time.time() - t:.0f} s)")
    t = time.time()
    weights = pretrain_clip(world, quick=settings.quick)
    _log(f"tiny CLIP weights {weights.name} ({time.time() - t:.0f} s)")
    zs_file = weights.with_suffix(".zeroshot.json")
    zeroshot = json.loads(zs_file.read_text()) if zs_file.is_file() else zeroshot_accuracy(world, weights)
    for name, r in zeroshot.items():
        _log(f"zero-shot {name}: {r['accuracy']:.1f}% (chance {r['chance']:.1f}%)")
    return world, weights, WORLD_MODEL, zeroshot


# ------------------------------------------------------------------ stage 3: CHC
def _base_cfg(model: str, weights: Path, out: Path, settings: DemoSettings):
    from .metatrain.cli import default_cfg

    cfg = default_cfg()
    cfg.MODEL.BACKBONE = model
    cfg.MODEL.PRETRAINED = str(weights)
    cfg.MODEL.DEVICE = "cpu"
    cfg.CHC.OUTPUT_DIR = str(out / "chc")
    cfg.CHC.TOPICS.MIN_CLUSTER_SIZE = settings.min_cluster_size
    cfg.CHC.DOMAINS.NUM = settings.domains
    cfg.CHC.DOMAINS.MIN_PER_DOMAIN = settings.min_per_domain
    return cfg


def stage_chc(world, weights: Path, model: str, out: Path, settings: DemoSettings):
    from . import chc

    cfg = _base_cfg(model, weights, out, settings)
    cfg.CHC.INPUT.SHARDS = [str(p) for p in world.chc_shards]
    cfg.freeze()
    t = time.time()
    chc.run_chc(cfg, show_progress=True)
    hierarchy = chc.load_hierarchy(cfg.CHC.OUTPUT_DIR)
    kept = int((hierarchy.item_topic >= 0).sum())
    _log(f"CHC: {len(hierarchy.topic_names)} topics, {kept}/{len(hierarchy.item_topic)} pairs kept "
         f"({time.time() - t:.0f} s); report {cfg.CHC.OUTPUT_DIR}/chc_report.md")
    return hierarchy


# ------------------------------------------------------------------ stage 4: meta-training
# Rough relative cost of a variant, used only to hand the expensive runs out first so two workers
# finish close together (default demo, 300 steps: UNIGRAM variants and VPT 45-58 s, CoOp 9 s,
# prompt pre-training 5 s).  Unlisted variants cost 3.
_META_COST = {"gram_coop": 1, "unigram_pretrain": 1}


def _variant_cfg(variant: MetaVariant, model: str, weights: str, out: Path, settings: DemoSettings,
                 labelled_dir: str):
    cfg = _base_cfg(model, Path(weights), out, settings)
    cfg.OUTPUT_DIR = str(out / "meta" / variant.name)
    cfg.META.HIERARCHY = cfg.CHC.OUTPUT_DIR
    cfg.META.STEPS = settings.meta_steps
    cfg.META.META_BATCH = settings.meta_batch
    cfg.META.INNER_LR = settings.inner_lr
    cfg.META.CHECKPOINT_EVERY = settings.checkpoint_every
    cfg.META.LOG_DETAIL_EVERY = settings.log_detail_every
    cfg.META.VAL_EVERY = max(settings.meta_steps, 1)
    cfg.META.VAL_TASKS = settings.val_tasks
    cfg.META.PROMPT.N_CTX_TEXT = variant.n_ctx_text
    cfg.META.PROMPT.N_CTX_VISION = variant.n_ctx_vision
    cfg.META.TENSORBOARD = False
    cfg.META.PROGRESS = False            # the parent process shows one bar over all variants
    cfg.TASKS.K_WAY = settings.k_way
    cfg.TASKS.N_SUPPORT = settings.n_support
    cfg.TASKS.N_QUERY = settings.n_query
    cfg.TASKS.IMAGE_FOLDER = labelled_dir
    cfg.merge_from_list(list(variant.overrides))
    cfg.freeze()
    return cfg


def _meta_worker(args: tuple) -> tuple:
    """Meta-train one variant in a worker process; returns ``(name, export path)``."""
    import torch

    torch.set_num_threads(1)
    from .metatrain import train

    name, model, weights, out, settings, labelled_dir = args
    variant = next(v for v in META_VARIANTS if v.name == name)
    cfg = _variant_cfg(variant, model, weights, Path(out), settings, labelled_dir)
    t = time.time()
    result = train(cfg, resume=True, echo=_log)
    seconds = time.time() - t
    _log(f"meta-trained {name}: step {result['step']} ({seconds:.0f} s)")
    return name, str(Path(cfg.OUTPUT_DIR) / cfg.META.EXPORT_NAME)


def _steps_logged(run_dir: Path) -> int:
    """Last finished outer step recorded in a run's ``log.jsonl`` (0 when none)."""
    from .metatrain.runlog import read_log

    steps = [int(r["step"]) for r in read_log(run_dir / "log.jsonl") if r.get("kind") == "train"]
    return max(steps, default=0)


def _run_with_progress(fn, tasks: list, jobs: int, total: int, done, desc: str, unit: str) -> list:
    """``fn`` over ``tasks`` in ``jobs`` spawned processes (in-process when 1) with one tqdm bar.

    ``done()`` counts finished work (polled every 2 s from files the workers write).
    """
    from tqdm import tqdm

    bar = tqdm(total=total, initial=done(), desc=desc, unit=unit, dynamic_ncols=True)
    try:
        if jobs <= 1:
            results = []
            for task in tasks:
                results.append(fn(task))
                bar.n = done()
                bar.refresh()
            return results
        with mp.get_context("spawn").Pool(jobs) as pool:
            pending = pool.map_async(fn, tasks, chunksize=1)
            while not pending.ready():
                pending.wait(2.0)
                bar.n = done()
                bar.refresh()
            return pending.get()
    finally:
        bar.n = done()
        bar.close()


def stage_meta(world, weights: Path, model: str, out: Path, settings: DemoSettings) -> dict:
    order = sorted(META_VARIANTS, key=lambda v: -_META_COST.get(v.name, 3))
    tasks = [(v.name, model, str(weights), str(out), settings, str(world.labelled_meta_dir)) for v in order]
    runs = [out / "meta" / v.name for v in order]
    jobs = max(1, min(settings.jobs, len(tasks)))
    _log(f"meta-training {len(tasks)} variants x {settings.meta_steps} steps in {jobs} process(es)")
    results = _run_with_progress(_meta_worker, tasks, jobs, total=settings.meta_steps * len(tasks),
                                 done=lambda: sum(min(_steps_logged(r), settings.meta_steps) for r in runs),
                                 desc="meta-training", unit="step")
    return dict(results)


# ------------------------------------------------------------------ stage 5: evaluation
def _job_path(out: Path, dataset: str, label: str, seed: int) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()
    return out / "runs" / dataset / slug / f"seed{seed}.json"


def _eval_worker(jobs: list, model: str, weights: str, settings: DemoSettings, out: str) -> None:
    """Run ``(dataset name, dataset dir, row label, preset, init file, regulated, seed)`` jobs; one JSON each."""
    import torch

    torch.set_num_threads(1)
    from .backbone import load_clip
    from .evaluation import DatasetRef, EvaluationSession, TrainSpec, evaluate_base_to_new, method_preset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=weights)
    session = EvaluationSession(clip, dims, cache_dir=str(Path(out) / "feature_cache"), log=lambda m: None)
    train = TrainSpec(epochs=settings.epochs, batch_size=settings.batch_size, rrcrop_scale=settings.rrcrop_scale,
                      eval_every_epoch=settings.eval_every_epoch)
    for name, dataset_dir, label, preset, init, regulated, seed in jobs:
        path = _job_path(Path(out), name, label, seed)
        if path.is_file():
            continue
        overrides = {"name": label}
        if init and not regulated:
            overrides["regulate"] = False     # the ablation's init file carries no φ
        method = method_preset(preset, init_path=init, **overrides)
        t = time.time()
        record = evaluate_base_to_new(DatasetRef.from_dir(dataset_dir, name=name), clip, dims, method, seed,
                                      shots=settings.shots, train=train, session=session, log=lambda m: None)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, default=str))
        tmp.replace(path)
        _log(f"{name:<14} {label:<38} seed {seed}: base {record['base']:5.1f}  new {record['new']:5.1f}  "
             f"H {record['H']:5.1f}  ({time.time() - t:.0f} s)")


def _eval_chunk(args: tuple) -> None:
    _eval_worker(*args)


def stage_eval(world, weights: Path, model: str, inits: dict, out: Path, settings: DemoSettings) -> list:
    names = settings.datasets or tuple(d.name for d in world.with_role("base2new"))
    regulated = {v.name: v.regulated for v in META_VARIANTS}
    jobs = [(n, str(world.dataset(n).dataset_dir), label, preset, inits[var] if var else "",
             regulated.get(var, False), seed)
            for n in names for seed in settings.seeds for label, preset, var in EVAL_METHODS]
    todo = [j for j in jobs if not _job_path(out, j[0], j[2], j[6]).is_file()]
    n_jobs = max(1, min(settings.jobs, len(todo)))
    _log(f"evaluating {len(jobs)} runs ({len(names)} datasets x {len(settings.seeds)} seeds x "
         f"{len(EVAL_METHODS)} methods; {len(jobs) - len(todo)} cached) in {n_jobs} process(es)")
    t = time.time()
    args = (model, str(weights), settings, str(out))
    if todo:
        chunks = [todo[i::n_jobs] for i in range(n_jobs)]
        _run_with_progress(_eval_chunk, [(chunk, *args) for chunk in chunks], n_jobs, total=len(jobs),
                           done=lambda: sum(_job_path(out, j[0], j[2], j[6]).is_file() for j in jobs),
                           desc="evaluation", unit="run")
    _log(f"evaluation done ({time.time() - t:.0f} s)")
    return [json.loads(_job_path(out, j[0], j[2], j[6]).read_text()) for j in jobs]


# ------------------------------------------------------------------ stage 6: tables and plots
def _mean_std(values: list) -> tuple:
    import statistics

    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def table_rows(records: list) -> list:
    """Per (dataset | "Average", method): base/new mean ± population std over seeds, H of the means.

    For "Average", each seed's accuracies are first averaged over datasets (paper Table 1a).
    """
    from .coop_data import harmonic_mean

    order = [label for label, _, _ in EVAL_METHODS]
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    rows = []
    for dataset in datasets + ["Average"]:
        for method in order:
            runs = [r for r in records if r["method"] == method and (dataset == "Average" or r["dataset"] == dataset)]
            if not runs:
                continue
            per_seed: dict = {}
            for r in runs:
                per_seed.setdefault(r["seed"], []).append(r)
            base = [sum(r["base"] for r in rs) / len(rs) for rs in per_seed.values()]
            new = [sum(r["new"] for r in rs) / len(rs) for rs in per_seed.values()]
            (bm, bs), (nm, ns) = _mean_std(base), _mean_std(new)
            rows.append({"dataset": dataset, "method": method, "seeds": sorted(per_seed), "base_mean": bm,
                         "base_std": bs, "new_mean": nm, "new_std": ns, "H": harmonic_mean(bm, nm)})
    return rows


def markdown_table(rows: list, dataset: str) -> str:
    lines = ["| method | base | new | H |", "| --- | --- | --- | --- |"]
    for r in rows:
        if r["dataset"] == dataset:
            lines.append(f"| {r['method']} | {r['base_mean']:.2f} ± {r['base_std']:.2f} | "
                         f"{r['new_mean']:.2f} ± {r['new_std']:.2f} | {r['H']:.2f} |")
    return "\n".join(lines)


def _plots(rows: list, records: list, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .evaluation import epoch_curves
    from .metatrain.runlog import read_log

    files = {}
    avg = [r for r in rows if r["dataset"] == "Average"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    x = range(len(avg))
    for i, (key, colour) in enumerate((("base_mean", "tab:blue"), ("new_mean", "tab:orange"), ("H", "tab:green"))):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r[key] for r in avg], width=0.27, color=colour,
               label=key.replace("_mean", ""),
               yerr=[r.get(key.replace("_mean", "_std"), 0.0) for r in avg] if key != "H" else None)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["method"] for r in avg], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_title("Base-to-new accuracy, average over datasets (mean ± std over seeds)")
    ax.legend()
    fig.tight_layout()
    files["bars"] = out / "accuracy_bars.png"
    fig.savefig(files["bars"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in META_VARIANTS:
        log = [r for r in read_log(out / "meta" / variant.name / "log.jsonl")
               if r.get("kind") == "train" and "grad_cosine" in r]
        if log:
            ax.plot([r["step"] for r in log], [r["grad_cosine"] for r in log], label=variant.name, marker=".")
    ax.set_xlabel("meta-training step")
    ax.set_ylabel("cos(regulated support update, query gradient)")
    ax.set_title("Gradient alignment during meta-training (Fig. 3b)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files["grad_cosine"] = out / "grad_cosine.png"
    fig.savefig(files["grad_cosine"], dpi=110)
    plt.close(fig)

    curves = epoch_curves(records)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for split, ax in zip(("base", "new"), axes):
        for method in ("CoOp", "CoOp + GRAM", "VPT", "VPT + GRAM", "UNIGRAM"):
            cs = [c for c in curves if c["method"] == method and c["epochs"]]
            if not cs:
                continue
            n = min(len(c["epochs"]) for c in cs)
            ax.plot(cs[0]["epochs"][:n], [sum(c[split][i] for c in cs) / len(cs) for i in range(n)],
                    label=method, marker=".")
        ax.set_xlabel("fine-tuning epoch")
        ax.set_title(f"{split} classes (average over datasets)")
    axes[0].set_ylabel("accuracy (%)")
    axes[1].legend(fontsize=7)
    fig.suptitle("Accuracy vs fine-tuning epoch (Fig. 3a)")
    fig.tight_layout()
    files["epochs"] = out / "accuracy_vs_epoch.png"
    fig.savefig(files["epochs"], dpi=110)
    plt.close(fig)
    return files


def stage_report(records: list, zeroshot: dict, settings: DemoSettings, out: Path, world, weights: Path,
                 timings: dict) -> Path:
    rows = table_rows(records)
    files = _plots(rows, records, out)
    datasets = [d for d in dict.fromkeys(r["dataset"] for r in rows) if d != "Average"]
    parts = [
        "# GRAM in the CPU world: base-to-new results",
        "",
        f"World `{world.root.name}` ({'quick' if settings.quick else 'default'}), tiny CLIP `{weights.name}`; "
        f"{settings.shots} shots, {settings.epochs} epochs, batch {settings.batch_size}, seeds "
        f"{', '.join(map(str, settings.seeds))}. Mean ± population std over seeds; H = harmonic mean of "
        "the mean base and new accuracies. Rows starting with '-' are UNIGRAM with one component removed "
        "(paper Table 4).",
        "",
        f"## Average over {len(datasets)} dataset(s)",
        "",
        markdown_table(rows, "Average"),
        "",
    ]
    for d in datasets:
        parts += [f"## {d}", "", markdown_table(rows, d), ""]
    parts += ["## Tiny CLIP zero-shot accuracy (\"a photo of a {}.\", test split)", "",
              "| dataset | accuracy | chance |", "| --- | --- | --- |"]
    parts += [f"| {n} | {r['accuracy']:.1f} | {r['chance']:.1f} |" for n, r in zeroshot.items()]
    parts += ["", "## Plots", ""] + [f"- `{p.name}`" for p in files.values()]
    parts += ["", "## Stage times (s)", ""] + [f"- {k}: {v:.0f}" for k, v in timings.items()]
    parts += ["", "## Settings", "", "```json", json.dumps(asdict(settings), indent=1), "```", ""]
    md = out / "results.md"
    md.write_text("\n".join(parts))
    (out / "results.json").write_text(json.dumps({"rows": rows, "zeroshot": zeroshot, "settings": asdict(settings),
                                                  "timings": timings}, indent=1))
    return md


# ------------------------------------------------------------------ main
def _check_settings(settings: DemoSettings, out: Path) -> None:
    """Cached stages are only reused under the same settings; refuse a mix with a clear message."""
    path = out / "demo_settings.json"
    current = json.loads(json.dumps(asdict(settings)))
    current.pop("jobs")  # parallelism does not change results
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            from meta.cli_errors import UserError

            raise UserError(str(out), f"holds a demo run with other settings ({', '.join(diff)}); "
                                      f"use --out DIR or delete that folder")
    else:
        path.write_text(json.dumps(current, indent=1))


def run(settings: DemoSettings, out: Path, world_root: Optional[Path] = None) -> Path:
    """All stages into ``out``; worlds (and their CLIP weights) are cached under ``world_root``
    (default ``.cache/world``).  Returns the path of ``results.md``."""
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(settings, out)
    timings = {}
    t = time.time()
    world, weights, model, zeroshot = stage_world(settings, out, world_root)
    timings["world + tiny CLIP"] = time.time() - t
    t = time.time()
    stage_chc(world, weights, model, out, settings)
    timings["CHC"] = time.time() - t
    t = time.time()
    inits = stage_meta(world, weights, model, out, settings)
    timings["meta-training"] = time.time() - t
    t = time.time()
    records = stage_eval(world, weights, model, inits, out, settings)
    timings["evaluation"] = time.time() - t
    md = stage_report(records, zeroshot, settings, out, world, weights, timings)
    print(md.read_text(), flush=True)
    return md


def main(argv: Optional[list] = None) -> int:
    """Entry point; bad input: one ``error: <file or folder>: ...`` line and exit 2 (``--debug``: traceback)."""
    from meta.cli_errors import run_cli

    return run_cli(_main, argv)


def _main(argv: list) -> int:
    parser = argparse.ArgumentParser(prog="python -m meta.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny everything (<= 5 minutes)")
    parser.add_argument("--out", default="", help="output folder (default output/demo or output/demo_quick)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--jobs", type=int, help="worker processes for meta-training and evaluation")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    args = parser.parse_args(argv)
    settings = DemoSettings.preset(args.quick)
    if args.seeds:
        settings = replace(settings, seeds=tuple(args.seeds))
    if args.jobs:
        settings = replace(settings, jobs=args.jobs)
    out = Path(args.out or REPO / "output" / ("demo_quick" if args.quick else "demo"))
    run(settings, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
