"""What a meta-training config will cost: ``python -m gram_tools.plan --config-file configs/meta/train_vpt.yaml``.

Reads the config (``meta.config.load_meta_cfg``) and the measured figures:

The default figures files are the checkout's ``docs/*.json``, found next to the package
(``Path(gram_tools.__file__).parents[1] / "docs"``), so the planner runs from any folder; an editable install
(``pip install -e .``) points there too, a wheel install has no ``docs/`` and needs the ``--*figures`` flags.
The config is checked by the same function as ``python -m meta train``
(:func:`meta.metatrain.settings.check_meta_cfg`): what ``train`` refuses is not planned; a config that
sets no ``META`` keys (a CHC config) is refused in one line naming the file (:func:`config_kind_problem`).

* ``--figures`` (default: the file of the config's ``MODEL.BACKBONE``, ``docs/realsize_cpu.json`` for ViT-B-16 and
  ``docs/realsize_cpu_<backbone>.json`` for another, written by :mod:`gram_tools.realsize` ``--model``; a file
  measured on another backbone is refused in one line): per learner
  the fitted lines ``peak MiB = a + b_s * s + b_q * q`` and ``GFLOP = ...`` of one meta-task on ``s`` support
  and ``q`` query images (and ``a + b * batch`` for a plain step), measured on a CPU at real size;
* ``--gpu-figures`` (default: the checkout's figures of the config's ``META.AUTOCAST``, ``docs/gpu_figures.json``
  for fp32 and ``docs/gpu_figures_bf16.json`` for bf16, when it exists; written by ``scripts/gpu_check.sh``
  through ``python -m gram_tools.bench --device cuda``): measured GPU seconds per outer step and CHC
  images per second, used where they were measured at the config's task size, meta-batch and autocast;
* ``--chc-figures`` (default ``docs/chc_growth_cpu.json``, :mod:`gram_tools.chc_growth`): each CHC stage's
  growth law.

Prints, each figure labelled ``measured`` or ``estimated`` with its source:

* peak memory of one task, and of one pass as ``META.TASK_BATCHING`` runs it on a GPU
  (:class:`meta.method.batched.TaskBatching`: ``auto`` / ``on`` stack the ``ceil(B / GPUs)`` tasks of a rank in one
  pass where the objective allows it, ``auto`` halving the stack until it fits, down to one task at a time), plus
  the frozen CLIP's weights; whether it fits ``--gpu-memory-gib`` (with ``--margin`` kept free for the CUDA
  allocator and cuBLAS workspaces, which a CPU measurement does not see), and the largest
  ``TASKS.N_SUPPORT`` (query fixed) and ``TASKS.N_QUERY`` (support fixed) for which one task fits;
* hours for ``META.STEPS`` outer steps of ``META.META_BATCH`` tasks on ``--gpus`` GPUs (tasks sharded,
  the slowest rank holds ``ceil(B / GPUs)`` tasks): from the GPU figures when they exist for this learner and task
  size, else
  FLOPs / (``--gpu-tflops`` x GPUs), an assumed sustained throughput;
* CHC over ``--pairs`` pairs: CPU hours per stage from the growth laws, the image-feature stage from the
  GPU figures or the image tower's FLOPs;
* with ``--test-time [VIEWS CLASSES]`` (default TPT's 64 views and ImageNet's 1000 classes): one image of test-time
  prompt tuning (:mod:`meta.finetune.testtime`, one step) for the config's learner and backbone, from the
  ``fits.<learner>.testtime`` planes of the figures file (``python -m gram_tools.realsize --modes testtime``): peak
  memory (plus the weights), GFLOPs, CPU seconds (GFLOPs x the measured seconds per GFLOP), and GPU seconds at a
  rate the GPU figures measured where they have one for that kind of pass (:func:`test_time_gpu_seconds`), else
  the FLOP estimate at ``--gpu-tflops``; beside TPT's published per-image figures (:data:`PUBLISHED_TPT`).  A
  figures file without the learner's test-time plane is refused in one line naming the file and the key.

The last stdout line is the JSON of everything printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Optional

from gram_tools.chc_growth import extrapolate_seconds
from gram_tools.realsize import DEFAULT_MODEL, LEARNERS, figures_path, learner_of
from gram_tools.realsize import DEFAULT_OUT as DEFAULT_FIGURES
from meta.method.learners import DEFAULT_LEARNER

# The checkout the package sits in: the docs/*.json figures are read from there whatever the current folder.
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GPU_FIGURES = "docs/gpu_figures.json"
# The measured GPU figures of each META.AUTOCAST (scripts/gpu_check.sh writes the fp32 file; the bf16 one is its run
# with META.AUTOCAST bf16): the planner reads the file of the config's autocast unless --gpu-figures names one.
GPU_FIGURES_BY_AUTOCAST = {"none": DEFAULT_GPU_FIGURES, "bf16": "docs/gpu_figures_bf16.json"}
DEFAULT_CHC_FIGURES = "docs/chc_growth_cpu.json"
# Assumed sustained throughput of one GPU (TFLOP/s) when no GPU figures exist: the meta-training runs fp32
# by default and PyTorch does not use TF32 for fp32 matmuls unless asked (torch.backends.cuda.matmul.allow_tf32
# is False by default), so the ceiling is an H100 SXM's FP32 peak of 67 TFLOP/s (NVIDIA H100 Tensor Core GPU
# datasheet); ~45 % of it sustained is our guess, stated with every figure it produces.
DEFAULT_GPU_TFLOPS = 30.0
UNBOUNDED = "unbounded (the peak does not grow with it)"
GIB_MIB = 1024.0


class PlanError(ValueError):
    """A figures file that cannot answer the question; the message names the file and what is missing."""


def line_value(fit: dict, xs: list[float]) -> float:
    """``intercept + sum(slopes * xs)`` of one fitted line (``{"intercept", "slopes"}``).

    A line over ``max(support, query)`` (first-order peaks) takes the larger of the two ``xs``.
    """
    if fit.get("variables") == ["max(support, query)"]:
        xs = [max(xs)]
    if len(fit["slopes"]) != len(xs):
        raise PlanError(f"a fitted line has {len(fit['slopes'])} slopes, {len(xs)} variables given")
    return fit["intercept"] + sum(b * x for b, x in zip(fit["slopes"], xs))


def largest_fitting(fit: dict, xs: list[float], index: int, budget: float, step: float = 1.0) -> Optional[int]:
    """Largest ``n`` >= 0 with ``line(xs with xs[index] = n * step) <= budget`` (``None`` if even n = 0 fails).

    ``step`` converts the count (shots per class) into the variable (images): ``step = K``.
    """
    base = list(xs)
    base[index] = 0.0
    rest = line_value(fit, base)
    if rest > budget:
        return None
    if fit.get("variables") == ["max(support, query)"]:
        # the peak follows the larger pass: n may grow until its own pass alone reaches the budget
        slope = fit["slopes"][0] * step
        return sys.maxsize if slope <= 0 else int(math.floor((budget - fit["intercept"]) / slope))
    slope = fit["slopes"][index] * step
    if slope <= 0:
        return sys.maxsize
    return int(math.floor((budget - rest) / slope))


def default_path(relative: str) -> str:
    """A default figures file (``docs/...``) inside the checkout holding this package."""
    return str(REPO_ROOT / relative)


def default_gpu_figures(autocast: str) -> str:
    """The checkout's GPU figures measured with ``META.AUTOCAST`` ``autocast`` (the fp32 file for an autocast
    nobody measured: its figures are then not used, :func:`_gpu_step_seconds` compares the autocast)."""
    return default_path(GPU_FIGURES_BY_AUTOCAST.get(autocast, DEFAULT_GPU_FIGURES))


def _read_json(path: str, what: str, layout: Optional[dict] = None) -> dict:
    """A figures file as a dict; ``layout`` = ``{top-level key: python type}`` its present keys must have."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{path}: no such file ({what})" if what else f"{path}: no such file")
    try:
        obj = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise PlanError(f"{path}: not JSON ({err.msg}, line {err.lineno})") from None
    except (RecursionError, UnicodeDecodeError, OSError) as err:
        raise PlanError(f"{path}: not a readable JSON file ({type(err).__name__})") from None
    if not isinstance(obj, dict):
        raise PlanError(f"{path}: expected a JSON object of figures, got a JSON {type(obj).__name__}")
    for key, kind in (layout or {}).items():
        if key in obj and not isinstance(obj[key], kind):
            raise PlanError(
                f"{path}: {key}: expected a JSON {_JSON_NAMES.get(kind, kind)}, got {type(obj[key]).__name__}"
            )
    return obj


