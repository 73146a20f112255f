"""Where a GPU's time goes, for the two costs that bound the GPU path: ``python -m gram_tools.profile_gpu``.

1. ``step_profile``: the task-batched second-order outer step (bf16 autocast, the default task size) of VPT and
   UNIGRAM under ``torch.profiler``: per learner the step's median seconds, the kernels' time per step (device-side
   events only, so no kernel is counted twice) and its share of the step's wall time, the top kernels (name,
   calls, ms per step, share), the shares of GEMM, fused-attention and cast kernels (read off kernel names), and
   the top aten operators by their own device time, and the step's matrix products by dtype (:class:`ProductCensus`).
   Three times: as configured by default, with ``META.SUPPORT_ATTENTION_LOWP`` (``bf16_support_attention_lowp``: the
   second-order support pass's attention products in bf16, not the MATH kernel's fp32), and with that key and
   ``META.CLOSED_FORM_LAYER_NORM`` (the support pass's LayerNorms differentiated twice in closed form, fewer bytes
   moved: :mod:`gram_tools.step_traffic`); with ``--bf16-weights`` also
   with the frozen CLIP in bf16 (``MODEL.PRECISION bf16``).  With ``--tf32``
   the same for fp32 with TF32 matmuls allowed (``torch.backends.cuda.matmul.allow_tf32``) beside fp32 without.
2. ``decode``: images per second of JPEG decoding + resize to 224 px at CC3M's typical size (500x375 px,
   quality 90; synthetic photos with smooth gradients and noise): PIL on one thread, PIL on ``--threads`` threads,
   and ``torchvision.io.decode_jpeg(device="cuda")`` on lists of ``--decode-batch`` images with the resize on the
   GPU; then CHC's own path (``CHC.IMAGES.DECODER torchvision``, :func:`chc_rates`): its decoder alone and end to end
   with the ViT-B/16 image tower under bf16.  Decoding is what bounded CHC's image stage on a GPU (the image tower
   alone runs ~6,000 img/s on an H200).  And the rate of reading those JPEGs' bytes from webdataset shards at 1 and
   4 threads (``CHC.IMAGES.READ_THREADS``, :func:`read_rates`), from storage and from the page cache.

Prints one JSON object as the last line (``--out`` also writes it).  CUDA only: without it one line, exit 2.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meta.infra.cli_errors import int_flag_problem

# aten matrix products (their overload packets), the census of ProductCensus
PRODUCT_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"})
# substrings of kernel names (lower case)
MATMUL_KERNELS = ("gemm", "xmma", "cutlass", "nvjet", "cublas")
ATTENTION_KERNELS = ("flash", "fmha", "attention", "efficient")
CAST_KERNELS = ("copy_kernel", "_copy")


def synthetic_jpegs(n: int, width: int = 500, height: int = 375, quality: int = 90, seed: int = 0) -> list[bytes]:
    """``n`` JPEG files (bytes) of ``width`` x ``height`` px: smooth colour gradients plus noise, like photos."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(n):
        a, b, c = rng.uniform(0.2, 1.0, 3)
        base = np.stack([xx * a / width, yy * b / height, (xx + yy) * c / (width + height)], axis=-1) * 255
        img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def decode_rates(jpegs: list[bytes], threads: int, batch: int, size: int = 224) -> dict:
    """Images per second: PIL decode + resize (1 and ``threads`` threads) and CUDA batched decode + resize."""
    import torchvision
    from PIL import Image

    def pil_one(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB").resize((size, size), Image.BICUBIC))

    start = time.perf_counter()
    for data in jpegs:
        pil_one(data)
    one = len(jpegs) / (time.perf_counter() - start)
    with ThreadPoolExecutor(threads) as pool:
        start = time.perf_counter()
        list(pool.map(pil_one, jpegs))
        many = len(jpegs) / (time.perf_counter() - start)

    raw = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in jpegs]

    def gpu_pass() -> None:
        for i in range(0, len(raw), batch):
            decoded = torchvision.io.decode_jpeg(raw[i : i + batch], device="cuda")
            resized = [
                torch.nn.functional.interpolate(img[None].float(), size=(size, size), mode="bicubic", antialias=True)
                for img in decoded
            ]
            torch.cat(resized).clamp_(0, 255)
        torch.cuda.synchronize()

    gpu_pass()  # warm-up (nvjpeg handles)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        gpu_pass()
        times.append(time.perf_counter() - start)
    return {
        "images": len(jpegs),
        "jpeg_kib_mean": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1),
        "pil_1_thread_img_s": round(one, 1),
        f"pil_{threads}_threads_img_s": round(many, 1),
        f"cuda_decode_batch{batch}_img_s": round(len(jpegs) / statistics.median(times), 1),
    }


