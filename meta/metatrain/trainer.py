"""The meta-training run: GRAM's bi-level loop (paper Algorithm 1) or the prompt pre-training baseline.

One call of :func:`train` runs (or resumes) ``META.STEPS`` outer steps in ``OUTPUT_DIR``: ``gram`` samples
``B = META.META_BATCH`` K-way tasks a step, adapts θ on each support with the regulated gradient and updates θ (λ1)
and φ (λ2) from the query losses; ``pretrain`` (Table 4 row 3) is plain cross-entropy over the training topics'
names.  Every ``META.VAL_EVERY`` steps (and at step 0) θ is scored on fixed tasks over held-out topics.

Run directory::

    config.yaml           resolved config        run.json        hashes, hierarchy, CLIP dims, versions
    log.jsonl             metrics (runlog.py)    tensorboard/    the same scalars
    checkpoint.pt         latest state (checkpoint.py), every META.CHECKPOINT_EVERY steps and at the end
    gram_init.safetensors θ* (+ φ) for the trainers    coop_ctx_nctx<M>.pth   θ*_T for stock CoOp (text prompts)
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from meta.finetune.engine import StartPoint, build_start
from meta.finetune.regulated import GradientRegulation, LaunchStep, finetune_and_score
from meta.infra import distributed as dist_
from meta.infra.fileio import clean_stale_temps, parse_json, write_json_atomic, write_text_atomic
from meta.infra.numerics import numerics_record
from meta.infra.provenance import git_commit, results_record
from meta.infra.runlock import RunLock, is_rank0
from meta.metatrain import settings
from meta.metatrain.checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from meta.metatrain.data import (
    TaskBatcher,
    check_cached_features,
    hierarchy_fingerprint,
    hierarchy_summary,
    load_task_hierarchy,
    norm_stats,
)
from meta.metatrain.export import export_paths, export_state, exported_files, verify_exports
from meta.metatrain.outer import OuterStep
from meta.metatrain.runlog import RunLog, postfix, progress_bar
from meta.metatrain.tasks import ClassBatchStream, TaskStream, split_topics
from meta.metatrain.testtime_objective import TaskViews, TestTimeObjective
from meta.method.gram import GRAMMetaLearner
from meta.method.inner import task_loss_of
from meta.method.metrics import accuracy
from meta.method.prompts import PromptedCLIP, PromptParams, classification_loss
from meta.method.prototypes import prototypes_of
from meta.model.backbone import ClipDims, check_model_name, check_precision, resolve_device
from meta.model.clip_config import clip_from_settings
from meta.model.precision import resolve_autocast

CONFIG_NAME = "config.yaml"
RUN_INFO_NAME = "run.json"


class RunExistsError(RuntimeError):
    """OUTPUT_DIR already holds a run and ``--resume`` was not given."""


class StopRequest:
    """SIGTERM / first Ctrl-C ask the loop to checkpoint after the current step and return; a second Ctrl-C
    interrupts at once.  Handlers are installed from the main thread only, and restored on exit."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self):
        self.requested: Optional[str] = None
        self._previous: dict = {}

    def _handle(self, signum, _frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class RunSetup:
    """Everything a run needs besides its loop state."""

    settings: settings.TrainSettings
    device: str
    clip: torch.nn.Module
    dims: ClipDims
    hierarchy: Any
    train_topics: list
    val_topics: list
    learner: GRAMMetaLearner
    outer: OuterStep  # the outer update of θ and φ (optimiser, clipping, fp16 scaler)
    loss_fn: Callable
    batcher: TaskBatcher
    stream: Any  # TaskStream (gram) | ClassBatchStream (pretrain)
    val_tasks: list
    feature_check: Optional[dict]


def build_clip(run: settings.TrainSettings, device: str):
    """The frozen CLIP of ``MODEL``, as ``python -m meta cluster`` builds it."""
    return clip_from_settings(run.model, device)


def setup_run(run: settings.TrainSettings, hierarchy=None) -> RunSetup:
    """Open the task source and check task sizes against it (before the CLIP is built for a CHC output), build the
    CLIP, check cached features, split topics, create θ, φ and the streams."""
    device = resolve_device(run.device)
    check_model_name(run.model.backbone, "MODEL.BACKBONE")
    check_precision(run.model.precision, "MODEL.PRECISION")
    h = hierarchy
    if h is None and run.hierarchy.source == "chc":  # a CHC output needs no CLIP to open: check sizes first
        h = load_task_hierarchy(run.hierarchy, None, None, device)
    if h is not None:
        settings.check_task_sizes(run, h, device)
    clip, dims = build_clip(run, device)
    if h is None:  # an image folder is encoded by this CLIP
        h = load_task_hierarchy(run.hierarchy, clip, dims, device)
        settings.check_task_sizes(run, h, device)
    pspec, tasks, seed = run.prompt, run.tasks, run.seed
    use_images = pspec.has_visual_prompts
    feature_check = None
    if use_images:
        size = h.meta.get("image_size")
        if size and int(size) != dims.image_size:
            raise ValueError(
                f"MODEL.BACKBONE: the hierarchy's images are {size} px, {run.model.backbone} takes "
                f"{dims.image_size} px; re-run `python -m meta cluster` with this model"
            )
    else:
        feature_check = check_cached_features(
            h, clip, dims, run.model.backbone, run.model.pretrained, n_check=run.feature_check, device=device
        )
    train_topics, val_topics = split_topics(h, tasks.val_fraction, seed)
    train_topics, val_topics = [int(t) for t in train_topics], [int(t) for t in val_topics]
    k_way = tasks.k_way  # sizes the hierarchy cannot supply were refused by check_task_sizes

    theta = PromptParams.from_spec(pspec, clip, dims, generator=torch.Generator().manual_seed(seed))
    spec = replace(run.meta, autocast=resolve_autocast(run.meta.autocast, device, "META.AUTOCAST"))
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=pspec.template)
    objective, views = None, None
    if run.mode == "testtime":  # θ*, R_φ meta-trained for test-time tuning: the query's views, no labelled support
        protos = prototypes_of(h, train_topics) if run.test_time.prototypes != "none" else None
        objective = TestTimeObjective(run.test_time.kept, protos)
        views = TaskViews(pclip, run.test_time, seed, use_images)
    learner = GRAMMetaLearner(theta, spec, objective=objective)
    mean, std = norm_stats(h, clip)
    dtype = next(clip.parameters()).dtype
    batcher = TaskBatcher(h, use_images, mean, std, device=device, dtype=dtype, views=views)

    if run.mode != "pretrain":
        try:
            stream = TaskStream(lambda: tasks.sampler(h, train_topics, seed=seed, k_way=k_way))
        except ValueError as err:
            raise ValueError(f"TASKS (training topics): {err}") from None
    else:
        stream = ClassBatchStream(h, train_topics, run.pretrain_ways, run.pretrain_batch_size, seed)
    val_tasks: list = []
    val_k = tasks.val_k_way(len(val_topics))
    if val_k >= 2 and run.val_tasks > 0:
        # fixed tasks (own seed) so every validation measures the same thing; never touches the train stream
        try:
            val_sampler = tasks.sampler(h, val_topics, seed=seed + 1, k_way=val_k)
        except ValueError as err:
            raise ValueError(
                f"TASKS.VAL_FRACTION: the held-out topics cannot form tasks ({err}); hold out more "
                f"topics or set META.VAL_TASKS 0"
            ) from None
        val_tasks = [val_sampler.sample() for _ in range(run.val_tasks)]
    outer, loss_fn = OuterStep(learner, run.outer), classification_loss(pclip, run.consistency)
    topics = (train_topics, val_topics)
    return RunSetup(
        run, device, clip, dims, h, *topics, learner, outer, loss_fn, batcher, stream, val_tasks, feature_check
    )