_JSON_NAMES = {dict: "object", list: "array", (int, float): "number"}
FIGURES_LAYOUT = {"fits": dict, "settings": dict}
GPU_LAYOUT = {"settings": dict, "variants": dict, "chc_images_per_s": (int, float)}
CHC_LAYOUT = {"growth": dict}


def figures_for(cfg, figures_file: Optional[str] = None, gpu_file: Optional[str] = None) -> tuple:
    """``(figures path, figures, GPU figures path, GPU figures or None)`` that answer ``cfg``: the CPU figures of
    its ``MODEL.BACKBONE`` (:func:`gram_tools.realsize.figures_path` unless ``figures_file``; a file of another
    backbone is refused, :func:`check_figures_model`) and the GPU figures of its ``META.AUTOCAST`` unless
    ``gpu_file``, kept only when they were measured on that backbone."""
    backbone = str(cfg.MODEL.BACKBONE)
    figures_file = figures_file or default_path(figures_path(backbone))
    figures = _read_json(
        figures_file, f"real-size figures: python -m gram_tools.realsize --model {backbone}", FIGURES_LAYOUT
    )
    check_figures_model(figures, figures_file, backbone)
    gpu_file = gpu_file or default_gpu_figures(str(cfg.META.AUTOCAST))
    gpu = _read_json(gpu_file, "", GPU_LAYOUT) if Path(gpu_file).is_file() else None
    if gpu is not None and gpu.get("settings", {}).get("model", backbone) != backbone:
        gpu = None  # another backbone's GPU seconds say nothing about this one
    return figures_file, figures, gpu_file, gpu


def check_figures_model(figures: dict, path: str, backbone: str) -> None:
    """Refuse (one line) a figures file measured on another backbone than the config's ``MODEL.BACKBONE`` (a file
    that records no ``settings.model`` cannot say, and is read as it is)."""
    measured = figures.get("settings", {}).get("model")
    if measured is not None and measured != backbone:
        raise PlanError(
            f"MODEL.BACKBONE {backbone}: {path} was measured on {measured}; measure this backbone with python -m "
            f"gram_tools.realsize --model {backbone} (writes {figures_path(backbone)}) or pass its --figures"
        )


def card_label(settings: dict) -> str:
    """The one name of the card and precision a GPU figures file was measured with: ``"NVIDIA H200, fp32"``,
    ``"NVIDIA H200, bf16 autocast"``."""
    autocast = settings.get("autocast") or "none"
    return f"{settings.get('gpu') or 'unknown GPU'}, {'fp32' if autocast == 'none' else autocast + ' autocast'}"


