"""The main job: GRAM end to end in the CPU-sized world, ``python -m gram_world.demo [--quick]``.

Stages (each cached on disk, so a rerun or an interrupted run redoes only what is missing):

1. generate the procedural world (``gram_world.build_world``) from ``--world-seed`` (and optionally
   another held-out style / mixed-dataset classes), each world in its own cache folder;
2. pretrain the world's tiny open_clip CLIP on its pretraining corpus and measure zero-shot accuracy;
3. Cross-modal Hierarchical Clustering of the unlabelled image-text corpus (``meta.chc``);
4. meta-train θ*/φ for CoOp, VPT and UNIGRAM, the paper's Table 4 ablations (no domain-shift
   simulation, no regulator, prompt pre-training, supervised meta-learning) and, for Table A3,
   UNIGRAM with 2 / 6 / 8 prompt tokens;
5. evaluation (``meta.evaluation``, CoOp's protocols) over seeds, split over ``--jobs`` worker
   processes (meta-training too): base-to-new on every base2new dataset (Tables 1, 4, A3) and
   transfer - fine-tune on all classes of the mixed source, test on its held-out-style twin and
   on the four family datasets (Tables 2, 3 and, at fewer shots, A1, A2);
6. ``results.md`` / ``results.json`` (every table with the paper's row names, mean ± std over seeds)
   and PNG plots (``gram_world.demo_report``).

``--tables`` picks the table groups (:data:`TABLE_GROUPS`); the method rows of every table are
defined once, in :data:`METHODS` (stable key, paper label, evaluator preset, meta variant).
Every hyper-parameter the paper does not give is in :class:`DemoSettings` with where it came from.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Optional



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

# Table A3 varies UNIGRAM's total prompt-token count over 2 / 4 / 6 / 8.  The paper does not say how
# a count is split between the towers; ours: half text, half visual (n // 2 + n - n // 2), so 4 is
# UNIGRAM's own 2 + 2 and needs no extra run.
TOKEN_COUNTS = (2, 4, 6, 8)
TOKEN_VARIANTS = tuple(MetaVariant(f"unigram_{n}tok", n // 2, n - n // 2) for n in TOKEN_COUNTS if n != 4)
ALL_VARIANTS = META_VARIANTS + TOKEN_VARIANTS
VARIANT_BY_NAME = {v.name: v for v in ALL_VARIANTS}


@dataclass(frozen=True)
class MethodRow:
    """One row of the paper's tables: stable key (results.json, run folders), paper label,
    evaluator preset and the meta variant whose θ*/φ it starts from ("" = none)."""

    key: str
    label: str
    preset: str
    variant: str = ""


METHODS = (
    MethodRow("zsclip", "CLIP", "zsclip"),
    MethodRow("coop", "CoOp", "coop"),
    MethodRow("gram_coop", "CoOp + GRAM", "gram_coop", "gram_coop"),
    MethodRow("vpt", "VPT", "vpt"),
    MethodRow("gram_vpt", "VPT + GRAM", "gram_vpt", "gram_vpt"),
    MethodRow("unigram", "UNIGRAM", "unigram", "unigram"),
    MethodRow("unigram_no_shift", "- domain shift simulating", "unigram", "unigram_no_shift"),
    MethodRow("unigram_no_reg", "- gradient regulating", "unigram", "unigram_no_reg"),
    MethodRow("unigram_pretrain", "- meta-learning = prompt pre-training", "unigram", "unigram_pretrain"),
    MethodRow("unigram_supervised", "- CHC = supervised meta-learning", "unigram", "unigram_supervised"),
    MethodRow("joint", "joint textual & visual prompt tuning", "joint"),
) + tuple(MethodRow(v.name, f"UNIGRAM, {v.n_ctx_text + v.n_ctx_vision} prompt tokens", "unigram", v.name)
          for v in TOKEN_VARIANTS)
METHOD_BY_KEY = {m.key: m for m in METHODS}

# Which rows each table holds (keys of METHODS), in the paper's order.  CoCoOp, a row of the
# paper's Tables 1-3, is not implemented here.
TABLE1_KEYS = ("zsclip", "coop", "gram_coop", "vpt", "gram_vpt", "unigram")
TABLE4_KEYS = ("unigram", "unigram_no_shift", "unigram_no_reg", "unigram_pretrain", "unigram_supervised", "joint")
TRANSFER_KEYS = TABLE1_KEYS
TOKEN_KEYS = {n: ("unigram" if n == 4 else f"unigram_{n}tok") for n in TOKEN_COUNTS}

# Table groups of ``--tables``: what each one evaluates and which meta variants it needs.
TABLE_GROUPS = {
    "base2new": "Table 1 (base-to-new), Table 4 (ablations), Fig. 3a, Fig. 3b",
    "transfer": "Tables 2 and 3 (cross-domain, cross-dataset) and A1 / A2 (the same at fewer shots)",
    "tokens": "Table A3 (UNIGRAM with 2 / 4 / 6 / 8 prompt tokens)",
}
DEFAULT_TABLES = ("base2new",)
def b2n_keys(tables: tuple) -> tuple:
    """Method keys evaluated base-to-new for the table groups ``tables``."""
    keys: tuple = ()
    if "base2new" in tables:
        keys += TABLE1_KEYS + TABLE4_KEYS
    if "tokens" in tables:
        keys += tuple(TOKEN_KEYS.values())
    return tuple(dict.fromkeys(keys))


def transfer_keys(tables: tuple) -> tuple:
    return TRANSFER_KEYS if "transfer" in tables else ()


def variants_needed(tables: tuple) -> tuple:
    """Meta variants the table groups start from, in :data:`ALL_VARIANTS` order."""
    names = {METHOD_BY_KEY[k].variant for k in b2n_keys(tables) + transfer_keys(tables)} - {""}
    if "base2new" in tables:
        names |= {v.name for v in META_VARIANTS}      # Fig. 3b plots every Table 1 / 4 variant
    return tuple(v for v in ALL_VARIANTS if v.name in names)


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
    # which world: its seed, and (field, value) pairs replacing fields of gram_world.world_settings(quick,
    # world_seed) - e.g. (("holdout_style", "cartoon"), ("mixed_classes", (...))) - or of the tiny CLIP's
    # gram_world.pretrain_settings(quick, world_seed).  All of them change the world's (or the CLIP's)
    # settings hash, hence its cache folder.
    world_seed: int = 0
    world: tuple = ()
    clip: tuple = ()
    tables: tuple = DEFAULT_TABLES        # table groups to compute (TABLE_GROUPS); results do not depend on it
    # shots of Tables 2 / 3 and of Tables A1 / A2; () = (shots, 4) (paper: 16 and 4), or (shots, shots // 2)
    # when shots <= 4 (the quick demo's 4 and 2)
    transfer_shots: tuple = ()

    @property
    def transfer_shot_counts(self) -> tuple:
        if self.transfer_shots:
            return tuple(self.transfer_shots)
        return (self.shots, 4) if self.shots > 4 else (self.shots, max(1, self.shots // 2))

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
def _override(base, pairs: tuple, what: str):
    """``dataclasses.replace(base, **dict(pairs))`` with a one-line error naming an unknown field."""
    if not pairs:
        return base
    changes = dict(pairs)
    known = {f.name for f in fields(base)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"DemoSettings.{what}: {type(base).__name__} has no field {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return replace(base, **{k: tuple(v) if isinstance(v, list) else v for k, v in changes.items()})


def demo_world_settings(settings: DemoSettings):
    """The :class:`gram_world.WorldSettings` of this demo: seed ``world_seed`` plus the ``world`` overrides."""
    from .settings import world_settings

    return _override(world_settings(quick=settings.quick, seed=settings.world_seed), settings.world, "world")


def demo_pretrain_settings(settings: DemoSettings):
    """The tiny CLIP's :class:`gram_world.PretrainSettings` (seeded by the world seed) plus ``clip`` overrides."""
    from .pretrain import pretrain_settings

    return _override(pretrain_settings(settings.quick, seed=settings.world_seed), settings.clip, "clip")


