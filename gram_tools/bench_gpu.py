"""The accelerator benchmark behind ``python -m gram_tools.bench --device cuda``.

For one CLIP (default ViT-B-16 with random weights: the timings do not depend on the weights) and the
meta-training config's task size (``TASKS.K_WAY`` classes, ``TASKS.N_SUPPORT`` + ``TASKS.N_QUERY``
images per class, ``META.META_BATCH`` tasks per outer step), it reports for each learner of the method table
(:data:`VARIANTS`, in its meta-training config's shape: CoOp, M = 4 text tokens, cached image features; VPT, 4
visual tokens, images through the prompted image tower; UNIGRAM, 2 text + 2 visual tokens; the deep learners IVLP
and MaPLe) -

* ``second_order_step_s`` / ``first_order_step_s``: one whole outer step (B inner loops, query losses,
  backward, clipped Adam step), median over ``--repeats``, in seconds;
* ``second_order_peak_mb`` / ``first_order_peak_mb``: peak allocated device memory during one step (MiB);
* ``second_order_tflop`` / ``first_order_tflop``: the step's floating-point work (``FlopCounterMode`` over
  one step, the counter the planner's figures come from; 4 significant digits), ``..._tflops_achieved`` =
  that / the step time and ``..._matmul_fraction`` = achieved / ``matmul_tflops``, a plain square matrix
  product's TFLOP/s measured in the same run (bf16 on CUDA, the CLIP's dtype elsewhere): how far a step
  is from the card's limit, read off;

``task_scaling``: second-order step seconds (median of at most 3 after at most 1 warm-up; and peak MiB) of
the shallow learners (:data:`SCALING_VARIANTS`: CoOp, VPT and UNIGRAM) with 1 / 4 / 16 tasks per outer step,
``sequential`` (``META.TASK_BATCHING off``: one task after another) against ``batched`` (``auto``: the tasks
stacked, :mod:`meta.method.batched`; ``task_chunk`` is the chunk the out-of-memory fallback settled on, ``null`` =
all tasks at once);

and for CHC ``chc_images_per_s``: CLIP image features per second from decoded uint8 images (pixel
normalisation, host-to-device copy and the image tower; JPEG decoding is not included) at the config's
``CHC.IMAGES.BATCH_SIZE``, and ``chc_batch_sweep``: the same at several batch sizes, so that default can be
chosen by measurement.

``cost`` turns them into device-hours: meta-training = ``META.STEPS`` x step seconds / 3600 per
variant (second order, the paper's method), CHC = 3.1 M images (CC3M) / images per second / 3600.

Everything runs on any device (the tests run it on CPU with a tiny CLIP); ``--device cuda`` only adds
the CUDA synchronisation and memory counters.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from meta.method import methods

CC3M_PAIRS = 3.1e6
# learner -> PromptSpec fields: every learner of the method table (meta/method/methods.yaml) as its meta-training
# config configs/meta/train_<learner>.yaml shapes it at full size (IVLP: 2 + 2 tokens in every layer of both towers;
# MaPLe: 2 text tokens in 9 layers, visual ones projected), in table order
VARIANTS: dict[str, dict] = methods.learner_shapes("full")


def gpu_hours(count: float, seconds_each: float) -> float:
    """Device-hours for ``count`` repetitions of something that takes ``seconds_each`` seconds."""
    return count * seconds_each / 3600.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_mb(fn: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """TFLOP/s of ``[n, n] @ [n, n]`` in ``dtype`` on ``device`` (2 n³ FLOP each; median of ``repeats``)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    seconds = _median_time(lambda: torch.mm(a, b), device, 3, repeats)
    return 2.0 * n**3 / seconds / 1e12


def step_tflop(fn: Callable[[], None]) -> float:
    """TFLOP of one call of ``fn`` as ``torch.utils.flop_counter.FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops() / 1e12


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits."""
    return float(f"{x:.{digits}g}")


def _throughput(row: dict, prefix: str, tflop: float, peak: float) -> None:
    """Add ``{prefix}_tflop``, ``_tflops_achieved`` and ``_matmul_fraction`` to ``row`` (step time in it)."""
    achieved = tflop / row[f"{prefix}_step_s"]
    row[f"{prefix}_tflop"] = _sig(tflop)
    row[f"{prefix}_tflops_achieved"] = _sig(achieved)
    row[f"{prefix}_matmul_fraction"] = _sig(achieved / peak)