def task_batching_plan(cfg, task_mib: float, budget_mib: float, gpus: int) -> dict:
    """Tasks per pass on a GPU rank, as :class:`meta.method.batched.TaskBatching` decides there (JSON-ready).

    A rank holds ``ceil(META_BATCH / GPUs)`` tasks (torchrun shards the meta-batch).  ``off``, one task per rank, prompt
    pre-training or an objective the stacked pass does not compute (:func:`meta.method.batched.stacked_objective`)
    run them one by one (``chunk`` 1); ``on`` stacks them all; ``auto`` stacks them all and, where
    ``chunk x task_mib`` exceeds ``budget_mib`` (what it does on an out-of-memory error), halves the chunk until it
    fits or is one task.  A stacked pass is estimated as ``chunk`` times one task's peak (the measured UNIGRAM step
    of 4 stacked tasks on an H200 was within 5 % of it, as one task is of its line)."""
    from meta.metatrain.settings import meta_spec
    from meta.method.batched import stacked_objective

    mode = str(cfg.META.TASK_BATCHING)
    pretrain = str(cfg.META.MODE) == "pretrain"
    per_rank = 1 if pretrain else math.ceil(int(cfg.META.META_BATCH) / gpus)
    if pretrain:
        chunk, why = 1, "prompt pre-training: one batch per step"
    elif mode == "off":
        chunk, why = 1, "META.TASK_BATCHING off: one task after another"
    elif per_rank < 2:
        chunk, why = 1, f"ceil(META_BATCH / GPUs) = {per_rank} task per GPU"
    elif not stacked_objective(meta_spec(cfg)):
        chunk, why = 1, "the outer objective runs task by task (INNER_SUPPORT split)"
    elif mode == "on":
        chunk, why = per_rank, f"META.TASK_BATCHING on: the {per_rank} tasks of a GPU stacked in one pass"
    else:
        chunk = per_rank
        while chunk >= 2 and chunk * task_mib > budget_mib:
            chunk //= 2
        chunk = max(chunk, 1)
        why = (
            f"META.TASK_BATCHING auto: the {per_rank} tasks of a GPU stacked in one pass"
            if chunk == per_rank
            else f"META.TASK_BATCHING auto: {per_rank} stacked tasks do not fit, the out-of-memory fallback settles on "
            + (f"{chunk} per pass" if chunk > 1 else "one task at a time")
        )
    return {"mode": mode, "tasks_per_gpu": per_rank, "chunk": chunk, "how": why}


def config_learner(cfg) -> str:
    """The :data:`gram_tools.realsize.LEARNERS` row measuring ``cfg``'s ``META.PROMPT``
    (:func:`gram_tools.realsize.learner_of`)."""
    p = cfg.META.PROMPT
    return learner_of(
        int(p.N_CTX_TEXT),
        int(p.N_CTX_VISION),
        int(p.VISION_DEPTH),
        int(p.TEXT_DEPTH),
        str(p.COUPLING),
        str(p.get("LEARNER", DEFAULT_LEARNER)),
    )