def stage_world(settings: DemoSettings, out: Path, world_root: Optional[Path] = None):
    from .build import build_world
    from .pretrain import pretrain_clip
    from .zeroshot import zeroshot_accuracy

    t = time.time()
    world = build_world(root=world_root, settings=demo_world_settings(settings))
    _log(f"world {world.settings_hash} (seed {settings.world_seed}) ready at {world.root} ({time.time() - t:.0f} s)")
    t = time.time()
    clip_settings = demo_pretrain_settings(settings)
    weights = pretrain_clip(world, settings=clip_settings)
    _log(f"tiny CLIP weights {weights.name} ({time.time() - t:.0f} s)")
    zs_file = weights.with_suffix(".zeroshot.json")
    zeroshot = json.loads(zs_file.read_text()) if zs_file.is_file() else zeroshot_accuracy(world, weights)
    for name, r in zeroshot.items():
        _log(f"zero-shot {name}: {r['accuracy']:.1f}% (chance {r['chance']:.1f}%)")
    return world, weights, clip_settings.model_name, zeroshot


# ------------------------------------------------------------------ stage 3: CHC
def _base_cfg(model: str, weights: Path, out: Path, settings: DemoSettings):
    from meta.metatrain.cli import default_cfg

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
    from meta import chc

    cfg = _base_cfg(model, weights, out, settings)
    cfg.CHC.INPUT.SHARDS = [str(p) for p in world.chc_shards]
    cfg.freeze()
    t = time.time()
    done = Path(cfg.CHC.OUTPUT_DIR)
    # CHC resumes stage by stage but always rewrites its final files; the folder's settings are
    # checked (_check_settings), so a finished hierarchy (report written last) is reused as it is
    if not ((done / "hierarchy.json").is_file() and (done / "chc_report.md").is_file()):
        chc.run_chc(cfg, show_progress=True)
    hierarchy = chc.load_hierarchy(cfg.CHC.OUTPUT_DIR)
    kept = int((hierarchy.item_topic >= 0).sum())
    _log(f"CHC: {len(hierarchy.topic_names)} topics, {kept}/{len(hierarchy.item_topic)} pairs kept "
         f"({time.time() - t:.0f} s); report {cfg.CHC.OUTPUT_DIR}/chc_report.md")
    return hierarchy