def task_size() -> dict:
    """K, support and query shots, meta-batch and outer steps of the default meta-training config."""
    from meta.config import get_meta_cfg_default

    cfg = get_meta_cfg_default()
    return {
        "way": int(cfg.TASKS.K_WAY),
        "support_shots": int(cfg.TASKS.N_SUPPORT),
        "query_shots": int(cfg.TASKS.N_QUERY),
        "meta_batch": int(cfg.META.META_BATCH),
        "steps": int(cfg.META.STEPS),
        "chc_batch": int(cfg.CHC.IMAGES.BATCH_SIZE),
    }


# the shallow learners (CoOp, VPT, UNIGRAM: the paper's three) in the task-scaling table
SCALING_VARIANTS = tuple(row.name for row in methods.learners().values() if row.name and not row.deep)
SCALING_TASKS = (1, 4, 16)


def check_learners(names) -> None:
    """ValueError (one line) naming the first of ``names`` with no prompt shape in :data:`VARIANTS` (the learners of
    the method table), or whose prompt learner (``learner`` field) is not registered."""
    from meta.method.learners import DEFAULT_LEARNER, get_learner
    from meta.method.prompts import PromptSpec  # noqa: F401  (registers the built-in learner)

    for name in names:
        if name not in VARIANTS:
            raise ValueError(
                f"bench: learner {name!r} has no prompt shape: the bench measures the learners of "
                f"meta/method/methods.yaml ({', '.join(VARIANTS)})"
            )
        key = VARIANTS[name].get("learner", DEFAULT_LEARNER)
        try:
            get_learner(key)
        except ValueError as err:
            raise ValueError(f"bench: learner {name!r}: {err} (import the module that registers it)") from None


CHC_BATCHES = (64, 128, 256, 512)