class InMemoryImages:
    """A pair index of image bytes held in memory: the two things CHC's image stage
    (:func:`meta.chc.image_features.encode_rank`, one rank) asks of an index, its length and the images' bytes."""

    def __init__(self, blobs: list) -> None:
        self.blobs = blobs

    def __len__(self) -> int:
        return len(self.blobs)

    def read_image_bytes(self, indices, reasons: list | None = None, max_bytes: int = 0, threads: int = 1) -> list:
        if reasons is not None:
            reasons.extend([""] * len(indices))
        return [self.blobs[int(i)] for i in indices]


def read_rates(
    jpegs: list[bytes], threads: tuple[int, ...] = (1, 4), copies: int = 8, shard_size: int = 512, repeats: int = 3
) -> dict:
    """Images per second of reading CHC's image bytes from webdataset shards
    (:meth:`meta.chc.sources.PairIndex.read_image_bytes`, ``CHC.IMAGES.READ_THREADS``) at each count of ``threads``:
    ``jpegs`` written ``copies`` times into shards of ``shard_size`` pairs in a temporary folder, read once after the
    shards' pages were dropped from the page cache (``posix_fadvise DONTNEED``; a virtual disk may still be cached by
    its host, so this is the rate of storage at least that fast) and once from the page cache; the median of
    ``repeats`` rounds, the thread counts taking turns within a round."""
    import os
    import tarfile
    import tempfile

    from gram_tools.synthetic import add_member
    from meta.chc.sources import build_index

    blobs = [jpegs[i % len(jpegs)] for i in range(len(jpegs) * copies)]
    out: dict = {"images": len(blobs), "jpeg_kib_mean": round(sum(map(len, blobs)) / len(blobs) / 1024, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for k in range(0, len(blobs), shard_size):
            paths.append(f"{tmp}/shard-{k // shard_size:05d}.tar")
            with tarfile.open(paths[-1], "w") as tar:
                for i in range(k, min(k + shard_size, len(blobs))):
                    add_member(tar, f"{i:08d}.jpg", blobs[i])
                    add_member(tar, f"{i:08d}.txt", b"a photo")
        index = build_index(shards=paths, show_progress=False)
        rates: dict = {}
        for _ in range(repeats):
            for n in threads:
                for cache in ("evicted", "cached"):
                    if cache == "evicted":
                        for path in paths:
                            fd = os.open(path, os.O_RDONLY)
                            os.fsync(fd)  # written back first: the page cache keeps dirty pages whatever it is told
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                            os.close(fd)
                    start = time.perf_counter()
                    got = index.read_image_bytes(range(len(index)), threads=n)
                    seconds = time.perf_counter() - start
                    if got != blobs:
                        raise RuntimeError("read_rates: the bytes read are not the bytes written")
                    rates.setdefault(f"read_{cache}_threads{n}_img_s", []).append(len(blobs) / seconds)
    out.update({key: round(statistics.median(values), 1) for key, values in rates.items()})
    return out


def chc_rates(
    jpegs: list[bytes],
    batch: int,
    device: str = "cuda",
    model: str = "ViT-B-16",
    autocast: str = "bf16",
    decoder: str = "torchvision",
) -> dict:
    """Images per second of CHC's image stage on ``jpegs`` (bytes in memory) with ``CHC.IMAGES.DECODER``
    ``decoder``: the decoder alone (:func:`meta.chc.tensor_decode.decode_batch_tensor` or the Pillow reference, on
    chunks of ``batch`` images) and end to end: the stage's own :func:`meta.chc.image_features.encode_rank` (chunks of
    ``batch`` images, the next one read and decoded while this one is encoded, features written to disk) with
    ``model``'s image tower (random weights) under ``autocast``."""
    import tempfile
    import warnings

    from meta.chc.image_features import encode_rank
    from meta.chc.imaging import CLIP_MEAN, CLIP_STD, decode_batch
    from meta.chc.tensor_decode import decode_batch_tensor
    from meta.model.backbone import load_clip

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: the rate does not depend on them
        clip, dims = load_clip(model, pretrained=None, device=torch.device(device))
    size = dims.image_size
    index = InMemoryImages(jpegs)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def decode_only() -> float:
        start = time.perf_counter()
        for i in range(0, len(jpegs), batch):
            if decoder == "torchvision":
                decode_batch_tensor(jpegs[i : i + batch], size, device)
            else:
                decode_batch(jpegs[i : i + batch], size)
        sync()
        return time.perf_counter() - start

    def stage(folder: str) -> float:
        start = time.perf_counter()
        encode_rank(
            index, clip, 0, 1, Path(folder), "probe", size, CLIP_MEAN, CLIP_STD, batch_size=batch, chunk_size=batch,
            device=device, show_progress=False, autocast=autocast, decoder=decoder,
        )  # fmt: skip
        sync()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        stage(f"{tmp}/warm-up")  # nvJPEG handles, kernels
        decode = statistics.median(decode_only() for _ in range(3))
        both = statistics.median(stage(f"{tmp}/{k}") for k in range(3))
    return {
        "model": model,
        "autocast": autocast,
        "decoder": decoder,
        "image_size": size,
        f"chc_decoder_batch{batch}_img_s": round(len(jpegs) / decode, 1),
        f"chc_end_to_end_batch{batch}_img_s": round(len(jpegs) / both, 1),
    }


def _shares(rows: list[tuple[str, int, float]], total_ms: float) -> dict:
    """Shares of the kernels' time by kind, read off kernel names (cuBLAS/CUTLASS GEMMs, fused attention, casts)."""

    def share(keys: tuple[str, ...]) -> float:
        hit = sum(ms for name, _, ms in rows if any(key in name.lower() for key in keys))
        return round(hit / total_ms, 3) if total_ms else 0.0

    return {"matmul": share(MATMUL_KERNELS), "attention": share(ATTENTION_KERNELS), "casts": share(CAST_KERNELS)}


class ProductCensus(TorchDispatchMode):
    """Counts the matrix products dispatched while active, by their inputs' dtypes: ``{"bfloat16": n, ...}``.

    A product is one of :data:`PRODUCT_OPS` (after autocast has cast its inputs, so the dtype is the one the kernel
    computes in); mixed inputs count under ``"mixed"``.  ``casts`` counts the dtype conversions (``_to_copy`` to another
    dtype, ``copy_`` between dtypes), autocast's included.  Runs on any device: on a CPU under CPU autocast it shows
    which products a CUDA bf16 run leaves in fp32 (the FFMA GEMMs of the step profile)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in PRODUCT_OPS:
            dtypes = {str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor) and a.dim() > 1}
            self.counts[dtypes.pop() if len(dtypes) == 1 else "mixed"] += 1
        elif name == "_to_copy":
            self.casts += kwargs.get("dtype") not in (None, args[0].dtype)
        elif name == "copy_":
            self.casts += args[0].dtype != args[1].dtype
        return func(*args, **kwargs)

    def by_dtype(self) -> dict[str, int]:
        """``{dtype: matrix products}``, sorted by dtype."""
        return dict(sorted(self.counts.items()))


def census_of(step: Callable[[], object]) -> ProductCensus:
    """The :class:`ProductCensus` of one call of ``step``."""
    census = ProductCensus()
    with census:
        step()
    return census


def product_dtypes(step: Callable[[], object]) -> dict[str, int]:
    """``{dtype: matrix products}`` of one call of ``step`` (:class:`ProductCensus`)."""
    return census_of(step).by_dtype()


def step_learner(name: str, clip: torch.nn.Module, dims, meta_spec) -> tuple:
    """``(meta-learner, loss_fn, PromptedCLIP)`` of prompt learner ``name`` (:data:`gram_tools.bench_gpu.VARIANTS`;
    θ drawn with seed 1) under ``meta_spec`` on the CPU: the step :func:`profile_steps` times and
    :mod:`gram_tools.step_traffic` counts."""
    from gram_tools.bench_gpu import VARIANTS
    from meta.method.gram import GRAMMetaLearner
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

    spec = PromptSpec(**VARIANTS[name])
    theta = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    pclip = PromptedCLIP(clip, dims, theta.n_ctx_text, template=spec.template)
    return GRAMMetaLearner(theta, meta_spec), classification_loss(pclip), pclip


def profile_steps(
    learners: list[str],
    autocast: str,
    tf32: bool,
    steps: int,
    top: int,
    lowp_attention: bool = False,
    matmul_peak: float = 0.0,
    more_tasks: int = 0,
    device: str = "cuda",
    model: str = "ViT-B-16",
    size: dict | None = None,
    weights: str = "fp32",
    closed_form_norm: bool = False,
) -> dict:
    """Median step seconds and the profiler's top self-CUDA operators of the stacked second-order step.

    ``lowp_attention``: ``MetaSpec.support_attention_lowp`` (``META.SUPPORT_ATTENTION_LOWP``); ``matmul_peak``: the
    run's own matmul TFLOP/s (> 0 adds the step's FLOP count, achieved TFLOP/s and their fraction of it);
    ``more_tasks`` > 0: also the step of that many stacked tasks, its time over the default meta-batch's and (with
    ``matmul_peak``) its FLOPs and fraction of the matmul rate.
    ``device`` / ``model`` / ``size`` (task size keys of :func:`gram_tools.bench_gpu.task_size` to override): a CPU,
    a test CLIP and small tasks run the same code in CI (no kernel rows there).  ``weights``: the frozen CLIP's dtype
    (``MODEL.PRECISION``: ``fp32`` | ``bf16``).  ``closed_form_norm``: ``MetaSpec.closed_form_layer_norm``
    (``META.CLOSED_FORM_LAYER_NORM``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from gram_tools.bench_gpu import _median_time, _sig, _sync, step_tflop, task_size
    from meta.metatrain.outer import OuterStep
    from meta.method.gram import MetaSpec, TaskBatch
    from meta.model.backbone import load_clip

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dev = torch.device(device)
    size = {**task_size(), **(size or {})}
    torch.manual_seed(0)
    clip, dims = load_clip(model, pretrained=None, device=dev, precision=weights)
    k, b = size["way"], size["meta_batch"]
    names = [f"class {i}" for i in range(k)]
    gen = torch.Generator().manual_seed(0)
    out: dict = {}
    for name in learners:

        def part(shots: int) -> dict:
            images = torch.randn(k * shots, 3, dims.image_size, dims.image_size, generator=gen).to(dev)
            return {"classnames": names, "label": torch.arange(k).repeat(shots).to(dev), "images": images}

        tasks = [TaskBatch(part(size["support_shots"]), part(size["query_shots"])) for _ in range(b)]
        meta_spec = MetaSpec(
            autocast=autocast,
            task_batching="auto",
            support_attention_lowp=lowp_attention,
            closed_form_layer_norm=closed_form_norm,
        )
        ml, loss_fn, _ = step_learner(name, clip, dims, meta_spec)
        ml = ml.to(dev)

        def step(outer=OuterStep(ml), loss_fn=loss_fn, tasks=tasks) -> None:
            outer.meta_step(tasks, loss_fn)

        seconds = _median_time(step, dev, 2, 5)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            _sync(dev)
        events = prof.key_averages()
        # kernels (device-side events) carry the GPU time once; an aten op's own device time repeats its kernels'
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
        rows = [(e.key, int(e.count) // steps, e.self_device_time_total / 1e3 / steps) for e in kernels]
        rows.sort(key=lambda r: -r[2])
        total = sum(ms for _, _, ms in rows)
        ops = [
            (e.key, int(e.count) // steps, e.self_device_time_total / 1e3 / steps)
            for e in events
            if e.key.startswith("aten::") and e.self_device_time_total > 0
        ]
        ops.sort(key=lambda r: -r[2])
        out[name] = {
            "step_s": round(seconds, 4),
            "kernel_ms_per_step": round(total, 2),
            "gpu_busy_fraction": round(total / 1e3 / seconds, 3),
            "kernel_shares": _shares(rows, total),
            "top_kernels": [
                {"kernel": n[:160], "calls": c, "ms": round(ms, 3), "share": round(ms / total, 3)}
                for n, c, ms in rows[:top]
            ],
            "top_ops": [{"op": n, "calls": c, "self_cuda_ms": round(ms, 3)} for n, c, ms in ops[:top]],
        }
        census = census_of(step)
        out[name].update(products_by_dtype=census.by_dtype(), dtype_casts=census.casts)
        if matmul_peak > 0:
            tflop = step_tflop(step)
            out[name].update(
                tflop=_sig(tflop),
                tflops_achieved=_sig(tflop / seconds),
                matmul_fraction=_sig(tflop / seconds / matmul_peak),
            )
        if more_tasks > 0:
            many = [TaskBatch(part(size["support_shots"]), part(size["query_shots"])) for _ in range(more_tasks)]

            def step_many(outer=OuterStep(ml), loss_fn=loss_fn, tasks=many) -> None:
                outer.meta_step(tasks, loss_fn)

            more = _median_time(step_many, dev, 1, 3)
            out[name].update(
                {f"tasks_{more_tasks}_step_s": round(more, 4), f"tasks_{more_tasks}_over_{b}": round(more / seconds, 3)}
            )
            if matmul_peak > 0:  # its FLOPs (each stacked task's graph is its own: linear in the tasks) and its rate
                tflop_many = step_tflop(step_many)
                out[name].update(
                    {
                        f"tasks_{more_tasks}_tflop": _sig(tflop_many),
                        f"tasks_{more_tasks}_matmul_fraction": _sig(tflop_many / more / matmul_peak),
                    }
                )
            del many
        del ml
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.profile_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--learners", nargs="+", default=["vpt", "unigram"])
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per learner (>= 1)")
    parser.add_argument("--top", type=int, default=15, help="operators listed per learner (>= 1)")
    parser.add_argument("--tf32", action="store_true", help="also profile fp32 with and without TF32")
    parser.add_argument("--decode-images", type=int, default=512, help="JPEGs in the decode probe (0: skip)")
    parser.add_argument("--decode-batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=8, help="PIL decoding threads")
    parser.add_argument(
        "--more-tasks", type=int, default=16, help="also time a step of this many stacked tasks (0: skip)"
    )
    parser.add_argument(
        "--bf16-weights",
        action="store_true",
        help="also profile the frozen CLIP in bf16 (MODEL.PRECISION bf16) with META.SUPPORT_ATTENTION_LOWP",
    )
    parser.add_argument("--out", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    problem = int_flag_problem(
        args, {"steps": 1, "top": 1, "decode_images": 0, "decode_batch": 1, "threads": 1, "more_tasks": 0}
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: gram_tools.profile_gpu: CUDA is not available on this machine", file=sys.stderr)
        return 2
    result: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def save(part: str) -> None:
        """The result so far to ``--out`` after each part (a call stopped by its time cap keeps what finished)."""
        result["finished"] = [*result.get("finished", []), part]
        if args.out:
            with open(args.out, "w") as handle:
                handle.write(json.dumps(result) + "\n")

    if args.decode_images > 0:
        jpegs = synthetic_jpegs(args.decode_images)
        result["decode"] = decode_rates(jpegs, args.threads, args.decode_batch)
        result["decode"].update(chc_rates(jpegs, args.decode_batch))
        result["decode"].update(read_rates(jpegs))  # the bytes CHC's decoder starts from, read from shards
        print(json.dumps({"decode": result["decode"]}), flush=True)
        save("decode")
    from gram_tools.bench_gpu import _sig, matmul_tflops

    peak = matmul_tflops(torch.device("cuda"), torch.bfloat16, 8192)  # the shares' reference, this run's own
    result["matmul_tflops_bf16"] = _sig(peak)
    result["bf16"] = profile_steps(args.learners, "bf16", False, args.steps, args.top, False, peak, args.more_tasks)
    save("bf16")
    # the support pass's attention products in bf16 instead of the MATH kernel's fp32 (META.SUPPORT_ATTENTION_LOWP)
    result["bf16_support_attention_lowp"] = profile_steps(
        args.learners, "bf16", False, args.steps, args.top, True, peak, args.more_tasks
    )
    save("bf16_support_attention_lowp")
    # and the support pass's LayerNorms with the closed-form double backward (META.CLOSED_FORM_LAYER_NORM): by
    # gram_tools.step_traffic's count ~45 GB less memory traffic per step; no 16-task step (time on the device)
    result["bf16_support_attention_lowp_closed_form_layer_norm"] = profile_steps(
        args.learners, "bf16", False, args.steps, args.top, True, peak, 0, closed_form_norm=True
    )
    save("bf16_support_attention_lowp_closed_form_layer_norm")
    if args.bf16_weights:  # the frozen CLIP in bf16 (by step_traffic's count the stream stays fp32 after ln_pre)
        result["bf16_weights_support_attention_lowp"] = profile_steps(
            args.learners, "bf16", False, args.steps, args.top, True, peak, args.more_tasks, weights="bf16"
        )
        save("bf16_weights_support_attention_lowp")
    if args.tf32:
        result["fp32"] = profile_steps(args.learners, "none", False, args.steps, 5)
        result["fp32_tf32"] = profile_steps(args.learners, "none", True, args.steps, 5)
        save("tf32")
    text = json.dumps(result)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