# ------------------------------------------------------------------ stage 4: meta-training
# Rough relative cost of a variant, used only to hand the expensive runs out first so two workers
# finish close together (default demo, 300 steps: UNIGRAM variants and VPT 45-58 s, CoOp 9 s,
# prompt pre-training 5 s).  Unlisted variants cost 3 (token-count variants: about UNIGRAM's).
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
    from meta.metatrain import train

    name, model, weights, out, settings, labelled_dir = args
    variant = VARIANT_BY_NAME[name]
    cfg = _variant_cfg(variant, model, weights, Path(out), settings, labelled_dir)
    t = time.time()
    result = train(cfg, resume=True, echo=_log)
    seconds = time.time() - t
    _log(f"meta-trained {name}: step {result['step']} ({seconds:.0f} s)")
    return name, str(Path(cfg.OUTPUT_DIR) / cfg.META.EXPORT_NAME)


def _steps_logged(run_dir: Path) -> int:
    """Last finished outer step recorded in a run's ``log.jsonl`` (0 when none)."""
    from meta.metatrain.runlog import read_log

    steps = [int(r["step"]) for r in read_log(run_dir / "log.jsonl") if r.get("kind") == "train"]
    return max(steps, default=0)


def _run_with_progress(fn, tasks: list, jobs: int, total: int, done, desc: str, unit: str,
                       initializer=None, initargs: tuple = ()) -> list:
    """``fn`` over ``tasks`` in ``jobs`` spawned processes (in-process when 1) with one tqdm bar.

    ``done()`` counts finished work (polled every 2 s from files the workers write);
    ``initializer(*initargs)`` prepares each process once (in-process too).
    """
    from tqdm import tqdm

    bar = tqdm(total=total, initial=done(), desc=desc, unit=unit, dynamic_ncols=True)
    try:
        if jobs <= 1:
            if initializer is not None:
                initializer(*initargs)
            results = []
            for task in tasks:
                results.append(fn(task))
                bar.n = done()
                bar.refresh()
            return results
        with mp.get_context("spawn").Pool(jobs, initializer=initializer, initargs=initargs) as pool:
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
    """Meta-train every variant the requested tables need; returns ``{variant name: init file}``.

    A variant whose log reached ``meta_steps`` and whose init file exists is not started again."""
    needed = variants_needed(settings.tables)
    exports = {v.name: Path(cfg.OUTPUT_DIR) / cfg.META.EXPORT_NAME for v in needed
               for cfg in [_variant_cfg(v, model, str(weights), out, settings, str(world.labelled_meta_dir))]}
    finished = {v.name for v in needed
                if exports[v.name].is_file() and _steps_logged(out / "meta" / v.name) >= settings.meta_steps}
    order = sorted((v for v in needed if v.name not in finished), key=lambda v: -_META_COST.get(v.name, 3))
    tasks = [(v.name, model, str(weights), str(out), settings, str(world.labelled_meta_dir)) for v in order]
    runs = [out / "meta" / v.name for v in order]
    jobs = max(1, min(settings.jobs, len(tasks)))
    _log(f"meta-training {len(tasks)} variants x {settings.meta_steps} steps in {jobs} process(es) "
         f"({len(finished)} finished before)")
    if tasks:
        _run_with_progress(_meta_worker, tasks, jobs, total=settings.meta_steps * len(tasks),
                           done=lambda: sum(min(_steps_logged(r), settings.meta_steps) for r in runs),
                           desc="meta-training", unit="step")
    return {name: str(path) for name, path in exports.items()}