def meta_plan(
    cfg,
    figures: dict,
    figures_path: str,
    gpu_figures: Optional[dict],
    gpu_memory_gib: float,
    gpus: int,
    gpu_tflops: float,
    margin: float,
) -> dict:
    """Memory, fit and hours of ``cfg``'s meta-training (see module docstring); a JSON-ready dict."""
    learner = config_learner(cfg)
    pretrain = str(cfg.META.MODE) == "pretrain"
    mode = "finetune" if pretrain else ("first" if cfg.META.FIRST_ORDER else "second")
    fits = figures.get("fits", {})
    if learner not in LEARNERS or learner not in fits or mode not in fits[learner]:
        measured = (
            _gpu_only_plan(cfg, gpu_figures, learner, mode, gpu_memory_gib, gpus, margin) if gpu_figures else None
        )
        if measured is None:
            how = (
                f"(python -m gram_tools.realsize --learners {learner} --modes {mode} --merge)"
                if learner in LEARNERS
                else f"(gram_tools.realsize measures the learners of meta/method/methods.yaml: {', '.join(LEARNERS)})"
            )
            raise PlanError(
                f"META.PROMPT: learner {learner!r} mode {mode!r} has no fitted line in {figures_path} "
                f"{how} and no GPU figures for this task size (scripts/gpu_check.sh writes them)"
            )
        return measured
    fit = fits[learner][mode]
    k = int(cfg.TASKS.K_WAY)
    inner = int(cfg.META.INNER_STEPS)
    if pretrain:  # the text side was measured at K_WAY classes; PRETRAIN.WAYS 0 (all topics) costs more
        xs = [float(cfg.META.PRETRAIN.BATCH_SIZE)]
        tasks_per_step = 1
    else:
        xs = [float(k * cfg.TASKS.N_SUPPORT * inner), float(k * cfg.TASKS.N_QUERY)]
        tasks_per_step = int(cfg.META.META_BATCH)
    model_mib = float(figures.get("settings", {}).get("model_mib") or 0.0)
    src = (
        f"measured on CPU, {figures.get('settings', {}).get('model', '?')} random weights, "
        f"line fitted to {fit['points']} sizes ({figures_path})"
    )
    task_mib = line_value(fit["peak_mib"], xs)
    budget = gpu_memory_gib * GIB_MIB * (1.0 - margin) - model_mib
    batching = task_batching_plan(cfg, task_mib, budget, gpus)
    chunk = batching["chunk"]
    peak_mib = chunk * task_mib + model_mib
    autocast = str(cfg.META.AUTOCAST)
    precision_note = (
        f"; measured in fp32, an upper bound for META.AUTOCAST {autocast}" if autocast not in ("none", "") else ""
    )
    out: dict = {
        "learner": learner,
        "mode": mode,
        "way": k,
        "inner_steps": inner,
        "images": dict(zip(fit["variables"], xs)),
        "task_peak_gib": {
            "value": round(task_mib / GIB_MIB, 3),
            "how": "estimated: "
            + src
            + ("; support images x INNER_STEPS (measured at one inner step)" if inner > 1 else ""),
        },
        "weights_gib": {"value": round(model_mib / GIB_MIB, 3), "how": f"measured: parameter bytes ({figures_path})"},
        "task_batching": batching,
        "peak_gib": {
            "value": round(peak_mib / GIB_MIB, 3),
            "how": (
                "estimated: task peak + weights"
                if chunk == 1
                else f"estimated: {chunk} stacked tasks x task peak + weights"
            )
            + precision_note,
        },
        "gpu_memory_gib": gpu_memory_gib,
        "margin": margin,
        "fits": bool(chunk * task_mib <= budget),
    }
    if not pretrain:
        # what must fit: one task (auto falls back to one at a time, off runs them so) or, with `on`, the whole stack
        held = chunk if batching["mode"] == "on" else 1
        line = fit["peak_mib"]
        line = {**line, "intercept": held * line["intercept"], "slopes": [held * b for b in line["slopes"]]}
        for key, index, step in (("largest_n_support", 0, k * inner), ("largest_n_query", 1, k)):
            n = largest_fitting(line, xs, index, budget, step=step)
            out[key] = UNBOUNDED if n == sys.maxsize else n
        out["largest_for_tasks_per_pass"] = held
    steps = int(cfg.META.STEPS)
    task_gflop = line_value(fit["gflops"], xs)
    step_gflop = tasks_per_step * task_gflop
    # torchrun shards the B tasks of a step over the ranks (meta.metatrain.trainer): a step takes as long as
    # the rank with the most tasks, ceil(B / GPUs); GPUs beyond B wait
    per_rank = math.ceil(tasks_per_step / gpus)
    out["step_gflop"] = {"value": round(step_gflop, 1), "how": "measured: FlopCounterMode on CPU, fitted line"}
    gpu_row = _gpu_step_seconds(gpu_figures, learner, mode, cfg) if gpu_figures else None
    if gpu_row is not None:
        out["hours"] = _measured_hours(cfg, *gpu_row, gpus)
    else:
        hours = steps * per_rank * task_gflop * 1e9 / (gpu_tflops * 1e12) / 3600.0
        out["hours"] = {
            "value": round(hours, 3),
            "how": f"estimated: task FLOPs x ceil(B / GPUs) = {per_rank} tasks per GPU x META.STEPS {steps} / "
            f"{gpu_tflops:g} TFLOP/s per GPU (assumed)" + _gpu_gap(gpu_figures, learner, mode),
        }
    if fit.get("seconds_per_gflop"):
        cpu_s = step_gflop * fit["seconds_per_gflop"]
        out["cpu_step_seconds"] = {
            "value": round(cpu_s, 2),
            "how": "estimated: step FLOPs x CPU seconds per GFLOP "
            f"measured on a shared 2-core VM (one thread, load {fit.get('load_avg_1min_range')})",
        }
    return out


def _gpu_only_plan(
    cfg, gpu: dict, learner: str, mode: str, gpu_memory_gib: float, gpus: int, margin: float
) -> Optional[dict]:
    """A plan from GPU figures alone (IVLP, MaPLe: no CPU line), when they were measured at ``cfg``'s task size,
    meta-batch and autocast.

    Memory is the measured peak allocation of one outer step of ``META_BATCH`` tasks on one GPU as the bench ran it
    (``META.TASK_BATCHING auto``: the tasks stacked; weights included), so only the measured task size is answered
    (no largest sizes); with several GPUs each holds fewer tasks and it is an upper bound.  Hours are measured step
    seconds as in :func:`meta_plan`.
    """
    timing = _gpu_step_seconds(gpu, learner, mode, cfg)
    peak_mb = gpu.get("variants", {}).get(learner, {}).get(f"{mode}_order_peak_mb")
    if timing is None or peak_mb is None:
        return None
    s = gpu.get("settings", {})
    peak_gib = float(peak_mb) / GIB_MIB  # the whole measured step (its META_BATCH tasks stacked); no GPU factor
    k = int(cfg.TASKS.K_WAY)
    return {
        "learner": learner,
        "mode": mode,
        "way": k,
        "inner_steps": int(cfg.META.INNER_STEPS),
        "images": {"support": k * int(cfg.TASKS.N_SUPPORT), "query": k * int(cfg.TASKS.N_QUERY)},
        "peak_gib": {
            "value": round(peak_gib, 3),
            "how": f"measured: peak allocated GPU memory of one outer step of {s.get('meta_batch')} stacked tasks on "
            f"{card_label(s)} ({s.get('model')}, weights included"
            + (f"; an upper bound on {gpus} GPUs, each holding fewer tasks)" if gpus > 1 else ")"),
        },
        "gpu_memory_gib": gpu_memory_gib,
        "margin": margin,
        "fits": bool(peak_gib <= gpu_memory_gib * (1.0 - margin)),
        "hours": _measured_hours(cfg, *timing, gpus),
    }