# ----------------------------------------------------------------------------- steps
def gram_step(run: RunSetup, step: int) -> dict:
    """One outer update from ``META.META_BATCH`` tasks; under torchrun each rank takes its block of ``B / W`` tasks
    and the mean gradients are averaged before the one clipped step (the single-process update up to rounding)."""
    tasks = run.stream.next(run.settings.meta_batch)
    every = run.settings.log_detail_every
    detailed = every > 0 and step % every == 0
    outer = run.outer
    if not dist_.is_distributed():
        return outer.meta_step([run.batcher(t) for t in tasks], run.loss_fn, detailed=detailed)
    mine = dist_.shard(tasks, dist_.world_size(), dist_.rank())
    batches = [run.batcher(t) for t in mine]
    metrics = dist_.mean_over_ranks(
        run.learner.accumulate(batches, run.loss_fn, detailed=detailed, backward=outer.backward)
    )
    dist_.average_gradients(outer.params())
    metrics.update(outer.step(metrics["query_loss_after"]))
    return metrics


def pretrain_step(run: RunSetup, step: int) -> dict:
    """One classification step on θ over the step's topics (Table 4 row 3)."""
    cb = run.stream.next()
    index, label = cb.index, cb.label
    if dist_.is_distributed():  # each rank takes its block of the batch's images; gradients are averaged
        index = np.asarray(dist_.shard(index, dist_.world_size(), dist_.rank()))
        label = np.asarray(dist_.shard(label, dist_.world_size(), dist_.rank()))
    batch = run.batcher.part(cb.classnames, index, label)
    learner, outer = run.learner, run.outer
    learner.train()
    outer.zero_grad()
    with learner.cast():
        loss, logits = run.loss_fn(learner.prompt_module, batch)
    outer.backward(loss.float())
    values = dist_.mean_over_ranks({"loss": float(loss.detach()), "acc": accuracy(logits.detach(), batch["label"])})
    dist_.average_gradients(outer.params())
    out = outer.step(values["loss"])
    return {**values, "classes": len(cb.classnames), **out}