# ------------------------------------------------------------------ stage 5: evaluation
@dataclass(frozen=True)
class EvalJob:
    """One evaluation run: base-to-new on ``dataset``, or transfer from ``dataset`` to ``targets``."""

    protocol: str                # "base2new" | "transfer"
    dataset: str                 # the dataset (base-to-new) or the source (transfer)
    dataset_dir: str
    key: str                     # METHODS key
    seed: int
    shots: int
    init: str = ""               # GRAM init file of the row's meta variant
    targets: tuple = ()          # ((name, dataset dir), ...) for transfer

    def path(self, out: Path) -> Path:
        folder = "base2new" if self.protocol == "base2new" else f"transfer_{self.shots}shot"
        return out / "runs" / folder / self.dataset / self.key / f"seed{self.seed}.json"

    @property
    def cost(self) -> int:
        """Rough relative run time (visual prompts cannot use cached image features)."""
        variant = VARIANT_BY_NAME.get(METHOD_BY_KEY[self.key].variant)
        visual = (variant.n_ctx_vision if variant else {"vpt": 4, "joint": 2}.get(self.key, 0)) > 0
        return (4 if visual else 1) * (1 + len(self.targets))


def method_spec(row: MethodRow, init: str = ""):
    """The evaluator's :class:`meta.evaluation.MethodSpec` of a table row (named by its paper label)."""
    from meta.evaluation import method_preset

    overrides: dict = {"name": row.label}
    variant = VARIANT_BY_NAME.get(row.variant)
    if variant is not None:
        overrides.update(n_ctx_text=variant.n_ctx_text, n_ctx_vision=variant.n_ctx_vision)
        if not variant.regulated:
            overrides["regulate"] = False     # the ablation's init file carries no φ
    return method_preset(row.preset, init_path=init, **overrides)


_WORKER: dict = {}


def _eval_init(model: str, weights: str, settings: DemoSettings, out: str) -> None:
    """Load the frozen CLIP once per worker process (or once in-process)."""
    import torch

    torch.set_num_threads(1)
    from meta.backbone import load_clip
    from meta.evaluation import EvaluationSession

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=weights)
    session = EvaluationSession(clip, dims, cache_dir=str(Path(out) / "feature_cache"), log=lambda m: None)
    _WORKER.update(clip=clip, dims=dims, session=session, settings=settings, out=Path(out))


def _eval_job(job: EvalJob) -> None:
    """Run one job in a worker prepared by :func:`_eval_init`; its record goes to ``job.path(out)``."""
    from meta.evaluation import DatasetRef, TrainSpec, evaluate_base_to_new, evaluate_transfer

    settings, out, session = _WORKER["settings"], _WORKER["out"], _WORKER["session"]
    path = job.path(out)
    if path.is_file():
        return
    row = METHOD_BY_KEY[job.key]
    method = method_spec(row, job.init)
    train = TrainSpec(epochs=settings.epochs, batch_size=settings.batch_size, rrcrop_scale=settings.rrcrop_scale,
                      eval_every_epoch=settings.eval_every_epoch and job.protocol == "base2new")
    source = DatasetRef.from_dir(job.dataset_dir, name=job.dataset)
    t = time.time()
    common = dict(clip=_WORKER["clip"], dims=_WORKER["dims"], method=method, seed=job.seed, shots=job.shots,
                  train=train, session=session, log=lambda m: None)
    if job.protocol == "base2new":
        record = evaluate_base_to_new(source, **common)
        numbers = f"base {record['base']:5.1f}  new {record['new']:5.1f}  H {record['H']:5.1f}"
    else:
        targets = [DatasetRef.from_dir(d, name=n) for n, d in job.targets]
        record = evaluate_transfer(source, targets, protocol="transfer", **common)
        numbers = f"source {record['source']:5.1f}  targets {record['target_mean']:5.1f}"
    record.update(key=row.key, label=row.label)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(path)
    _log(f"{job.protocol:<8} {job.dataset:<14} {row.label:<38} {job.shots:>2} shots seed {job.seed}: {numbers}  "
         f"({time.time() - t:.0f} s)")