def _measured_hours(cfg, seconds: float, how: str, gpus: int) -> dict:
    """Hours of ``META.STEPS`` outer steps from measured seconds per step; torchrun shards the B tasks of a
    step over the ranks, so a step takes ``ceil(B / GPUs) / B`` of the one-GPU time."""
    tasks_per_step = int(cfg.META.META_BATCH)
    per_rank = math.ceil(tasks_per_step / gpus)
    hours = int(cfg.META.STEPS) * seconds * per_rank / tasks_per_step / 3600.0
    return {
        "value": round(hours, 3),
        "how": f"{how}; x META.STEPS {cfg.META.STEPS} x ceil(B / GPUs) / B "
        f"= {per_rank}/{tasks_per_step} on {gpus} GPU(s)",
    }


def _gpu_gap(gpu: Optional[dict], learner: str, mode: str) -> str:
    """Why GPU figures that exist give no step seconds for ``learner``: ``"; the GPU figures have no ... of learner
    'x'"`` when their ``variants`` lack its ``{mode}_order_step_s``, else ``""`` (no file, another task size, or a
    plain step, which the bench does not time)."""
    if not gpu or mode not in ("second", "first"):
        return ""
    row = gpu.get("variants", {}).get(learner)
    key = f"{mode}_order_step_s"
    if isinstance(row, dict) and key in row:
        return ""
    return f"; the GPU figures have no {key} of learner {learner!r} (python -m gram_tools.bench --device cuda)"


def _gpu_step_seconds(gpu: dict, learner: str, mode: str, cfg) -> Optional[tuple[float, str]]:
    """Measured seconds per outer step from ``bench --device cuda`` figures, if they match the config's task."""
    s = gpu.get("settings", {})
    same = (
        s.get("way") == int(cfg.TASKS.K_WAY)
        and s.get("support_shots") == int(cfg.TASKS.N_SUPPORT)
        and s.get("query_shots") == int(cfg.TASKS.N_QUERY)
        and s.get("meta_batch") == int(cfg.META.META_BATCH)
        and (s.get("autocast") or "none") == str(cfg.META.AUTOCAST)
        and str(cfg.META.TASK_BATCHING) != "off"  # the bench ran META.TASK_BATCHING auto
    )
    row = gpu.get("variants", {}).get(learner)
    key = f"{mode}_order_step_s"
    if not same or row is None or key not in row:
        return None
    return float(row[key]), f"measured: {card_label(s)} (gpu figures)"


def chc_plan(
    chc: dict,
    chc_path: str,
    pairs: float,
    gpu_figures: Optional[dict],
    image_gflop: Optional[float],
    gpus: int,
    gpu_tflops: float,
    fit_sample: int,
) -> dict:
    """Per CHC stage: hours over ``pairs`` pairs, from the growth laws (CPU) and the image tower (GPU)."""
    rows: dict = {}
    for name, g in chc.get("growth", {}).items():
        law = g.get("seconds_law")
        if law is None or name in ("image_features", "filter"):
            continue
        items = pairs  # one item per pair, the upper bound (gram_tools.chc_growth.fit_growth)
        if name == "umap_hdbscan_fit":
            items = min(items, fit_sample)
        ext = extrapolate_seconds(law, g["items"][-1], g["seconds"][-1], items)
        mem = g.get("rss_law")
        rows[name] = {
            "items": round(items),
            "cpu_hours": round(ext["target_seconds"] / 3600.0, 3),
            "peak_rss_gib": None if mem is None else round((mem["intercept"] + mem["slope"] * items) / GIB_MIB, 2),
            "how": f"extrapolated: {'CPU' if g.get('time') == 'cpu_seconds' else 'wall'} seconds = "
            f"{law['c']:.3g} x items^{law['p']:.2f}, fitted to {g['items']} items measured on one "
            f"CPU thread ({chc_path}); {ext['extrapolation']}",
        }
    images = pairs
    if gpu_figures and gpu_figures.get("chc_images_per_s"):
        rate = float(gpu_figures["chc_images_per_s"])
        rows["image_features"] = {
            "items": round(images),
            "gpu_hours": round(images / rate / 3600.0 / gpus, 3),
            "how": f"measured: {rate} images/s on {card_label(gpu_figures.get('settings', {}))} "
            f"(gpu figures), / {gpus} GPU(s); JPEG decoding not included",
        }
    elif image_gflop:
        hours = images * image_gflop * 1e9 / (gpu_tflops * 1e12 * gpus) / 3600.0
        rows["image_features"] = {
            "items": round(images),
            "gpu_hours": round(hours, 3),
            "how": f"estimated: {image_gflop:.1f} GFLOP per image (FlopCounterMode) / "
            f"({gpu_tflops:g} TFLOP/s assumed x {gpus} GPU(s)); JPEG decoding not included",
        }
    return rows


# TPT's per-image cost as its authors and a later paper published it (public sources only).  Both runs are on a GPU
# under fp16 autocast (azshue/TPT tpt_classification.py, test_time_tuning) with the text tower over all 77 token
# positions (azshue/TPT clip/custom_clip.py, TextEncoder), and on CLIP ResNet-50 where the backbone is named.
PUBLISHED_TPT = (
    {
        "figure": "ImageNet (1000 classes) needs a GPU with more than 16 GB of memory; tested on a 24 GB GPU "
        "(backbone not named there; the repository's default is RN50)",
        "source": "https://github.com/azshue/TPT README.md, Prerequisites / Hardware (Shu et al., NeurIPS 2022)",
    },
    {
        "figure": "12 h 50 min for ImageNet's 50,000 validation images with CLIP ResNet-50 (about 0.92 s per image; "
        "the GPU is not named there)",
        "source": "https://github.com/kdiAAA/TDA README.md, Comparisons in terms of efficiency and effectiveness on "
        "ImageNet (Karmanov et al., CVPR 2024)",
    },
)
TPT_VIEWS = 64  # TPT's batch: the image and 63 augmented views (meta.finetune.testtime.TestTimeSpec)
IMAGENET_CLASSES = 1000


