"""The demo's stages 1-5: world + tiny CLIP, CHC, meta-training of every variant, evaluation over seeds.
Each stage is cached on disk (a rerun redoes only what is missing), and a folder's cached stages are only
reused under the same settings, world and CLIP (:func:`check_settings`, :func:`check_world`).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from meta import chc
from meta.evaluation import (
    DatasetRef,
    EvaluationSession,
    TrainSpec,
    evaluate_base_to_new,
    evaluate_transfer,
    method_preset,
)
from meta.evaluation.spec import table_fields
from meta.infra.cli_errors import UserError
from meta.metatrain import train
from meta.metatrain.cli import default_cfg
from meta.metatrain.runlog import read_log
from meta.method import methods as method_table
from meta.model.backbone import load_clip

from ..build import build_world
from ..pretrain import pretrain_clip
from ..zeroshot import zeroshot_accuracy
from .pool import log, run_with_progress
from .profile import StageProfile
from .settings import (
    ALL_VARIANTS,
    EPOCH_CURVE_KEYS,
    HAND_PROMPT,
    METHODS,
    ONE_STEP,
    TESTTIME_BY_KEY,
    TESTTIME_ROWS,
    TESTTIME_SPEC,
    VALUE_BEFORE_SETTING,
    VARIANT_BY_NAME,
    DemoSettings,
    MetaVariant,
    MethodRow,
    b2n_keys,
    demo_pretrain_settings,
    demo_world_settings,
    method_row,
    settings_record,
    transfer_keys,
    variants_needed,
)


def stage_world(settings: DemoSettings, out: Path, world_root: Optional[Path] = None, profile=None):
    """Stages 1-2: the world and its tiny CLIP (both cached), timed into ``profile`` (a
    :class:`gram_world.demo.profile.StageProfile`) when one is given."""
    profile = profile if profile is not None else StageProfile()
    t = time.time()
    with profile.stage("world"):
        world = build_world(root=world_root, settings=demo_world_settings(settings))
    log(f"world {world.settings_hash} (seed {settings.world_seed}) ready at {world.root} ({time.time() - t:.0f} s)")
    t = time.time()
    clip_settings = demo_pretrain_settings(settings)
    with profile.stage("tiny CLIP"):
        weights = pretrain_clip(world, settings=clip_settings)
    log(f"tiny CLIP weights {weights.name} ({time.time() - t:.0f} s)")
    zs_file = weights.with_suffix(".zeroshot.json")
    zeroshot = json.loads(zs_file.read_text()) if zs_file.is_file() else zeroshot_accuracy(world, weights)
    for name, r in zeroshot.items():
        log(f"zero-shot {name}: {r['accuracy']:.1f}% (chance {r['chance']:.1f}%)")
    return world, weights, clip_settings.model_name, zeroshot


# ------------------------------------------------------------------ stage 3: CHC
def _base_cfg(model: str, weights: Path, out: Path, settings: DemoSettings):
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
    cfg = _base_cfg(model, weights, out, settings)
    cfg.CHC.INPUT.SHARDS = [str(p) for p in world.chc_shards]
    cfg.freeze()
    t = time.time()
    done = Path(cfg.CHC.OUTPUT_DIR)
    # CHC resumes stage by stage but always rewrites its final files; the folder's settings are
    # checked (pipeline._check_settings), so a finished hierarchy (report written last) is reused as it is
    if not ((done / "hierarchy.json").is_file() and (done / "chc_report.md").is_file()):
        chc.run_chc(cfg, show_progress=True)
    hierarchy = chc.load_hierarchy(cfg.CHC.OUTPUT_DIR)
    kept = int((hierarchy.item_topic >= 0).sum())
    log(
        f"CHC: {len(hierarchy.topic_names)} topics, {kept}/{len(hierarchy.item_topic)} pairs kept "
        f"({time.time() - t:.0f} s); report {cfg.CHC.OUTPUT_DIR}/chc_report.md"
    )
    return hierarchy


# ------------------------------------------------------------------ stage 4: meta-training
# Rough relative cost of a variant, used only to hand the expensive runs out first so two workers
# finish close together (default demo, 300 steps, two processes, 2026-12-02: UNIGRAM variants 123-125 s,
# VPT 112 s, CoCoOp 96 s, CoOp 25 s).  Unlisted variants cost 3 (token-count variants: about UNIGRAM's).
_META_COST = {"gram_coop": 1, "unigram_pretrain": 1}


def _variant_cfg(variant: MetaVariant, model: str, weights: str, out: Path, settings: DemoSettings, labelled_dir: str):
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
    cfg.META.PROMPT.VPT_INIT = settings.vpt_init
    cfg.META.QUERY_BEFORE_WEIGHT = settings.query_before_weight
    cfg.META.VAL_PROTOCOL = settings.meta_val_protocol
    cfg.META.VAL_RRCROP_SCALE = tuple(settings.rrcrop_scale)
    cfg.META.VAL_REG_WINDOW = settings.reg_window
    cfg.META.VAL_LAUNCH = settings.launch
    cfg.SEED = settings.meta_seed
    cfg.META.TENSORBOARD = False
    cfg.META.PROGRESS = False  # the parent process shows one bar over all variants
    cfg.META.FINGERPRINT = False  # results.json records computed_by once for the whole demo (report.py)
    cfg.TASKS.K_WAY = settings.k_way
    cfg.TASKS.N_SUPPORT = settings.n_support
    cfg.TASKS.N_QUERY = settings.n_query
    cfg.TASKS.IMAGE_FOLDER = labelled_dir
    cfg.merge_from_list(list(variant.prompt_overrides + variant.overrides))
    if variant.meta_learned and ONE_STEP[0] not in variant.overrides[::2]:  # one-step rows stay paper-literal
        cfg.merge_from_list(list(settings.meta_overrides))  # last: a sweep's value wins (META.TEST_TIME.VIEWS)
    cfg.freeze()
    return cfg


@dataclass(frozen=True)
class MetaJob:
    """One meta-training run for a worker process: which variant, on which CLIP, into which demo folder."""

    variant: str  # MetaVariant name
    model: str  # open_clip architecture of the world CLIP
    weights: str  # its weights file
    out: str  # the demo's output folder (the run goes to out/meta/<variant>)
    settings: DemoSettings
    labelled_dir: str  # the world's labelled image folder (supervised-meta ablation)


def _meta_worker(job: MetaJob) -> tuple:
    """Meta-train one variant in a worker process; returns ``(variant name, export path)``."""
    torch.set_num_threads(1)
    cfg = _variant_cfg(
        VARIANT_BY_NAME[job.variant], job.model, job.weights, Path(job.out), job.settings, job.labelled_dir
    )
    t = time.time()
    result = train(cfg, resume=True, echo=log)
    seconds = time.time() - t
    log(f"meta-trained {job.variant}: step {result['step']} ({seconds:.0f} s)")
    return job.variant, str(Path(cfg.OUTPUT_DIR) / cfg.META.EXPORT_NAME)


def _steps_logged(run_dir: Path) -> int:
    """Last finished outer step recorded in a run's ``log.jsonl`` (0 when none)."""
    steps = [int(r["step"]) for r in read_log(run_dir / "log.jsonl") if r.get("kind") == "train"]
    return max(steps, default=0)