def validate(run: RunSetup) -> dict:
    """Mean query loss/accuracy on the held-out tasks before and after adapting on their supports (under torchrun
    rank ``r`` scores tasks ``r, r + W, ...``)."""
    learner, loss_fn, n = run.learner, run.loss_fn, len(run.val_tasks)
    query_fn = task_loss_of(loss_fn)  # the query measures the task alone (no regulariser)
    keys = "query_loss_before query_acc_before query_loss_after query_acc_after support_loss_before support_acc_before"
    testtime = isinstance(learner.objective, TestTimeObjective)  # its own scores (TestTimeObjective.backward)
    sums: dict[str, float] = {} if testtime else dict.fromkeys(keys.split(), 0.0)

    def add(scores: dict) -> None:  # one task's scores, each a 1/n share of its key's mean
        for key, value in scores.items():
            sums[key] = sums.get(key, 0.0) + value / n

    for index, task in list(enumerate(run.val_tasks))[dist_.rank() :: dist_.world_size()]:
        batch = run.batcher(task)
        if testtime:  # each query image after its own entropy step
            _, values = learner.objective.backward(learner, loss_fn, None, batch.query, 1, backward=lambda _: None)
            add({key: float(value) for key, value in values.items()})
            continue
        with torch.no_grad():
            q_loss0, q_logits0 = query_fn(learner.prompt_module, batch.query)
        adapted, s_losses, s_accs = learner.adapt(loss_fn, batch.support, first_order=True)
        with torch.no_grad():
            q_loss1, q_logits1 = query_fn(adapted.module, batch.query)
        labels = batch.query["label"]
        scores = float(q_loss0), accuracy(q_logits0, labels), float(q_loss1), accuracy(q_logits1, labels)
        add(dict(zip(keys.split(), (*scores, s_losses[0], s_accs[0]))))
        del adapted
        if run.settings.val_protocol == "downstream":  # what a user gets: the whole fine-tuning protocol
            add(_downstream_scores(run, batch, index))
        ft_steps = run.settings.val_ft_steps
        if ft_steps > 0:  # as at test time: many small momentum-SGD steps, regulated and raw
            regs = learner.regulators()
            ft = {"query_acc_ft": GradientRegulation(regs) if regs else None, "query_acc_ft_raw": None}
            sets = (batch.support, batch.query)
            schedule = (ft_steps, run.settings.val_ft_lr, run.settings.val_ft_momentum)
            for key, regulation in ft.items():
                add({key: finetune_and_score(learner.prompt_module, regulation, loss_fn, *sets, *schedule)})
    run.outer.zero_grad()
    sums = dist_.sum_over_ranks(sums)
    sums["tasks"] = n
    return sums