def test_time_gpu_seconds(
    gpu: Optional[dict], learner: str, figures: dict, gflop: float, views: int, gpu_tflops: float
) -> dict:
    """GPU seconds of one test-time image (``gflop`` GFLOPs at ``views`` views), at the rate the GPU figures
    measured for that kind of pass where they have one, else the FLOP estimate at ``gpu_tflops``:

    * a learner with visual prompts runs the image tower forward and backward on every view, a first-order step's
      work: its ``first_order_tflops_achieved`` in the GPU figures;
    * a text-only learner encodes the views without gradients, CHC's image-feature pass (``chc_images_per_s``,
      measured in batches of ``settings.chc_batch``), and its text passes at ``gpu_tflops``.

    The GPU figures hold no test-time step, so every answer is ``estimated``; the ``how`` says from what."""
    from meta.method.prompts import PromptSpec

    spec = PromptSpec(**LEARNERS[learner]) if learner in LEARNERS else None
    visual = spec is not None and (spec.has_visual_prompts or spec.coupling == "maple")
    s = (gpu or {}).get("settings", {})
    row = (gpu or {}).get("variants", {}).get(learner, {})
    encode = figures.get("fits", {}).get("coop", {}).get("encode")
    if visual and row.get("first_order_tflops_achieved"):
        rate = float(row["first_order_tflops_achieved"])
        return {
            "value": round(gflop / (rate * 1e3), 3),
            "how": f"estimated: GFLOPs / {rate:g} TFLOP/s, the rate of {learner}'s first-order meta-step (the image "
            f"tower forward and backward, as TPT's step) measured on {card_label(s)} (gpu figures); no test-time "
            "step was measured on a GPU",
        }
    if not visual and spec is not None and gpu and gpu.get("chc_images_per_s") and encode:
        rate = float(gpu["chc_images_per_s"])
        text_gflop = max(gflop - views * float(encode["gflops"]["slopes"][0]), 0.0)
        seconds = views / rate + text_gflop / (gpu_tflops * 1e3)
        return {
            "value": round(seconds, 3),
            "how": f"estimated: {views} views at the measured no-grad encoding rate {rate:g} images/s (CHC, batches of "
            f"{s.get('chc_batch')}, {card_label(s)}) + the text passes' {text_gflop:.0f} GFLOP / {gpu_tflops:g} "
            "TFLOP/s (assumed); no test-time step was measured on a GPU",
        }
    return {
        "value": round(gflop / (gpu_tflops * 1e3), 3),
        "how": f"estimated: FLOP estimate, GFLOPs / {gpu_tflops:g} TFLOP/s (assumed); the GPU figures have no rate "
        "for this pass",
    }


def test_time_plan(
    cfg, figures: dict, figures_path: str, gpu: Optional[dict], views: int, classes: int, gpu_tflops: float
) -> dict:
    """One image of test-time prompt tuning for ``cfg``'s learner and backbone at ``views`` views and ``classes``
    classes (module docstring); a JSON-ready dict.  Raises :class:`PlanError` (one line naming the file and the key)
    when the figures file has no test-time plane for the learner."""
    from meta.finetune.testtime import TestTimeSpec

    learner = config_learner(cfg)
    fit = figures.get("fits", {}).get(learner, {}).get("testtime")
    if fit is None:
        raise PlanError(
            f"{figures_path}: fits.{learner}.testtime: no test-time figures for learner {learner!r} "
            f"(python -m gram_tools.realsize --learners {learner} --modes testtime --merge)"
        )
    measured = [p for p in figures.get("points", []) if p.get("learner") == learner and p.get("mode") == "testtime"]
    grid_v = sorted({int(p["views"]) for p in measured})
    grid_c = sorted({int(p["classes"]) for p in measured})
    inside = bool(grid_v and grid_c) and grid_v[0] <= views <= grid_v[-1] and grid_c[0] <= classes <= grid_c[-1]
    where = (
        f"plane fitted to {fit['points']} points (views {grid_v}, classes {grid_c}) measured on CPU, "
        f"{figures.get('settings', {}).get('model', '?')} random weights ({figures_path}); "
        + ("inside the measured grid" if inside else "extrapolated beyond the measured grid")
    )
    peak_mib = line_value(fit["peak_mib"], [float(views), float(classes)])
    phases = ""
    if "views_peak_mib" in fit:  # a text-only learner: the larger of the views' no-grad encoding and the step
        encode_mib = line_value(fit["views_peak_mib"], [float(views)])
        phases = (
            f"; the larger of two phases, the no-grad encoding of the views ({encode_mib / GIB_MIB:.3f} GiB) and "
            f"the text step ({peak_mib / GIB_MIB:.3f} GiB, fitted to the {fit['peak_mib'].get('points')} points "
            "it dominates)"
        )
        peak_mib = max(peak_mib, encode_mib)
    gflop = line_value(fit["gflops"], [float(views), float(classes), float(views * classes)])
    model_mib = float(figures.get("settings", {}).get("model_mib") or 0.0)
    out: dict = {
        "learner": learner,
        "views": views,
        "classes": classes,
        "kept_views": TestTimeSpec(views=views).kept,
        "image_peak_gib": {"value": round(peak_mib / GIB_MIB, 3), "how": "estimated: " + where + phases},
        "peak_gib": {
            "value": round((peak_mib + model_mib) / GIB_MIB, 3),
            "how": f"estimated: image peak + weights ({model_mib:g} MiB, {figures_path}); fp32",
        },
        "gflop": {"value": round(gflop, 1), "how": "measured: FlopCounterMode on CPU, " + where},
    }
    if fit.get("seconds_per_gflop"):
        out["cpu_seconds"] = {
            "value": round(gflop * fit["seconds_per_gflop"], 2),
            "how": f"estimated: GFLOPs x {fit['seconds_per_gflop']:g} CPU s per GFLOP, the median of the measured "
            f"points (one thread, shared VM, load {fit.get('load_avg_1min_range')})",
        }
    out["gpu_seconds"] = test_time_gpu_seconds(gpu, learner, figures, gflop, views, gpu_tflops)
    out["published_tpt"] = [dict(row) for row in PUBLISHED_TPT]
    return out