def stage_meta(
    world, weights: Path, model: str, out: Path, settings: DemoSettings, names: Optional[tuple] = None
) -> dict:
    """Meta-train every variant the requested tables need (or the variants ``names``); returns
    ``{variant name: init file}``.

    A variant whose log reached ``meta_steps`` and whose init file exists is not started again.  A variant
    whose meta-training config equals an earlier one's (e.g. a one-step row's when the settings' query weight
    is the one-step objective's 0) is not trained: it gets that variant's init file."""
    needed = variants_needed(settings.tables) if names is None else tuple(v for v in ALL_VARIANTS if v.name in names)
    cfgs = {v.name: _variant_cfg(v, model, str(weights), out, settings, str(world.labelled_meta_dir)) for v in needed}
    first_with: dict = {}
    same_as = {v.name: first_with.setdefault(_config_identity(cfgs[v.name]), v.name) for v in needed}
    shared = sorted(n for n, rep in same_as.items() if n != rep)
    if shared:
        log("meta-training: " + ", ".join(f"{n} = {same_as[n]}" for n in shared) + " (same config; trained once)")
    needed = tuple(v for v in needed if same_as[v.name] == v.name)
    exports = {v.name: Path(cfgs[v.name].OUTPUT_DIR) / cfgs[v.name].META.EXPORT_NAME for v in needed}
    finished = {
        v.name
        for v in needed
        if exports[v.name].is_file() and _steps_logged(out / "meta" / v.name) >= settings.meta_steps
    }
    order = sorted((v for v in needed if v.name not in finished), key=lambda v: -_META_COST.get(v.name, 3))
    tasks = [MetaJob(v.name, model, str(weights), str(out), settings, str(world.labelled_meta_dir)) for v in order]
    runs = [out / "meta" / v.name for v in order]
    jobs = max(1, min(settings.jobs, len(tasks)))
    log(
        f"meta-training {len(tasks)} variants x {settings.meta_steps} steps in {jobs} process(es) "
        f"({len(finished)} finished before)"
    )
    if tasks:
        run_with_progress(
            _meta_worker,
            tasks,
            jobs,
            total=settings.meta_steps * len(tasks),
            done=lambda: sum(min(_steps_logged(r), settings.meta_steps) for r in runs),
            desc="meta-training",
            unit="step",
        )
    return {name: str(exports[rep]) for name, rep in same_as.items()}


