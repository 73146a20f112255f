"""Real-size cost of every learner on this CPU: ``python -m gram_tools.realsize``.

For each row of :data:`LEARNERS` (every learner of the method table ``meta/method/methods.yaml`` as its
meta-training config shapes it: CoOp with cached image features, VPT, UNIGRAM, IVLP, MaPLe; and VPT deep, a
:data:`DEPTH_ROWS` row; a new learner is its table row), at the real architecture (default ViT-B-16, 224 px, random
weights: memory and FLOPs do not depend on the weights) and the default config's ``TASKS.K_WAY``:

* ``second`` / ``first``: one meta-task (clone θ, one regulated inner step on ``s`` support images,
  query loss on ``q`` query images at θ', backward to θ and φ), second / first order;
* ``finetune``: one Dassl-style fine-tuning step (forward + backward + SGD step on a batch of ``b``
  images through the frozen towers; CoOp's image features are recomputed every step, as in CoOp);
* ``encode``: the frozen image tower on a batch of ``b`` images without gradients (CHC's image-feature
  stage; measured under the ``coop`` row, the prompts play no part);
* ``testtime`` (only when asked, ``--modes testtime``; ``--views``, ``--classes``): one image of test-time prompt
  tuning, :func:`meta.finetune.testtime.tune_one` on one random image with ``TestTimeSpec(views=V)`` (one AdamW
  step) over ``C`` class names: the ``V``-view batch, the entropy step, the prediction.  A learner without visual
  prompts (``coop``) encodes the views once without gradients and its step is text passes over the C prompts; one
  with visual prompts (``unigram``) runs the image tower with gradients on every view.

Every learner runs in a fresh subprocess (one thread, the CLIP built once) and each point reports

* ``peak_mib``: the process's resident high-water mark during the step minus its resident size just
  before (``VmHWM`` after resetting it through ``/proc/self/clear_refs``, minus ``VmRSS``), in MiB, the
  largest over the timed steps (``peak_mib_runs`` lists the counted step first);
* ``flops``: floating-point operations counted by ``torch.utils.flop_counter.FlopCounterMode``
  (matrix products, convolutions and attention; elementwise ops are not counted);
* ``saved_mib``: bytes autograd saved for backward (``saved_tensors_hooks``, each storage once), split
  by tensor kind (tokens ``[n, L, d]``, MLP hidden ``[n, L, 4d]``, attention maps ``[n, H, L, L]``, other),
  the hand count of what dominates, to be read against ``peak_mib``;
* ``seconds``: median wall time of ``--repeats`` steps after the counted one, with the load average
  (``os.getloadavg()``) before and after: the machine is shared, so times are inflated and noisy; the
  fits therefore also give ``seconds_per_gflop`` (median over the points), the figure the planner uses.

Then per learner and mode the least-squares line ``cost = a + b_s * s + b_q * q`` (meta-tasks) or
``a + b * batch`` (fine-tuning) for memory, FLOPs and seconds, with the largest residual; the
first-order peak is fitted as ``a + b * max(s, q)`` (its support graph is freed before the query pass).

A test-time point is one image at ``V`` views and ``C`` classes (``"views"``, ``"classes"`` in the point; its
``support`` and ``query`` are 0).  Its FLOPs are fitted as ``a + b_v V + b_c C + b_vc V C``: the image tower runs on
the V views (no grad for CoOp, forward and backward for UNIGRAM), the text tower on the C prompts (forward, backward,
and the prediction's forward), and the cosine logits ``[V, C]`` are the one product of both (``2 V C E`` FLOPs per
logits call; E the embedding width), so the four terms are the exact count, up to the prompts' length: the
longest name sets the token length of all C prompts, so the text cost per class steps up where the names
``"class i"`` get a token longer (the residual shows it: 3 GFLOP of 1,000 at ViT-B/16 up to 320 classes).  Peak MiB
and seconds are fitted as ``a + b_v V + b_c C``: the ``[V, C]`` logits are kilobytes, and a fourth coefficient
fitted to a few noisy points would fit the noise (of memory: the allocator's page granularity; of time: the machine's
load).  A CoOp image's peak is the larger of two phases that never overlap, the views' no-grad encoding (grows
with V) and the text step (grows with C; it holds the views and their features, so also a little with V): each
CoOp point also measures the encoding alone (``views_peak_mib``), and :func:`fit_testtime` fits a line to it and
the plane of the step to the points the step dominates (so the grid needs class counts large enough for that;
``--classes 10,40,160,320`` for CoOp at ViT-B-16).

Human lines first, the JSON last; ``--out`` writes the same JSON (read by :mod:`gram_tools.plan`).  ``--merge``
keeps the file's other points and its ``settings`` (adding only keys it lacks, and a test-time run's own settings
under ``settings.testtime``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from gram_tools.bench_gpu import VARIANTS
from meta.config import get_meta_cfg_default
from meta.infra.cli_errors import int_flag_problem
from meta.infra.fileio import write_json_atomic
from meta.infra.memory import peak_mib as resident_peak_mib
from meta.infra.memory import reset_hwm
from meta.method.learners import DEFAULT_LEARNER

# Rows measured beside a learner's own shape: (row name, PromptSpec fields replaced), after the learner's row.
# VPT deep puts prompts in every block of ViT-B/16 (VPT-deep's layout, Jia et al. ECCV 2022 section 3.2).
DEPTH_ROWS: dict[str, tuple[str, dict]] = {"vpt": ("vpt_deep", {"vision_depth": 12})}


def _rows() -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for name, spec in VARIANTS.items():
        rows[name] = dict(spec)
        if name in DEPTH_ROWS:
            extra, changes = DEPTH_ROWS[name]
            rows[extra] = {**spec, **changes}
    return rows


# row -> PromptSpec keyword arguments: every learner of the method table as its meta-training config shapes it
# (gram_tools.bench_gpu.VARIANTS, meta/method/methods.yaml) and the DEPTH_ROWS, in table order.  A learner whose
# prompts leave the image tower alone (CoOp) runs its meta-tasks on cached image features.
LEARNERS: dict[str, dict] = _rows()
MODES = ("second", "first", "finetune", "encode", "testtime")  # encode: CHC's image features (no grad)
DEFAULT_MODES = MODES[:4]  # testtime (one TPT image) only when asked: --modes testtime
TESTTIME_LEARNERS = ("coop", "unigram")  # a text-only learner and one with visual prompts
DEFAULT_TT_VIEWS = (8, 16, 32)  # TPT's own batch is 64 views (meta.finetune.testtime.TestTimeSpec)
DEFAULT_TT_CLASSES = (10, 40)  # ImageNet has 1000; the planner extrapolates the fitted plane
DEFAULT_META_SIZES = ((1, 1), (2, 1), (1, 2), (2, 2))  # (support images, query images)
DEFAULT_FT_BATCHES = (1, 2, 4)
DEFAULT_OUT = "docs/realsize_cpu.json"  # the default backbone's (ViT-B-16) figures
DEFAULT_MODEL = str(get_meta_cfg_default().MODEL.BACKBONE)  # ViT-B-16, the paper's backbone


def figures_path(model: str) -> str:
    """The checkout-relative figures file of backbone ``model``: :data:`DEFAULT_OUT` for ViT-B-16, else
    ``docs/realsize_cpu_<model>.json`` (one file per backbone, each measured by ``--model``)."""
    return DEFAULT_OUT if model == DEFAULT_MODEL else f"docs/realsize_cpu_{model}.json"


MIB = 2**20
# One thread; a fixed glibc mmap threshold, so every tensor above 64 KiB is mapped on allocation and
# unmapped when freed: resident size then follows live tensors (no heap retention between steps).
SUBPROCESS_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def learner_of(
    n_ctx_text: int,
    n_ctx_vision: int,
    vision_depth: int,
    text_depth: int = 1,
    coupling: str = "none",
    learner: str = DEFAULT_LEARNER,
) -> str:
    """The :data:`LEARNERS` row measuring a prompt shape (depth 0 or > 1 is deep VPT, measured at full depth).

    Deep text prompts (``TEXT_DEPTH`` != 1) are the ``"ivlp"`` row (measured with prompts in every layer of both
    towers) and MaPLe's coupling the ``"maple"`` row (depth 9); a figures file without their lines makes the
    planner fall back to GPU figures or refuse in one line, never answer with another learner's figures.  A prompt
    learner of its own (``learner``, ``META.PROMPT.LEARNER``) is the row measured with it, or its own key when no
    row is (then no figures answer for it).
    """
    if learner != DEFAULT_LEARNER:
        return next((name for name, spec in LEARNERS.items() if spec.get("learner") == learner), learner)
    if coupling != "none":
        return "maple"
    if text_depth != 1:
        return "ivlp"
    if n_ctx_vision <= 0:
        return "coop"
    if n_ctx_text <= 0:
        return "vpt" if vision_depth == 1 else "vpt_deep"  # VISION_DEPTH 0 = every layer (meta/config.py)
    return "unigram"


# ----------------------------------------------------------------------------- one point (subprocess)
def peak_mib(fn: Callable[[], None]) -> float:
    """Resident high-water mark during ``fn()`` above the resident size before it (MiB; Linux):
    :func:`meta.infra.memory.peak_mib`, refused before ``fn`` runs where ``VmHWM`` cannot be reset."""
    if not reset_hwm():
        raise RuntimeError("cannot reset VmHWM (/proc/self/clear_refs): Linux >= 4.0 needed")
    return resident_peak_mib(fn)[1]


def tensor_kind(shape: Sequence[int], length: int, width: int) -> str:
    """Coarse class of a saved activation of a transformer with ``length`` tokens of ``width``."""
    if len(shape) >= 2 and shape[-1] == shape[-2] == length:
        return "attention maps [n,H,L,L]"
    if len(shape) >= 2 and shape[-2] == length and shape[-1] == 4 * width:
        return "mlp hidden [n,L,4d]"
    if len(shape) >= 2 and shape[-2] == length and shape[-1] in (width, 3 * width):
        return "tokens / qkv [n,L,d|3d]"
    return "other"


class SavedTensors:
    """``saved_tensors_hooks`` that add up each saved storage once, by :func:`tensor_kind`."""

    def __init__(self, length: int, width: int, frozen: Sequence[torch.Tensor] = ()):
        self.length, self.width = length, width
        self.seen: set = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in frozen}
        self.bytes: dict[str, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.seen:
            self.seen.add(key)
            kind = tensor_kind(tuple(t.shape), self.length, self.width)
            self.bytes[kind] = self.bytes.get(kind, 0) + storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def measure_learner(
    learner: str,
    grid: Sequence[tuple[str, int, int]],
    model: str = DEFAULT_MODEL,
    way: Optional[int] = None,
    repeats: int = 2,
) -> list[dict]:
    """Cost of one step of ``learner`` for each ``(mode, support, query)`` of ``grid`` (module docstring); a
    ``testtime`` entry is ``("testtime", views, classes)``.

    Run in a fresh process: the frozen CLIP is built once, then every point is measured in turn (the
    fixed mmap threshold of :data:`SUBPROCESS_ENV` returns each step's memory before the next).
    """
    from meta.config import get_meta_cfg_default
    from meta.model.backbone import load_clip

    torch.manual_seed(0)
    way = int(get_meta_cfg_default().TASKS.K_WAY) if way is None else way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model, pretrained=None)
    model_mib = sum(t.numel() * t.element_size() for t in [*clip.parameters(), *clip.buffers()]) / MIB
    out = []
    for mode, n_support, n_query in grid:
        row = _measure(clip, dims, learner, mode, n_support, n_query, way, repeats)
        out.append(
            {
                **row,
                "model": model,
                "way": n_query if mode == "testtime" else way,
                "image_size": dims.image_size,
                "model_mib": round(model_mib, 1),
                "threads": torch.get_num_threads(),
            }
        )
    return out


def testtime_step(
    pclip, theta, image_size: int, views: int, classes: int, seed: int = 0
) -> tuple[Callable[[], None], Optional[Callable[[], None]]]:
    """``(step, encode_views)``: ``step`` is one image of TPT as :func:`meta.finetune.testtime.tune_one` runs it
    (``TestTimeSpec(views=views)``: one AdamW step, the confident tenth of the views), on a random
    ``[3, image_size, image_size]`` image over ``classes`` names ``"class i"`` (a few BPE tokens each, like most
    ImageNet names), from a fresh copy of ``theta`` each call (the views are the same at every call: their generator
    is seeded anew).  ``encode_views`` is the first phase of ``step`` alone, cutting the views and encoding them
    without gradients, for a learner without visual prompts (``None`` for one with them, which has no such phase)."""
    from meta.finetune.testtime import TestTimeSpec, tune_one, view_batch
    from meta.method.learners import learner_of as prompt_learner

    spec = TestTimeSpec(views=views)
    names = [f"class {i}" for i in range(classes)]
    image = torch.randn(3, image_size, image_size, generator=torch.Generator().manual_seed(seed))

    def step() -> None:
        tune_one(pclip, theta, image, names, spec, torch.Generator().manual_seed(seed + 1), None)

    def encode_views() -> None:
        with torch.no_grad():
            pclip.image_features(None, view_batch(image, spec, torch.Generator().manual_seed(seed + 1)))

    return step, (None if prompt_learner(theta).has_visual_prompts(theta) else encode_views)


def _measure(clip, dims, learner: str, mode: str, n_support: int, n_query: int, way: int, repeats: int) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
    from meta.method.learners import get_learner
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

    spec = PromptSpec(**LEARNERS[learner])
    names = [f"class {i}" for i in range(way)]
    gen = torch.Generator().manual_seed(0)
    cached = mode in ("second", "first") and not get_learner(spec.learner).spec_prompts_vision(spec)

    def batch(n: int) -> dict:
        out = {"classnames": names, "label": torch.arange(n) % way}
        if cached:
            out["features"] = torch.nn.functional.normalize(torch.randn(n, dims.embed_dim, generator=gen), dim=-1)
        else:
            out["images"] = torch.randn(n, 3, dims.image_size, dims.image_size, generator=gen)
        return out

    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template)
    loss_fn = classification_loss(pclip)
    encode_views = None
    if mode == "testtime":
        step, encode_views = testtime_step(pclip, theta, dims.image_size, n_support, n_query)
    elif mode == "encode":
        data = batch(n_support)["images"]

        def step() -> None:
            with torch.no_grad():
                clip.encode_image(data)
    elif mode == "finetune":
        data = batch(n_support)
        optim = torch.optim.SGD(theta.parameters(), lr=0.002, momentum=0.9)

        def step() -> None:
            optim.zero_grad(set_to_none=True)
            loss_fn(theta, data)[0].backward()
            optim.step()
    else:
        ml = GRAMMetaLearner(theta, MetaSpec(first_order=mode == "first"))
        task = [TaskBatch(batch(n_support), batch(n_query))]

        def step() -> None:
            ml.accumulate(task, loss_fn)

    visual_tokens = spec.n_ctx_vision or (spec.n_ctx_text if spec.coupling == "maple" else 0)
    saved = SavedTensors(dims.num_patches + 1 + visual_tokens, dims.vision_width, [*clip.parameters(), *clip.buffers()])
    counter = FlopCounterMode(display=False)

    def counted() -> None:
        # nn.MultiheadAttention's fused fast path (frozen weights, eval mode: open_clip's own towers) is an
        # op FlopCounterMode does not count; the counted step runs the unfused path, the same products
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with counter, saved.hooks():
                step()
        finally:
            torch.backends.mha.set_fastpath_enabled(fast)

    peaks = [peak_mib(counted)]
    times, loads = [], [os.getloadavg()[0]]
    for _ in range(repeats):
        start = time.perf_counter()
        peaks.append(peak_mib(step))
        times.append(time.perf_counter() - start)
    loads.append(os.getloadavg()[0])
    sizes = (
        {"support": 0, "query": 0, "views": n_support, "classes": n_query}
        if mode == "testtime"
        else {"support": n_support, "query": n_query if mode in ("second", "first") else 0}
    )
    if mode == "testtime" and encode_views is not None:  # the no-grad phase's own peak (module docstring)
        sizes["views_peak_mib"] = round(peak_mib(encode_views), 1)
    return {
        "learner": learner,
        "mode": mode,
        **sizes,
        "peak_mib": round(max(peaks[1:] or peaks), 1),
        "peak_mib_runs": [round(p, 1) for p in peaks],
        "flops": int(counter.get_total_flops()),
        "saved_mib": {k: round(v / MIB, 1) for k, v in sorted(saved.bytes.items())},
        "seconds": round(statistics.median(times), 3) if times else None,
        "repeats": repeats,
        "load_avg_1min": [round(x, 2) for x in loads],
    }


# ----------------------------------------------------------------------------- fits
def fit_line(xs: np.ndarray, y: np.ndarray) -> dict:
    """Least squares ``y = a + xs @ b``; ``xs`` is ``[n_points, n_vars]``.  Returns a, b, largest residual."""
    design = np.hstack([np.ones((xs.shape[0], 1)), xs])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    return {
        "intercept": float(coef[0]),
        "slopes": [float(c) for c in coef[1:]],
        "max_abs_residual": float(np.abs(resid).max()),
    }


def _rounded(line: dict, digits: int = 4) -> dict:
    return {k: (round(v, digits) if isinstance(v, float) else [round(s, digits) for s in v]) for k, v in line.items()}


def _timing(rows: list[dict]) -> dict:
    """Seconds per counted GFLOP (median over ``rows``), the load range and the repeats of a fit's points."""
    per = [p["seconds"] / (p["flops"] * 1e-9) for p in rows if p["seconds"] and p["flops"]]
    loads = [x for p in rows for x in p["load_avg_1min"]]
    return {
        "seconds_per_gflop": round(statistics.median(per), 5) if per else None,
        "load_avg_1min_range": [min(loads), max(loads)],
        "repeats": rows[0]["repeats"],
    }


TESTTIME_VARIABLES = ["views", "classes", "views x classes"]


# A point's peak is its step's (not its no-grad view encoding's) when it exceeds the encoding's peak by this much.
STEP_PHASE_MIB, STEP_PHASE_SHARE = 2.0, 0.05


def _plane(rows: list[dict], key: str, scale: float = 1.0) -> dict:
    xs = np.array([[p["views"], p["classes"]] for p in rows], dtype=float)
    line = _rounded(fit_line(xs, np.array([p[key] * scale for p in rows], dtype=float)))
    return {**line, "variables": TESTTIME_VARIABLES[:2]}


def _pins_plane(rows: list[dict]) -> bool:
    xs = np.array([[1.0, p["views"], p["classes"]] for p in rows], dtype=float)
    return len(rows) >= 3 and np.linalg.matrix_rank(xs) == 3


def fit_testtime(rows: list[dict]) -> Optional[dict]:
    """Planes of one learner's test-time points (module docstring): GFLOPs ``a + b_v V + b_c C + b_vc V C``, peak
    MiB and seconds ``a + b_v V + b_c C``; ``None`` when the points do not pin the plane (fewer than two views or
    two class counts, or too few points for the four FLOP terms).

    Points that carry ``views_peak_mib`` (a learner without visual prompts: the no-grad encoding of the views
    measured alone) have two phases, and the image's peak is the larger: ``views_peak_mib`` is then the line
    ``a + b_v V`` of the encoding, and ``peak_mib`` the plane of the step alone, fitted to the points whose peak
    exceeds their encoding's (by :data:`STEP_PHASE_MIB` and :data:`STEP_PHASE_SHARE`; ``"phase": "step"``), or to
    every point (``"phase": "all"``) while fewer than three such points pin a plane.

    A learner with visual prompts has both graphs alive at the end of the forward (peak ~ image + text
    activations), but at many views and few classes its peak is the image tower's backward instead, where the
    classes do not show (measured at ViT-B/16: 32 views peak at 2260 MiB with 10 and with 40 classes).  Its plane is
    therefore fitted to the points at the grid's two largest class counts (``"phase": "largest classes"``), the
    regime the planner extrapolates into (ImageNet's 1000 classes), when those points pin a plane."""
    vc = np.array([[p["views"], p["classes"]] for p in rows], dtype=float)
    full = np.hstack([vc, vc[:, :1] * vc[:, 1:]])
    if np.linalg.matrix_rank(np.hstack([np.ones((len(rows), 1)), full])) < 4:
        return None
    # 7 decimals: the V x C term is 6 E FLOPs (3e-6 GFLOP at E = 512), which 4 would round to 0
    gflops = _rounded(fit_line(full, np.array([p["flops"] * 1e-9 for p in rows], dtype=float)), 7)
    entry: dict = {"variables": TESTTIME_VARIABLES, "points": len(rows), "gflops": gflops}
    entry["seconds"] = _plane(rows, "seconds")
    entry["peak_mib"] = _plane(rows, "peak_mib")
    if all(p.get("views_peak_mib") is not None for p in rows):
        views = np.array([[p["views"]] for p in rows], dtype=float)
        encode = _rounded(fit_line(views, np.array([p["views_peak_mib"] for p in rows], dtype=float)))
        entry["views_peak_mib"] = {**encode, "variables": ["views"]}
        step = [
            p
            for p in rows
            if p["peak_mib"] > p["views_peak_mib"] + max(STEP_PHASE_MIB, STEP_PHASE_SHARE * p["views_peak_mib"])
        ]
        entry["peak_mib"] = (
            {**_plane(step, "peak_mib"), "phase": "step", "points": len(step)}
            if _pins_plane(step)
            else {**entry["peak_mib"], "phase": "all", "points": len(rows)}
        )
    else:
        top = sorted({p["classes"] for p in rows})[-2:]
        largest = [p for p in rows if p["classes"] in top]
        if len(top) == 2 and _pins_plane(largest) and len(largest) < len(rows):
            entry["peak_mib"] = {**_plane(largest, "peak_mib"), "phase": "largest classes", "points": len(largest)}
    return {**entry, **_timing(rows)}


def fit_points(points: list[dict]) -> dict:
    """Per (learner, mode): lines for peak MiB, GFLOPs and seconds against support (and query) images; test-time
    points by :func:`fit_testtime`."""
    fits: dict = {}
    for learner in dict.fromkeys(p["learner"] for p in points):
        for mode in MODES:
            rows = [p for p in points if p["learner"] == learner and p["mode"] == mode]
            if not rows:
                continue
            if mode == "testtime":
                entry = fit_testtime(rows)
                if entry is not None:
                    fits.setdefault(learner, {})[mode] = entry
                continue
            cols = ["support", "query"] if mode in ("second", "first") else ["support"]
            xs = np.array([[p[c] for c in cols] for p in rows], dtype=float)
            if np.linalg.matrix_rank(np.hstack([np.ones((len(rows), 1)), xs])) < len(cols) + 1:
                continue
            entry = {"variables": cols if len(cols) == 2 else ["batch"], "points": len(rows)}
            for name, key, scale in (
                ("peak_mib", "peak_mib", 1.0),
                ("gflops", "flops", 1e-9),
                ("seconds", "seconds", 1.0),
            ):
                ys = np.array([p[key] * scale for p in rows], dtype=float)
                x = xs
                if name == "peak_mib" and mode == "first":
                    # first order frees the support graph after the inner step: the peak is the larger pass
                    x = xs.max(axis=1, keepdims=True)
                line = _rounded(fit_line(x, ys))
                if x is not xs:
                    line["variables"] = ["max(support, query)"]
                entry[name] = line
            # single timings on a loaded machine are too noisy for a line in three variables; time is
            # proportional to the counted FLOPs, so the time figure is seconds per GFLOP (median of the points)
            fits.setdefault(learner, {})[mode] = {**entry, **_timing(rows)}
    return fits


# ----------------------------------------------------------------------------- driver
def point_key(p: dict) -> tuple:
    """What identifies a measured point (a point measured again under ``--merge`` replaces the one of its key)."""
    return (p["learner"], p["mode"], p["support"], p["query"], p.get("views"), p.get("classes"))


def _run_learner(args: argparse.Namespace, learner: str, grid: list[tuple[str, int, int]]) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "gram_tools.realsize",
        "--one",
        learner,
        json.dumps(grid),
        "--model",
        args.model,
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **SUBPROCESS_ENV})
    if proc.returncode != 0:
        raise RuntimeError(f"{learner}: subprocess failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.realsize", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--learners",
        nargs="*",
        default=None,
        choices=list(LEARNERS),
        help=f"default: every learner for the meta modes, {' and '.join(TESTTIME_LEARNERS)} for testtime",
    )
    parser.add_argument(
        "--modes", nargs="*", default=list(DEFAULT_MODES), choices=list(MODES), help="default: all but testtime"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="open_clip architecture (MODEL.BACKBONE's names)")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the counted one")
    parser.add_argument(
        "--sizes",
        default=";".join(f"{s},{q}" for s, q in DEFAULT_META_SIZES),
        help="meta-task sizes 's,q;s,q;...' in images",
    )
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_FT_BATCHES)), help="fine-tuning batch sizes")
    parser.add_argument(
        "--views", default=",".join(map(str, DEFAULT_TT_VIEWS)), help="testtime: views per image 'v,v,...' (>= 1)"
    )
    parser.add_argument(
        "--classes", default=",".join(map(str, DEFAULT_TT_CLASSES)), help="testtime: class counts 'c,c,...' (>= 1)"
    )
    parser.add_argument(
        "--out", default=None, help="JSON file the planner reads ('' = none; default: figures_path(--model))"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the points and settings of an existing --out file (a point measured again replaces its old one; "
        "settings only gain keys, a testtime run's own under settings.testtime)",
    )
    parser.add_argument("--one", nargs=2, metavar=("LEARNER", "GRID"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = figures_path(args.model) if args.out is None else args.out
    problem = int_flag_problem(args, {"repeats": 1})
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.one:
        learner, grid = args.one[0], [tuple(g) for g in json.loads(args.one[1])]
        if learner not in LEARNERS or any(g[0] not in MODES for g in grid):
            print(f"error: --one: expected a learner in {list(LEARNERS)} and modes in {list(MODES)}", file=sys.stderr)
            return 2
        torch.set_num_threads(1)
        print(json.dumps(measure_learner(learner, grid, args.model, repeats=args.repeats)))
        return 0
    try:
        sizes = [tuple(int(v) for v in pair.split(",")) for pair in args.sizes.split(";") if pair]
        batches = [int(v) for v in args.batches.split(",") if v]
        views = [int(v) for v in args.views.split(",") if v]
        classes = [int(v) for v in args.classes.split(",") if v]
        assert all(len(p) == 2 and min(p) >= 1 for p in sizes) and min(batches + views + classes, default=1) >= 1
    except (ValueError, AssertionError):
        print(
            f"error: --sizes 's,q;s,q', --batches 'b,b', --views 'v,v' and --classes 'c,c' of integers >= 1 expected, "
            f"got {args.sizes!r} / {args.batches!r} / {args.views!r} / {args.classes!r}",
            file=sys.stderr,
        )
        return 2
    points = []
    for learner in args.learners or list(LEARNERS):
        grid = [
            (mode, s, q)
            for mode in args.modes
            for s, q in (
                sizes
                if mode in ("second", "first")
                else [(v, c) for v in views for c in classes]
                if mode == "testtime"
                else [(b, 0) for b in batches]
            )
        ]
        if learner != "coop":
            grid = [g for g in grid if g[0] != "encode"]  # the image tower alone: measured once
        if args.learners is None and learner not in TESTTIME_LEARNERS:
            grid = [g for g in grid if g[0] != "testtime"]
        if not grid:
            continue
        for p in _run_learner(args, learner, grid):
            points.append(p)
            where = (
                f"V={p['views']} C={p['classes']}" if p["mode"] == "testtime" else f"s={p['support']} q={p['query']}"
            )
            print(
                f"{learner:9s} {p['mode']:8s} {where}: peak {p['peak_mib']:8.1f} MiB  "
                f"{p['flops'] / 1e9:8.1f} GFLOP  {p['seconds']} s (load {p['load_avg_1min']})",
                flush=True,
            )
    old_settings: dict = {}
    new_points = list(points)
    if args.merge and args.out and Path(args.out).is_file():
        new = {point_key(p) for p in points}
        old = json.loads(Path(args.out).read_text())
        points = [p for p in old["points"] if point_key(p) not in new] + points
        old_settings = old.get("settings", {})
    meta_points = [p for p in points if p["mode"] != "testtime"]
    result = {
        "points": points,
        "fits": fit_points(points),
        "settings": {
            "model": args.model,
            "pretrained": None,
            "image_size": points[0].get("image_size") if points else None,
            "way": meta_points[0].get("way") if meta_points else None,
            "threads": 1,
            "repeats": args.repeats,
            "timing": "measured on a shared 2-core VM; median of repeats after one counted step",
            "memory": "VmHWM - VmRSS before the step (resident bytes, glibc allocator)",
            "flops": "torch.utils.flop_counter.FlopCounterMode (matmul/conv/attention only)",
            "model_mib": points[-1].get("model_mib") if points else None,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    measured_tt = [p for p in new_points if p["mode"] == "testtime"]
    if measured_tt:  # each learner's test-time runs, this one after the earlier ones (a merge keeps those)
        runs = {
            learner: list(earlier) if isinstance(earlier, list) else [earlier]
            for learner, earlier in old_settings.get("testtime", {}).get("runs", {}).items()
        }
        for learner in dict.fromkeys(p["learner"] for p in measured_tt):
            loads = [x for p in measured_tt if p["learner"] == learner for x in p["load_avg_1min"]]
            runs.setdefault(learner, []).append(
                {
                    "views": views,
                    "classes": classes,
                    "repeats": args.repeats,
                    "load_avg_1min_range": [min(loads), max(loads)],
                    "date_utc": result["settings"]["date_utc"],
                }
            )
        result["settings"]["testtime"] = {
            "what": "one image of meta.finetune.testtime.tune_one: TestTimeSpec(views=V), one AdamW step, C names "
            "'class i', a random image",
            "runs": runs,
        }
    if old_settings:  # a merge keeps what the file said of its points; the new run adds only the keys it lacks
        result["settings"] = {
            **result["settings"],
            **old_settings,
            **{k: v for k, v in result["settings"].items() if k == "testtime"},
        }
    for learner, modes in result["fits"].items():
        for mode, f in modes.items():
            mem = f["peak_mib"]
            print(
                f"fit {learner:9s} {mode:8s} peak MiB = {mem['intercept']:.0f} + "
                + " + ".join(f"{b:.0f} x {v}" for b, v in zip(mem["slopes"], f["variables"]))
                + f" (max residual {mem['max_abs_residual']:.0f}); GFLOP slopes {f['gflops']['slopes']}",
                flush=True,
            )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out, result, indent=1)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