def _downstream_scores(run: RunSetup, batch, seed: int) -> dict:
    """Query accuracy (0-1) after the downstream protocol, with the learner's R_φ and with raw gradients, each
    started from the live θ (and φ) by :func:`meta.finetune.engine.build_start`, as the evaluator starts."""
    from meta.metatrain.downstream_val import downstream_accuracy

    learner, s, sets = run.learner, run.settings, (batch.support, batch.query)
    view = s.val_start
    pclip = PromptedCLIP(run.clip, run.dims, learner.prompt_module.n_ctx_text, template=view.prompt.template)
    regs = learner.regulators()
    point = StartPoint(
        learner.prompt_module,
        regs,
        label="meta-validation",
        launch=LaunchStep.from_meta_record(learner.spec.as_dict(), "META.VAL_LAUNCH") if view.launch else None,
        support_size=len(batch.support["label"]),
    )
    out = {}
    for key, regulate in (("query_acc_downstream", True), ("query_acc_downstream_raw", False)):
        if regulate and not regs:
            continue
        start = build_start(replace(view, regulate=regulate), run.clip, run.dims, point=point)
        with torch.random.fork_rng(devices=[]):  # validation never moves meta-training's random stream
            acc = downstream_accuracy(
                pclip, start, *sets, s.val_train, seed=s.seed * 1000 + seed, consistency=s.consistency
            )
        out[key] = acc / 100.0
    return out


# ----------------------------------------------------------------------------- files
def _checkpoint_payload(run: RunSetup, step: int) -> dict:
    s = run.settings
    return {
        "step": int(step),
        "steps_total": s.steps,
        "mode": s.mode,
        "learner": {**run.learner.state(), **run.outer.state()},  # θ, φ and the outer optimiser
        "rng": capture_rng(),
        "stream": run.stream.state(),
        **{key: getattr(s, key) for key in ("config", "config_hash", "config_yaml")},
        "dims": run.dims.as_dict(),
        "hierarchy": hierarchy_summary(run.hierarchy),
        **({"prototypes": protos.tensors()} if (protos := getattr(run.learner.objective, "prototypes", None)) else {}),
    }


def _save(run: RunSetup, path: Path, step: int) -> None:
    """Checkpoint ``step`` (collective under torchrun: every rank's RNG states go in, rank 0 writes)."""
    payload = _checkpoint_payload(run, step)
    rng_ranks = dist_.gather_objects(payload["rng"])
    if dist_.is_distributed():
        payload["rng_ranks"] = rng_ranks
        payload["world_size"] = len(rng_ranks)
    if dist_.is_main():
        save_checkpoint(path, payload)


def _rank_rng(state: dict) -> dict:
    """This rank's RNG states from a checkpoint (rank 0's when it was written by another world size)."""
    ranks = state.get("rng_ranks") or []
    return ranks[dist_.rank()] if len(ranks) == dist_.world_size() else state["rng"]