def _config_identity(cfg) -> str:
    """A meta-training config without its output folder (two equal identities train the same θ*, φ)."""
    clone = cfg.clone()
    clone.defrost()
    clone.OUTPUT_DIR = ""
    return clone.dump()


# ------------------------------------------------------------------ stage 5: evaluation
@dataclass(frozen=True)
class EvalJob:
    """One evaluation run: base-to-new on ``dataset``, or transfer from ``dataset`` to ``targets``."""

    protocol: str  # "base2new" | "transfer"
    dataset: str  # the dataset (base-to-new) or the source (transfer)
    dataset_dir: str
    key: str  # METHODS key, or a derived one (settings.method_row: a row with consistency weights)
    seed: int
    shots: int
    init: str = ""  # GRAM init file of the row's meta variant
    targets: tuple = ()  # ((name, dataset dir), ...) for transfer
    test_time: str = ""  # a TESTTIME_ROWS key: the run tunes every test image (TPT) from the row's start
    eval_split: str = "test"  # a test-time run's split (settings.eval_split); val records go to testtime_*_val
    cache_views: int = TESTTIME_SPEC.views  # the cache row's views per image (settings.cache_views)

    def path(self, out: Path) -> Path:
        folder = "base2new" if self.protocol == "base2new" else f"transfer_{self.shots}shot"
        if self.test_time:
            folder = f"testtime_{folder}" + ("_val" if self.eval_split == "val" else "")
            row = self.test_time + (f"_views{self.cache_views}" if self.cache_views != TESTTIME_SPEC.views else "")
            return out / "runs" / folder / self.dataset / row / f"seed{self.seed}.json"
        return out / "runs" / folder / self.dataset / self.key / f"seed{self.seed}.json"

    @property
    def cost(self) -> int:
        """Rough relative run time (visual prompts cannot use cached image features)."""
        demo_row = method_row(self.key)
        variant = VARIANT_BY_NAME.get(demo_row.variant)
        row = method_table.get(demo_row.method_key)
        visual = (variant.n_ctx_vision if variant else row.visual_tokens) > 0 or row.coupling != "none"
        return (4 if visual else 1) * (1 + len(self.targets))