def transfer_plan(world) -> dict:
    """``{source name: [target names]}``: cross-domain and cross-dataset targets by their role's source.

    One fine-tuning on a source serves both tables when the two roles share it (as CoOp tests its
    ImageNet prompts on the ImageNet variants and on the other datasets)."""
    plan: dict = {}
    for kind in ("cross_domain", "cross_dataset"):
        sources = world.with_role(f"{kind}_source")
        if len(sources) != 1:
            raise ValueError(f"{world.manifest}: expected one dataset with role {kind}_source, found "
                             f"{[d.name for d in sources]}")
        plan.setdefault(sources[0].name, []).extend(d.name for d in world.with_role(f"{kind}_target"))
    return plan


def eval_jobs(world, inits: dict, settings: DemoSettings) -> list:
    """Every evaluation run the requested tables need."""
    names = settings.datasets or tuple(d.name for d in world.with_role("base2new"))
    init = {m.key: inits.get(m.variant, "") for m in METHODS}
    jobs = [EvalJob("base2new", n, str(world.dataset(n).dataset_dir), k, seed, settings.shots, init[k])
            for n in names for seed in settings.seeds for k in b2n_keys(settings.tables)]
    if transfer_keys(settings.tables):
        for source, targets in transfer_plan(world).items():
            target_dirs = tuple((t, str(world.dataset(t).dataset_dir)) for t in targets)
            jobs += [EvalJob("transfer", source, str(world.dataset(source).dataset_dir), k, seed, shots, init[k],
                             target_dirs)
                     for shots in settings.transfer_shot_counts for seed in settings.seeds
                     for k in transfer_keys(settings.tables)]
    return jobs


def stage_eval(world, weights: Path, model: str, inits: dict, out: Path, settings: DemoSettings) -> list:
    """Run (or find cached) every evaluation job; returns their records (``key`` and ``label`` added)."""
    jobs = eval_jobs(world, inits, settings)
    todo = sorted((j for j in jobs if not j.path(out).is_file()), key=lambda j: -j.cost)
    n_jobs = max(1, min(settings.jobs, len(todo)))
    counts = {p: sum(j.protocol == p for j in jobs) for p in ("base2new", "transfer")}
    _log(f"evaluating {len(jobs)} runs ({counts['base2new']} base-to-new, {counts['transfer']} transfer; "
         f"{len(jobs) - len(todo)} cached) in {n_jobs} process(es)")
    t = time.time()
    if todo:
        _run_with_progress(_eval_job, todo, n_jobs, total=len(jobs),
                           done=lambda: sum(j.path(out).is_file() for j in jobs), desc="evaluation", unit="run",
                           initializer=_eval_init, initargs=(model, str(weights), settings, str(out)))
    _log(f"evaluation done ({time.time() - t:.0f} s)")
    return [json.loads(j.path(out).read_text()) for j in jobs]


# ------------------------------------------------------------------ main
_NOT_RESULTS = ("jobs", "tables")     # settings that change what is computed or how fast, never a number


def settings_record(settings: DemoSettings) -> dict:
    """The settings every cached result depends on, as JSON (what ``demo_settings.json`` holds)."""
    current = json.loads(json.dumps(asdict(settings)))
    for key in _NOT_RESULTS:
        current.pop(key)
    return current