class _NoLog:
    """What ranks other than 0 log to: nothing."""

    def write(self, kind: str, step: int, metrics: dict) -> dict:
        return metrics

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _loop(
    run: RunSetup,
    log: RunLog,
    bar,
    stop: StopRequest,
    start: int,
    saved_at: int,
    ckpt_path: Path,
    on_step: Optional[Callable[[int, dict], None]],
) -> Optional[int]:
    """Steps ``start+1 .. META.STEPS`` with logging, validation and checkpoints; ``None`` when all ran, else the
    (checkpointed) step after which a stop was requested."""
    s = run.settings
    steps_total, val_every, ckpt_every = s.steps, s.val_every, s.checkpoint_every
    step_fn = pretrain_step if s.mode == "pretrain" else gram_step
    if start == 0 and run.val_tasks and val_every > 0:
        log.write("val", 0, validate(run))
    for step in range(start + 1, steps_total + 1):
        t0 = time.perf_counter()
        metrics = step_fn(run, step)
        metrics["time_per_step"] = time.perf_counter() - t0
        log.write("train", step, metrics)
        bar.update(1)
        bar.set_postfix(postfix(metrics), refresh=False)
        if run.val_tasks and val_every > 0 and step % val_every == 0:
            log.write("val", step, validate(run))
        # under torchrun a SIGTERM reaching any rank stops all of them after the same step
        if step % ckpt_every == 0 or step == steps_total or dist_.any_rank(stop.requested is not None):
            log.flush()
            _save(run, ckpt_path, step)
            saved_at = step
        if on_step is not None:
            on_step(step, metrics)
        if dist_.any_rank(stop.requested is not None):
            if saved_at < step:  # the request arrived during on_step
                _save(run, ckpt_path, step)
            return step
    if saved_at < steps_total:  # not reached (META.STEPS >= 1, the last step checkpoints): never end without one
        _save(run, ckpt_path, max(start, steps_total))
    return None


# ----------------------------------------------------------------------------- the run
def train(
    cfg,
    resume: bool = False,
    hierarchy=None,
    on_step: Optional[Callable[[int, dict], None]] = None,
    echo: Callable[[str], None] = print,
    recorder: Optional[Callable[[Optional[str]], dict]] = None,
) -> dict:
    """Run or resume meta-training (or pre-training) as configured; export at the end.  The run holds
    ``OUTPUT_DIR``'s :class:`meta.infra.runlock.RunLock`; a resumed finished run rewrites missing or stale exports.

    Args:
        cfg: full meta config (``meta.config.get_meta_cfg_default`` + ``META``), frozen or not, read here once
            (:func:`meta.metatrain.settings.read_train_settings`), or the settings it reads.
        resume: continue from ``OUTPUT_DIR/checkpoint.pt`` (start afresh when there is none).
            Without it, an ``OUTPUT_DIR`` holding a checkpoint or an export is refused.
        hierarchy: an already-built hierarchy (tests, notebooks); default = the configured source.
        on_step, echo: ``on_step(step, metrics)`` after each finished step (and its checkpoint); status lines.
        recorder: what computed the run, for ``run.json``'s ``computed_by`` (``META.FINGERPRINT``):
            :func:`meta.fingerprint.record.computed_by` (commit, numerics fingerprint, CPU, pins), which
            ``python -m meta train`` passes; without it the record holds no fingerprint and says so.

    Returns:
        ``{"run_dir", "step", "export": {"init", "coop_ctx"} | None, "resumed_from", "noop"}`` (+ ``"stopped":
        True`` when SIGTERM / Ctrl-C ended the run early, after checkpointing the step it was in).
    """
    run = cfg if isinstance(cfg, settings.TrainSettings) else settings.read_train_settings(cfg)
    world = dist_.world_size()
    split_key, split_n = run.split_key
    if split_n % world:
        raise ValueError(
            f"{split_key}: {split_n} cannot be split evenly over {world} processes (torchrun "
            f"--nproc_per_node); use a multiple of {world}"
        )
    with RunLock(run.output_dir, key="OUTPUT_DIR", enabled=is_rank0()) as lock:  # a refused run leaves no folder
        if lock.held:
            clean_stale_temps(run.output_dir, all_pids=True)
        return _train_locked(run, resume, hierarchy, on_step, echo, world, recorder)