def method_spec(row: MethodRow, init: str = "", settings: DemoSettings = DemoSettings()):
    """The evaluator's :class:`meta.evaluation.MethodSpec` of a table row (named by its paper label):
    its preset plus what the method table fixes for the row (θ* and / or R_φ from the init file),
    the settings' ``vpt_init`` for scratch visual tokens and the test-time switches for rows with an
    init file (``reg_window`` when regulated, ``launch``); a derived row (:func:`method_row`, e.g. ``coop@ct4``)
    adds its ``spec_overrides`` (the consistency weights) last."""
    overrides: dict = {**table_fields(row.method_key), "name": row.label, "vpt_init": settings.vpt_init}
    variant = VARIANT_BY_NAME.get(row.variant)
    if variant is not None:
        overrides.update(n_ctx_text=variant.n_ctx_text, n_ctx_vision=variant.n_ctx_vision)
        if not method_table.get(row.method_key).one_step:  # one-step rows keep the table's per-image rule, no launch
            overrides["launch"] = settings.launch and variant.meta_learned
            if overrides["regulate"]:
                overrides["reg_window"] = settings.reg_window
        if not variant.regulated and overrides["regulate"]:
            raise ValueError(f"demo row {row.key!r}: regulated, but meta variant {variant.name!r} exports no φ")
    overrides.update(row.spec_overrides)
    return method_preset(row.preset, init_path=init, **overrides)


_WORKER: dict = {}