def settings_hash(settings: DemoSettings) -> str:
    """First 12 hex digits of the SHA-256 of :func:`settings_record` (canonical JSON)."""
    blob = json.dumps(settings_record(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _check_settings(settings: DemoSettings, out: Path) -> None:
    """Cached stages are only reused under the same settings; refuse a mix with a clear message.

    A folder written before a setting existed is read with that setting's preset value."""
    path = out / "demo_settings.json"
    current = settings_record(settings)
    if path.is_file():
        previous = json.loads(path.read_text())
        defaults = settings_record(DemoSettings.preset(bool(previous.get("quick", False))))
        previous = {**{k: v for k, v in defaults.items() if k not in previous}, **previous}
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            from meta.cli_errors import UserError

            raise UserError(str(out), f"holds a demo run with other settings ({', '.join(diff)}); "
                                      f"use --out DIR or delete that folder")
    else:
        path.write_text(json.dumps(current, indent=1))


def _check_world(out: Path, world, weights: Path) -> None:
    """The world and CLIP a folder's cached stages were computed with must be this run's too (their
    defaults live in ``gram_world``, outside DemoSettings); refuse a mix."""
    path = out / "demo_world.json"
    current = {"world_settings_hash": world.settings_hash, "clip_weights": weights.name}
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != current:
            from meta.cli_errors import UserError

            raise UserError(str(out), f"holds a demo run on world {previous.get('world_settings_hash')} / "
                                      f"CLIP {previous.get('clip_weights')}, this run uses "
                                      f"{current['world_settings_hash']} / {current['clip_weights']}; use --out DIR "
                                      f"or delete that folder")
    else:
        path.write_text(json.dumps(current, indent=1))


def run(settings: DemoSettings, out: Path, world_root: Optional[Path] = None) -> Path:
    """All stages into ``out``; worlds (and their CLIP weights) are cached under ``world_root``
    (default :func:`gram_world.build.default_world_parent`).  Returns the path of ``results.md``."""
    from .demo_report import stage_report

    unknown = sorted(set(settings.tables) - set(TABLE_GROUPS))
    if unknown or not settings.tables:
        raise ValueError(f"DemoSettings.tables: unknown table groups {unknown}; known: {', '.join(TABLE_GROUPS)}")
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(settings, out)
    timings = {}
    t = time.time()
    world, weights, model, zeroshot = stage_world(settings, out, world_root)
    timings["world + tiny CLIP"] = time.time() - t
    _check_world(out, world, weights)
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


def default_out(settings: DemoSettings) -> Path:
    """``output/demo`` (``demo_quick``) under the current working directory, with ``_world<seed>`` for another world seed, or
    ``_world-<settings hash>`` when world settings are overridden."""
    name = "demo_quick" if settings.quick else "demo"
    if settings.world:
        name += f"_world-{demo_world_settings(settings).checksum()}"
    elif settings.world_seed:
        name += f"_world{settings.world_seed}"
    return Path.cwd() / "output" / name


def _parser() -> argparse.ArgumentParser:
    from .items import STYLES
    from .shapes import CATEGORIES

    parser = argparse.ArgumentParser(prog="python -m gram_world.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny everything (<= 5 minutes)")
    parser.add_argument("--out", default="", help="output folder (default output/demo or output/demo_quick, "
                        "with _world<N> or _world-<hash> for another world)")
    parser.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    parser.add_argument("--jobs", type=int, help="worker processes for meta-training and evaluation")
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also GRAM_DEBUG=1)")
    parser.add_argument("--tables", nargs="+", choices=tuple(TABLE_GROUPS) + ("all",),
                        help="table groups to compute (default: " + " ".join(DEFAULT_TABLES) + "): "
                        + "; ".join(f"{k} = {v}" for k, v in TABLE_GROUPS.items()) + "; all = every group")
    parser.add_argument("--world-seed", type=int, default=0, help="seed of the world and of its tiny CLIP")
    parser.add_argument("--holdout-style", choices=sorted(STYLES),
                        help="style kept out of everything but the pretraining corpus and the cross-domain "
                             "target (default sketch)")
    parser.add_argument("--mixed-classes", nargs="+", choices=sorted(CATEGORIES), metavar="CLASS",
                        help="classes of the mixed source dataset and its held-out-style twin "
                             "(default: five from each of three families)")
    return parser


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    """The command line's :class:`DemoSettings` (quick or default preset plus the flags given)."""
    settings = DemoSettings.preset(args.quick)
    if args.seeds:
        settings = replace(settings, seeds=tuple(args.seeds))
    if args.jobs:
        settings = replace(settings, jobs=args.jobs)
    if args.tables:
        tables = tuple(TABLE_GROUPS) if "all" in args.tables else tuple(dict.fromkeys(args.tables))
        settings = replace(settings, tables=tables)
    world = []
    if args.holdout_style:
        world.append(("holdout_style", args.holdout_style))
    if args.mixed_classes:
        world.append(("mixed_classes", tuple(args.mixed_classes)))
    return replace(settings, world_seed=args.world_seed, world=tuple(world))


def main(argv: Optional[list] = None) -> int:
    """Entry point; bad input: one ``error: <file, folder or setting>: ...`` line and exit 2 (``--debug``:
    traceback)."""
    from meta.cli_errors import run_cli

    return run_cli(_main, argv)


def _main(argv: list) -> int:
    args = _parser().parse_args(argv)
    settings = settings_from_args(args)
    demo_world_settings(settings)          # bad world settings fail here, before any work
    run(settings, Path(args.out) if args.out else default_out(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