def run(
    model: str = "ViT-B-16",
    device: str = "cuda",
    autocast: str = "none",
    warmup: int = 2,
    repeats: int = 5,
    size: dict | None = None,
    chc_images: int = 1024,
    variants=tuple(VARIANTS),
    pretrained=None,
    scaling_tasks=SCALING_TASKS,
    scaling_variants=SCALING_VARIANTS,
    chc_batches=CHC_BATCHES,
    matmul_n: int | None = None,
) -> dict:
    """Measure the figures listed in the module docstring; returns the JSON-ready result.

    ``scaling_tasks`` / ``scaling_variants`` / ``chc_batches``: empty skips that part; ``matmul_n``: side of
    the reference matrix product (default 8192 on CUDA, 512 elsewhere).  A learner with no shape in
    :data:`VARIANTS`, or whose prompt learner is not registered, is a one-line ValueError naming it, before any
    measurement.
    """
    from meta.chc.imaging import clip_norm_stats, encode_images
    from meta.metatrain.outer import OuterStep
    from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
    from meta.model.backbone import load_clip

    check_learners((*variants, *scaling_variants))
    size = {**task_size(), **(size or {})}
    dev = torch.device(device)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=pretrained, device=dev)
    k, b = size["way"], size["meta_batch"]
    names = [f"class {i}" for i in range(k)]
    gen = torch.Generator().manual_seed(0)

    def part(shots: int, images: bool) -> dict:
        out = {"classnames": names, "label": torch.arange(k).repeat(shots).to(dev)}
        if images:
            out["images"] = torch.randn(k * shots, 3, dims.image_size, dims.image_size, generator=gen).to(dev)
        else:
            out["features"] = torch.nn.functional.normalize(
                torch.randn(k * shots, dims.embed_dim, generator=gen), dim=-1
            ).to(dev)
        return out

    result: dict = {"variants": {}}
    mm_dtype = torch.bfloat16 if dev.type == "cuda" else next(clip.parameters()).dtype
    peak = matmul_tflops(dev, mm_dtype, matmul_n or (8192 if dev.type == "cuda" else 512))
    result["matmul_tflops"] = _sig(peak)
    result["matmul_dtype"] = str(mm_dtype).replace("torch.", "")
    for name in variants:
        spec = PromptSpec(**VARIANTS[name])
        if spec.text_depth > dims.text_layers:  # MaPLe's 9 on a shallower test CLIP: every layer it has
            spec = replace(spec, text_depth=min(dims.text_layers, dims.vision_layers))
        images = spec.has_visual_prompts
        tasks = [TaskBatch(part(size["support_shots"], images), part(size["query_shots"], images)) for _ in range(b)]
        row = {}
        for order in ("second", "first"):
            theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
            ml = GRAMMetaLearner(theta, MetaSpec(first_order=order == "first", autocast=autocast)).to(dev)
            loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template))

            def step(outer=OuterStep(ml), loss_fn=loss_fn) -> None:
                outer.meta_step(tasks, loss_fn)

            row[f"{order}_order_step_s"] = round(_median_time(step, dev, warmup, repeats), 5)
            peak_mb = _peak_mb(step, dev)
            row[f"{order}_order_peak_mb"] = None if peak_mb is None else round(peak_mb, 1)
            _throughput(row, f"{order}_order", step_tflop(step), peak)
            del ml
        result["variants"][name] = row

    scaling: dict = {}
    for name in scaling_variants:
        spec = PromptSpec(**VARIANTS[name])
        images = spec.has_visual_prompts
        scaling[name] = {}
        for n_tasks in scaling_tasks:
            tasks = [
                TaskBatch(part(size["support_shots"], images), part(size["query_shots"], images))
                for _ in range(n_tasks)
            ]
            cell = {}
            for label, mode in (("sequential", "off"), ("batched", "auto")):
                theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
                ml = GRAMMetaLearner(theta, MetaSpec(autocast=autocast, task_batching=mode)).to(dev)
                loss_fn = classification_loss(PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template))

                def step(outer=OuterStep(ml), loss_fn=loss_fn, tasks=tasks) -> None:
                    outer.meta_step(tasks, loss_fn)

                seconds = _median_time(step, dev, min(warmup, 1), max(1, min(repeats, 3)))
                peak_mb = _peak_mb(step, dev)
                cell[label] = {"step_s": round(seconds, 5), "peak_mb": None if peak_mb is None else round(peak_mb, 1)}
                if mode == "auto":
                    cell[label]["task_chunk"] = ml.task_chunk
                del ml
            scaling[name][str(n_tasks)] = cell
    result["task_scaling"] = scaling

    pixels = np.random.default_rng(0).integers(
        0, 256, (chc_images, dims.image_size, dims.image_size, 3), dtype=np.uint8
    )
    mean, std = clip_norm_stats(clip)
    from meta.model.precision import autocast as autocast_ctx

    def encode(batch: int) -> None:
        with autocast_ctx(autocast, dev):
            encode_images(clip, pixels, mean, std, batch_size=batch, device=dev)

    seconds = _median_time(lambda: encode(size["chc_batch"]), dev, 1, max(1, repeats // 2))
    result["chc_images_per_s"] = round(chc_images / seconds, 1)
    result["chc_batch_sweep"] = {
        str(batch): round(chc_images / _median_time(lambda b=batch: encode(b), dev, 1, max(1, repeats // 2)), 1)
        for batch in chc_batches
    }
    result["cost"] = {
        "meta_train_gpu_hours": {
            name: round(gpu_hours(size["steps"], row["second_order_step_s"]), 3)
            for name, row in result["variants"].items()
        },
        "meta_train_gpu_hours_first_order": {
            name: round(gpu_hours(size["steps"], row["first_order_step_s"]), 3)
            for name, row in result["variants"].items()
        },
        "chc_gpu_hours_cc3m": round(gpu_hours(CC3M_PAIRS, 1.0 / result["chc_images_per_s"]), 3),
        "formula": "meta-train: META.STEPS x step_s / 3600; CHC: 3.1e6 / images_per_s / 3600",
    }
    result["settings"] = {
        "model": model,
        "pretrained": pretrained,
        "device": str(dev),
        "autocast": autocast,
        **size,
        "chc_images": chc_images,
        "warmup": warmup,
        "repeats": repeats,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
    }
    return result