def init_eval_worker(model: str, weights: str, settings: DemoSettings, out: str) -> None:
    """Load the frozen CLIP once per worker process (or once in-process)."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=weights)
    evaluation = EvaluationSession(clip, dims, cache_dir=str(Path(out) / "feature_cache"), log=lambda m: None)
    _WORKER.update(clip=clip, dims=dims, evaluation=evaluation, settings=settings, out=Path(out))


def run_eval_job(job: EvalJob) -> None:
    """Run one job in a worker prepared by :func:`init_eval_worker`; its record goes to ``job.path(out)``."""
    settings, out, evaluation = _WORKER["settings"], _WORKER["out"], _WORKER["evaluation"]
    path = job.path(out)
    if path.is_file():
        return
    row = method_row(job.key)
    method = method_spec(row, job.init, settings)
    test_time, epochs = None, settings.epochs
    if job.test_time:  # TPT from the row's start: no launch step, no schedule unless the row is fine-tuned first
        tt = TESTTIME_BY_KEY[job.test_time]
        epochs = settings.epochs if tt.fine_tuned else 0
        if method.n_ctx_text or method.n_ctx_vision:  # the meta step needs the file's rule: launch on, never applied
            test_time = replace(  # at 0 epochs (no labelled data reaches it)
                TESTTIME_SPEC, optimizer=tt.optimizer, prototypes=tt.prototypes
            )
            if tt.optimizer == "meta":
                test_time = replace(test_time, steps=settings.testtime_steps)
            method = replace(method, name=tt.label, launch=tt.optimizer == "meta")
            if tt.key == "tpt_hand":
                method = replace(method, ctx_init=HAND_PROMPT)
        if tt.adapt == "cache":  # tunes nothing: zero-shot CLIP's classes, the caches over the shuffled test stream
            test_time = replace(TESTTIME_SPEC, adapt="cache", views=job.cache_views)
    train = TrainSpec(
        epochs=epochs,
        batch_size=settings.batch_size,
        rrcrop_scale=settings.rrcrop_scale,
        eval_every_epoch=settings.eval_every_epoch and job.protocol == "base2new" and job.key in EPOCH_CURVE_KEYS,
    )
    split = {"eval_split": settings.eval_split if job.protocol == "base2new" else job.eval_split}
    source = DatasetRef.from_dir(job.dataset_dir, name=job.dataset)
    t = time.time()
    common = dict(
        clip=_WORKER["clip"],
        dims=_WORKER["dims"],
        method=method,
        seed=job.seed,
        shots=job.shots,
        train=train,
        session=evaluation,
        log=lambda m: None,
        test_time=test_time,
    )
    if job.protocol == "base2new":
        record = evaluate_base_to_new(source, **common, **split)
        numbers = f"base {record['base']:5.1f}  new {record['new']:5.1f}  H {record['H']:5.1f}"
    else:
        targets = [DatasetRef.from_dir(d, name=n) for n, d in job.targets]
        record = evaluate_transfer(source, targets, protocol="transfer", **common, **split)
        numbers = f"source {record['source']:5.1f}  targets {record['target_mean']:5.1f}"
    record.update(key=row.key, label=row.label)
    if job.test_time:
        record.update(test_time_row=job.test_time, label=TESTTIME_BY_KEY[job.test_time].label)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(path)
    log(
        f"{job.protocol:<8} {job.dataset:<14} {record['label']:<38} {job.shots:>2} shots seed {job.seed}: {numbers}  "
        f"({time.time() - t:.0f} s)"
    )


def transfer_plan(world) -> dict:
    """``{source name: [target names]}``: cross-domain and cross-dataset targets by their role's source.

    One fine-tuning on a source serves both tables when the two roles share it (as CoOp tests its
    ImageNet prompts on the ImageNet variants and on the other datasets)."""
    plan: dict = {}
    for kind in ("cross_domain", "cross_dataset"):
        sources = world.with_role(f"{kind}_source")
        if len(sources) != 1:
            raise ValueError(
                f"{world.manifest}: expected one dataset with role {kind}_source, found {[d.name for d in sources]}"
            )
        plan.setdefault(sources[0].name, []).extend(d.name for d in world.with_role(f"{kind}_target"))
    return plan


def eval_jobs(
    world, inits: dict, settings: DemoSettings, keys: Optional[tuple] = None, testtime: Optional[tuple] = None
) -> list:
    """Every evaluation run the requested tables need (or base-to-new runs of the rows ``keys`` only: table rows
    or derived ones, :func:`method_row`; or the test-time runs of the :data:`TESTTIME_ROWS` keys ``testtime``)."""
    names = settings.datasets or tuple(d.name for d in world.with_role("base2new"))
    if testtime is not None:
        return testtime_jobs(world, inits, settings, names, testtime)
    rows = b2n_keys(settings.tables) if keys is None else keys
    init = {m.key: inits.get(m.variant, "") for m in METHODS}
    init.update({k: inits.get(method_row(k).variant, "") for k in rows if k not in init})  # derived rows (coop@ct8)
    jobs = [
        EvalJob("base2new", n, str(world.dataset(n).dataset_dir), k, seed, settings.shots, init[k])
        for n in names
        for seed in settings.seeds
        for k in rows
    ]
    if keys is None and transfer_keys(settings.tables):
        for source, targets in transfer_plan(world).items():
            target_dirs = tuple((t, str(world.dataset(t).dataset_dir)) for t in targets)
            jobs += [
                EvalJob(
                    "transfer", source, str(world.dataset(source).dataset_dir), k, seed, shots, init[k], target_dirs
                )
                for shots in settings.transfer_shot_counts
                for seed in settings.seeds
                for k in transfer_keys(settings.tables)
            ]
    if keys is None and "testtime" in settings.tables:
        jobs += testtime_jobs(world, inits, settings, names)
    return jobs


def testtime_jobs(world, inits: dict, settings: DemoSettings, names: tuple, rows: Optional[tuple] = None) -> list:
    """The test-time group's runs: every :data:`TESTTIME_ROWS` row (or those of the keys ``rows``) and seed,
    base-to-new on each dataset of ``names`` and transfer from the cross-domain source to its held-out-style
    target(s) at ``settings.shots``, each protocol only if in ``settings.testtime_protocols``."""
    domain = world.with_role("cross_domain_source")
    if len(domain) != 1:
        raise ValueError(f"{world.manifest}: expected one dataset with role cross_domain_source, found {len(domain)}")
    source, targets = domain[0], tuple((d.name, str(d.dataset_dir)) for d in world.with_role("cross_domain_target"))
    jobs, split, protocols = [], settings.eval_split, settings.testtime_protocols
    for tt in TESTTIME_ROWS if rows is None else [TESTTIME_BY_KEY[k] for k in rows]:
        init = inits.get(method_row(tt.row).variant, "")
        views = {"cache_views": settings.cache_views} if tt.adapt == "cache" else {}
        for seed in settings.seeds:
            jobs += [
                EvalJob(
                    "base2new",
                    n,
                    str(world.dataset(n).dataset_dir),
                    tt.row,
                    seed,
                    settings.shots,
                    init,
                    (),
                    tt.key,
                    split,
                    **views,
                )
                for n in names
                if "base2new" in protocols
            ]
            jobs += [
                EvalJob(
                    "transfer",
                    source.name,
                    str(source.dataset_dir),
                    tt.row,
                    seed,
                    settings.shots,
                    init,
                    targets,
                    tt.key,
                    split,
                    **views,
                )
            ] * ("transfer" in protocols)
    return jobs


def stage_eval(
    world,
    weights: Path,
    model: str,
    inits: dict,
    out: Path,
    settings: DemoSettings,
    keys: Optional[tuple] = None,
    testtime: Optional[tuple] = None,
) -> list:
    """Run (or find cached) every evaluation job (or the base-to-new runs of rows ``keys``, or the test-time runs of
    the rows ``testtime``: :func:`eval_jobs`); returns their records (``key`` and ``label`` added)."""
    jobs = eval_jobs(world, inits, settings, keys, testtime)
    todo = sorted((j for j in jobs if not j.path(out).is_file()), key=lambda j: -j.cost)
    n_jobs = max(1, min(settings.jobs, len(todo)))
    counts = {p: sum(j.protocol == p for j in jobs) for p in ("base2new", "transfer")}
    log(
        f"evaluating {len(jobs)} runs ({counts['base2new']} base-to-new, {counts['transfer']} transfer; "
        f"{len(jobs) - len(todo)} cached) in {n_jobs} process(es)"
    )
    t = time.time()
    if todo:
        run_with_progress(
            run_eval_job,
            todo,
            n_jobs,
            total=len(jobs),
            done=lambda: sum(j.path(out).is_file() for j in jobs),
            desc="evaluation",
            unit="run",
            initializer=init_eval_worker,
            initargs=(model, str(weights), settings, str(out)),
        )
    log(f"evaluation done ({time.time() - t:.0f} s)")
    return [json.loads(j.path(out).read_text()) for j in jobs]


def check_settings(settings: DemoSettings, out: Path) -> None:
    """Cached stages are only reused under the same settings; refuse a mix with a clear message.

    A folder written before a setting existed is read with the value that setting's behaviour had
    then (:data:`VALUE_BEFORE_SETTING`), else with its preset value."""
    path = out / "demo_settings.json"
    current = settings_record(settings)
    if path.is_file():
        previous = json.loads(path.read_text())
        defaults = settings_record(DemoSettings.preset(bool(previous.get("quick", False))))
        previous = {
            **{k: v for k, v in defaults.items() if k not in previous},
            **{k: v for k, v in VALUE_BEFORE_SETTING.items() if k not in previous},
            **previous,
        }
        if previous != current:
            diff = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise UserError(
                str(out),
                f"holds a demo run with other settings ({', '.join(diff)}); use --out DIR or delete that folder",
            )
    else:
        path.write_text(json.dumps(current, indent=1))


def check_world(out: Path, world, weights: Path) -> None:
    """The world and CLIP a folder's cached stages were computed with must be this run's too (their
    defaults live in ``gram_world``, outside DemoSettings); refuse a mix."""
    path = out / "demo_world.json"
    current = {"world_settings_hash": world.settings_hash, "clip_weights": weights.name}
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != current:
            raise UserError(
                str(out),
                f"holds a demo run on world {previous.get('world_settings_hash')} / "
                f"CLIP {previous.get('clip_weights')}, this run uses "
                f"{current['world_settings_hash']} / {current['clip_weights']}; use --out DIR "
                f"or delete that folder",
            )
    else:
        path.write_text(json.dumps(current, indent=1))