def test_time_sizes(values: Optional[list]) -> tuple[int, int]:
    """``(views, classes)`` of ``--test-time`` (``[]``: TPT's 64 and ImageNet's 1000); :class:`PlanError` unless
    nothing or two integers >= 1 are given."""
    if not values:
        return TPT_VIEWS, IMAGENET_CLASSES
    try:
        views, classes = (int(v) for v in values)
        assert views >= 1 and classes >= 1
    except (ValueError, AssertionError):
        raise PlanError(
            f"--test-time: expected nothing ({TPT_VIEWS} views, {IMAGENET_CLASSES} classes) or VIEWS CLASSES, two "
            f"integers >= 1, got {' '.join(values)!r} (put KEY VALUE overrides before --test-time)"
        ) from None
    return views, classes


def _image_gflop(figures: dict) -> Optional[float]:
    fit = figures.get("fits", {}).get("coop", {}).get("encode")
    return None if fit is None else float(fit["gflops"]["slopes"][0])


# Upper bounds of the numeric flags: far beyond any real machine or corpus, low enough that the plan's
# arithmetic (``pairs ** p`` growth laws, GiB -> MiB, FLOPs / throughput) stays finite.
MAX_GPUS = 100_000
MAX_GPU_MEMORY_GIB = 1e6
MIN_GPU_TFLOPS = 1e-3
MAX_GPU_TFLOPS = 1e6
MAX_PAIRS = 1e12


def _in_range(value: float, low: float, high: float, low_open: bool = False) -> bool:
    """``low <(=) value <= high`` and finite (``nan`` / ``inf`` fail)."""
    if not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and value <= high


def _flag_problem(args) -> str:
    """The first numeric flag out of range (one line naming it), or ``""``."""
    checks = (
        ("--gpus", args.gpus, 1 <= args.gpus <= MAX_GPUS, f"an integer 1 <= gpus <= {MAX_GPUS}"),
        (
            "--gpu-memory-gib",
            args.gpu_memory_gib,
            _in_range(args.gpu_memory_gib, 0.0, MAX_GPU_MEMORY_GIB, low_open=True),
            f"a finite number 0 < GiB <= {MAX_GPU_MEMORY_GIB:g}",
        ),
        (
            "--gpu-tflops",
            args.gpu_tflops,
            _in_range(args.gpu_tflops, MIN_GPU_TFLOPS, MAX_GPU_TFLOPS),
            f"a finite number {MIN_GPU_TFLOPS:g} <= TFLOP/s <= {MAX_GPU_TFLOPS:g}",
        ),
        ("--margin", args.margin, _in_range(args.margin, 0.0, 1.0) and args.margin < 1, "a fraction 0 <= margin < 1"),
        (
            "--pairs",
            args.pairs,
            _in_range(args.pairs, 1.0, MAX_PAIRS),
            f"a finite number of pairs 1 <= pairs <= {MAX_PAIRS:g}",
        ),
    )
    for flag, value, ok, what in checks:
        if not ok:
            return f"{flag}: expected {what}, got {value:g}"
    return ""


def config_kind_problem(config_file: str) -> str:
    """Why ``config_file`` is no meta-training config, ``""`` when it is one (it sets ``META`` keys).

    A CHC config (``configs/meta/chc_*.yaml``: ``MODEL`` and ``CHC`` only) loads into the same key tree, so it
    would be planned silently as the default meta-training run.  Call after ``load_meta_cfg`` read the file
    (valid YAML, no aliases)."""
    import yaml

    with open(config_file, "rb") as fh:
        tree = yaml.safe_load(fh)
    top = sorted(tree) if isinstance(tree, dict) else []
    if "META" in top:
        return ""
    what = "a clustering config for `python -m meta cluster`" if "CHC" in top else "no meta-training config"
    return (
        f"{config_file}: sets no META keys (top level: {', '.join(map(str, top)) or 'nothing'}): {what}; "
        "expected a meta-training config such as configs/meta/train_coop.yaml"
    )


def _figures_step(path: str, fn, *args):
    """``fn(*args)``, where a figures file with the right top level but a wrong inner layout ends in one line."""
    try:
        return fn(*args)
    except PlanError:
        raise
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        detail = f"missing key {err}" if isinstance(err, KeyError) else " ".join(str(err).split())[:160]
        raise PlanError(f"{path}: not the layout this planner reads ({type(err).__name__}: {detail})") from None