def _train_locked(
    job: settings.TrainSettings,
    resume: bool,
    hierarchy,
    on_step: Optional[Callable[[int, dict], None]],
    echo: Callable[[str], None],
    world: int,
    recorder: Optional[Callable[[Optional[str]], dict]],
) -> dict:
    """:func:`train` once the output folder is locked (by rank 0)."""
    main = dist_.is_main()
    if not main:  # rank 0 alone talks and writes files
        echo = _silent
    run_dir = job.output_dir
    ckpt_path = run_dir / CHECKPOINT_NAME
    init_path, _ = export_paths(run_dir, job.export_name, job.coop_ctx_name)
    steps_total = job.steps
    state = None
    if ckpt_path.exists():
        if not resume:
            raise RunExistsError(
                f"OUTPUT_DIR: {run_dir} already holds a run ({ckpt_path.name}); pass --resume to "
                f"continue it or choose another --output-dir"
            )
        state = load_checkpoint(ckpt_path)
        diffs = settings.cfg_differences(state["config"], job.config)
        if diffs:
            more = f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""
            raise CheckpointError(
                f"{ckpt_path}: this config differs from the checkpointed run: "
                f"{'; '.join(diffs[:4])}{more}; resume with the same settings or use another --output-dir"
            )
        if int(state["step"]) >= steps_total:
            done = {"run_dir": run_dir, "step": int(state["step"]), "resumed_from": int(state["step"])}
            problems = verify_exports(state, run_dir)
            if not problems:
                echo(
                    f"{run_dir}: finished at step {state['step']} (META.STEPS {steps_total}); exports verified; "
                    f"nothing to do"
                )
                return {**done, "export": None, "noop": True}
            paths = export_state(state, run_dir) if main else None
            dist_.barrier()
            if paths is not None:
                echo(
                    f"{run_dir}: finished at step {state['step']}; {'; '.join(problems)}; re-exported "
                    + exported_files(paths)
                )
            return {**done, "export": paths, "noop": False}
    elif init_path.exists():
        raise RunExistsError(
            f"OUTPUT_DIR: {run_dir} holds {init_path.name} but no checkpoint; choose another --output-dir"
        )
    elif resume:
        echo(f"--resume: no checkpoint in {run_dir}; starting from step 0")

    run = setup_run(job, hierarchy)
    start = 0
    if state is not None:
        fp = hierarchy_fingerprint(run.hierarchy)
        if state["hierarchy"].get("fingerprint") != fp:
            raise CheckpointError(
                f"{ckpt_path}: the task hierarchy changed since this run started (fingerprint "
                f"{state['hierarchy'].get('fingerprint')} -> {fp}); use another --output-dir"
            )
        try:
            run.learner.load_state(state["learner"])
            run.outer.load_state(state["learner"])
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(
                f"{ckpt_path}: θ/φ/optimiser state does not fit this model ({str(err).splitlines()[0][:200]})"
            ) from None
        run.stream.load_state(state["stream"])
        restore_rng(_rank_rng(state))
        start = int(state["step"])

    resumed_from = start if state is not None else None
    log = _write_run_files(run, run_dir, state, start, world, recorder, echo) if main else _NoLog()
    bar = progress_bar(steps_total, start, job.progress and main, f"{job.mode} {run_dir.name}")
    with StopRequest() as stop:
        try:
            stopped_at = _loop(run, log, bar, stop, start, start if state is not None else -1, ckpt_path, on_step)
        finally:
            bar.close()
            log.close()
    result = {"run_dir": run_dir, "export": None, "resumed_from": resumed_from, "noop": False}
    if stopped_at is not None:
        echo(
            f"{run_dir}: {stop.requested or 'stop requested on another rank'} - checkpoint saved at step "
            f"{stopped_at} of {steps_total}; continue with --resume"
        )
        return {**result, "step": stopped_at, "stopped": True}
    if not main:
        dist_.barrier()  # rank 0 exports meanwhile
        return {**result, "step": max(start, steps_total)}
    final = load_checkpoint(ckpt_path)
    paths = export_state(final, run_dir)
    dist_.barrier()  # the other ranks return once the export exists
    usage = f"\n{paths['coop_usage']}" if paths.get("coop_usage") else ""
    echo(f"{run_dir}: {job.mode} finished at step {final['step']}; exported {exported_files(paths)}{usage}")
    return {**result, "step": int(final["step"]), "export": paths}


def _write_run_files(
    run: RunSetup,
    run_dir: Path,
    state: Optional[dict],
    start: int,
    world: int,
    recorder: Optional[Callable[[Optional[str]], dict]],
    echo: Callable[[str], None],
) -> RunLog:
    """Rank 0: ``config.yaml``, ``run.json`` and the opened log."""
    import open_clip

    s = run.settings
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / CONFIG_NAME, s.config_yaml)
    info_path = run_dir / RUN_INFO_NAME
    info = _read_run_info(info_path) if (state is not None and info_path.is_file()) else {}
    info.update(
        {
            "config_hash": s.config_hash,
            "mode": s.mode,
            "steps_total": s.steps,
            "hierarchy": hierarchy_summary(run.hierarchy),
            "feature_check": run.feature_check,
            "dims": run.dims.as_dict(),
            "train_topics": len(run.train_topics),
            "val_topics": [run.hierarchy.topic_names[t] for t in run.val_topics],
            "versions": {"torch": torch.__version__, "open_clip": open_clip.__version__, "numpy": np.__version__},
            "numerics": numerics_record(run.device),  # CPU, kernel flags, pins, builds (meta.infra.numerics)
            "commit": git_commit(Path(__file__).resolve().parent),
            "device": run.device,
            "world_size": world,
        }
    )
    if state is not None:
        info.setdefault("resumed_at_steps", []).append(start)
    if s.fingerprint:
        if recorder is None:
            echo(
                f"{run_dir / RUN_INFO_NAME}: no numerics fingerprint recorded (train() was given no recorder; "
                f"python -m meta train passes meta.fingerprint.record.computed_by)"
            )
        _record_computed_by(info, run.device, start, recorder or results_record)
    write_json_atomic(info_path, info)
    return RunLog(run_dir, start_step=start, tensorboard=s.tensorboard, fresh=state is None)


def _record_computed_by(
    info: dict, device: str, start: int, recorder: Callable[[Optional[str]], dict] = results_record
) -> None:
    """``info["computed_by"]`` = ``recorder(device)``; a resume under another numerics fingerprint is listed in
    ``info["fingerprint_changes"]``."""
    record = recorder(device)
    before = (info.get("computed_by") or {}).get("fingerprint")
    if before and before != record.get("fingerprint"):
        info.setdefault("fingerprint_changes", []).append(
            {"at_step": int(start), "before": before, "now": record.get("fingerprint")}
        )
    info["computed_by"] = record


def _read_run_info(path: Path) -> dict:
    """A resumed run's ``run.json`` (one-line error naming it when it is not a JSON object)."""
    try:
        info = parse_json(path.read_text(errors="replace"))
    except ValueError as err:
        raise ValueError(
            f"{path}: not valid JSON ({' '.join(str(err).split())[:160]}); move it away to resume (it is rewritten)"
        ) from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(info).__name__}; move it away to resume")
    return info


def _silent(_msg: str) -> None:
    pass