def main(argv: Optional[list[str]] = None) -> int:
    from meta.config import load_meta_cfg
    from meta.infra.cli_errors import UserError
    from meta.metatrain.settings import check_meta_cfg

    ap = argparse.ArgumentParser(prog="python -m gram_tools.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--config-file", required=True, help="a meta-training config (configs/meta/train_*.yaml)")
    ap.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help=f"memory of one GPU, 0 < GiB <= {MAX_GPU_MEMORY_GIB:g}"
    )
    ap.add_argument("--gpus", type=int, default=1, help=f"1 <= GPUs <= {MAX_GPUS}")
    ap.add_argument(
        "--gpu-tflops",
        type=float,
        default=DEFAULT_GPU_TFLOPS,
        help="assumed sustained TFLOP/s per GPU when no GPU figures exist "
        f"({MIN_GPU_TFLOPS:g} <= TFLOP/s <= {MAX_GPU_TFLOPS:g})",
    )
    ap.add_argument("--margin", type=float, default=0.1, help="fraction of GPU memory kept free, 0 <= margin < 1")
    ap.add_argument(
        "--pairs", type=float, default=3.1e6, help=f"CHC corpus size, 1 <= pairs <= {MAX_PAIRS:g} (CC3M: 3.1e6)"
    )
    ap.add_argument(
        "--figures",
        default=None,
        help=f"default: the checkout's figures of the config's MODEL.BACKBONE (<checkout>/{DEFAULT_FIGURES} for "
        f"{DEFAULT_MODEL}, docs/realsize_cpu_<backbone>.json for another)",
    )
    ap.add_argument(
        "--gpu-figures",
        default=None,
        help="default: the checkout's figures of the config's META.AUTOCAST ("
        + ", ".join(f"{k}: {v}" for k, v in GPU_FIGURES_BY_AUTOCAST.items())
        + ") when it exists",
    )
    ap.add_argument(
        "--chc-figures",
        default=default_path(DEFAULT_CHC_FIGURES),
        help=f"default: <checkout>/{DEFAULT_CHC_FIGURES} when it exists",
    )
    ap.add_argument(
        "--test-time",
        nargs="*",
        default=None,
        metavar="N",
        help=f"also one image of test-time prompt tuning at VIEWS CLASSES (default {TPT_VIEWS} {IMAGENET_CLASSES}: "
        "TPT's views, ImageNet's classes), from the figures' fits.<learner>.testtime",
    )
    ap.add_argument("opts", nargs=argparse.REMAINDER, help="KEY VALUE config overrides")
    args = ap.parse_args(argv)
    problem = _flag_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_meta_cfg(args.config_file, args.opts)
        kind = config_kind_problem(args.config_file)
        if kind:
            raise PlanError(kind)
        check_meta_cfg(cfg)  # the same checks as `python -m meta train`: what it refuses is not planned
        tt_sizes = None if args.test_time is None else test_time_sizes(args.test_time)
        args.figures, figures, args.gpu_figures, gpu = figures_for(cfg, args.figures, args.gpu_figures)
        result = {
            "config": args.config_file,
            "meta_training": _figures_step(
                args.figures if gpu is None else f"{args.figures} or {args.gpu_figures}",
                meta_plan,
                cfg,
                figures,
                args.figures,
                gpu,
                args.gpu_memory_gib,
                args.gpus,
                args.gpu_tflops,
                args.margin,
            ),
        }
        if Path(args.chc_figures).is_file():
            chc = _read_json(args.chc_figures, "", CHC_LAYOUT)
            result["chc"] = _figures_step(
                args.chc_figures,
                chc_plan,
                chc,
                args.chc_figures,
                args.pairs,
                gpu,
                _image_gflop(figures),
                args.gpus,
                args.gpu_tflops,
                int(cfg.CHC.TOPICS.FIT_SAMPLE),
            )
        if tt_sizes is not None:
            result["test_time"] = _figures_step(
                args.figures, test_time_plan, cfg, figures, args.figures, gpu, *tt_sizes, args.gpu_tflops
            )
    except (PlanError, UserError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    m = result["meta_training"]
    print(
        f"{args.config_file}: learner {m['learner']}, {m['mode']}-order"
        if m["mode"] != "finetune"
        else f"{args.config_file}: learner {m['learner']}, plain steps",
        flush=True,
    )
    print(f"  images per task: {m['images']}")
    for key in ("task_peak_gib", "weights_gib", "peak_gib", "step_gflop", "hours", "cpu_step_seconds"):
        if key not in m:
            continue
        print(f"  {key:18s} {m[key]['value']:>10}   ({m[key]['how']})")
    if "task_batching" in m:
        print(f"  tasks per pass     {m['task_batching']['chunk']:>10}   ({m['task_batching']['how']})")
    print(f"  fits {args.gpu_memory_gib:g} GiB with {args.margin:.0%} kept free: {'yes' if m['fits'] else 'NO'}")
    if "largest_n_support" in m:
        held = m["largest_for_tasks_per_pass"]
        print(
            f"  largest TASKS.N_SUPPORT that fits (query fixed): {m['largest_n_support']}; "
            f"largest TASKS.N_QUERY (support fixed): {m['largest_n_query']} "
            f"({'one task per pass' if held == 1 else f'{held} stacked tasks per pass'})"
        )
    for name, row in result.get("chc", {}).items():
        hours = row.get("cpu_hours", row.get("gpu_hours"))
        unit = "CPU h" if "cpu_hours" in row else "GPU h"
        print(f"  CHC {name:24s} {row['items']:>9} items {hours:>9} {unit}   ({row['how']})")
    if "test_time" in result:
        t = result["test_time"]
        print(
            f"  test-time prompt tuning, one image: learner {t['learner']}, {t['views']} views "
            f"({t['kept_views']} kept), {t['classes']} classes, one step"
        )
        for key in ("image_peak_gib", "peak_gib", "gflop", "cpu_seconds", "gpu_seconds"):
            if key in t:
                print(f"    {key:16s} {t[key]['value']:>10}   ({t[key]['how']})")
        for row in t["published_tpt"]:
            print(f"    published TPT: {row['figure']} ({row['source']})")
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
