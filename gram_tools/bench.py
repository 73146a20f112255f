"""Benchmark of one GRAM meta-step against a plain CoOp step: ``python -m gram_tools.bench``.

Prints human-readable lines, then ONE JSON line (the last line) with:

* ``second_order_s`` / ``first_order_s``: wall time of one meta-task (clone θ, regulated inner step on
  the support, query loss at θ', backward to θ and φ), second / first order;
* ``plain_step_s``: one CoOp step (forward + backward of the same support + query images, same prompts);
* ``ratio_second_to_plain``; ``ratio_floor`` = 3.0, the lower bound of an exact second-order step with
  frozen weights (6 linear-product sweeps against the plain step's 2), ``ratio_guard`` = 3.3 (10 % above
  it) and ``ratio_guard_pass``: the regression guard, meaningful on an idle machine;
* ``truncation_speedup``: second-order meta-task time with 77 text positions / with ``max(eot)+1``;
* ``frozen_bytes_cloned_per_task``: bytes copied by ``GBML.clone()`` beyond θ and φ (target 0);
* ``peak_rss_mb``: peak resident memory of the process;
* ``linear_forward_s`` / ``linear_backward_s``: the frozen text tower's linear-layer matrix products
  alone (no attention, no elementwise ops, no autograd), as one forward sweep (activations times Wᵀ)
  and one backward sweep (gradients times W) at the step's shapes; ``null`` for block types
  :mod:`meta.model.blocks` does not run itself;
* ``plain_other_s`` / ``second_order_other_s``: each step minus its linear products (the plain step
  has one forward and one backward sweep, the exact second-order task three of each), i.e. the time of
  everything else.  ``ratio_second_to_plain`` <= 3 exactly when ``second_order_other_s`` <=
  3 x ``plain_other_s`` (docs/benchmark.md);
* ``settings``: everything the numbers depend on.

``--device cuda`` runs the accelerator benchmark instead (:mod:`gram_tools.bench_gpu`: whole meta-steps of
CoOp, VPT and UNIGRAM at the meta-training task size, peak GPU memory, CHC images per second, and
their cost in GPU-hours); without CUDA it stops with a one-line error.

Defaults (CPU): ViT-B-16 architecture with random weights (no download), CoOp text prompts (M = 4),
K = 8-way, 1-shot support, 4-shot query, cached image features, one CPU thread.  Times are the
median of ``--repeats`` rounds after ``--warmup`` rounds; a round times the four steps and the two
linear-product sweeps one after another, so drifting machine speed hits all of them alike.
Run as ``python -m gram_tools.bench`` it pins the CPU kernels as meta-training does (:mod:`meta.infra.numerics`; about
2x slower at this size on an AVX2 CPU, ``docs/numerics.md``); ``GRAM_NUMERICS=fast`` times the machine's own
kernels, as the tables in ``docs/benchmark.md`` dated before 2026-11-27 night were.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

import torch

from meta.infra.cli_errors import int_flag_problem
from meta.infra.numerics import mode as numerics_mode

RATIO_FLOOR = 3.0  # exact second order, frozen weights: 3 forward + 3 backward linear sweeps vs 1 + 1
RATIO_GUARD = 3.3  # within 10 % of the floor (docs/benchmark.md)


def _interleaved_medians(fns: dict[str, Callable[[], None]], warmup: int, repeats: int) -> dict[str, float]:
    """Median wall time (s) of each function, timed round-robin.

    On a shared VM the speed drifts by tens of percent within a minute (measured: the same
    plain step at 0.14 and 0.21 s in two runs); timing the functions in alternation exposes
    each to the same drift, so their ratios are stable even when absolute times are not.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def linear_products(
    transformer: torch.nn.Module, n_seq: int, length: int
) -> Optional[tuple[Callable[[], None], Callable[[], None]]]:
    """One forward and one backward sweep of ``transformer``'s linear-layer products, nothing else.

    Mirrors :func:`meta.model.blocks.transformer_forward` with ``last_rows``: every block multiplies
    ``[n_seq * length, ·]`` activations by its fused q/k/v input projection, attention output
    projection, MLP ``c_fc`` and ``c_proj``; the last block projects keys and values for all rows and
    everything else for the ``n_seq`` pooled rows only.  With frozen weights a forward pass multiplies by
    Wᵀ and a backward pass (input gradients only) by W, once per layer.  Returns ``(forward, backward)``
    callables, or ``None`` when a block is not one :func:`meta.model.blocks.is_plain_block` accepts.
    """
    from meta.model.blocks import is_plain_block

    blocks = list(transformer.resblocks)
    if not all(is_plain_block(b) for b in blocks):
        return None
    rows = n_seq * length
    products: list[tuple[int, torch.Tensor]] = []  # (rows, weight [out, in]) in forward order
    for i, block in enumerate(blocks):
        w_in = block.attn.in_proj_weight.detach()
        width = w_in.shape[1]
        pooled = n_seq if i == len(blocks) - 1 else rows
        if pooled == rows:
            products.append((rows, w_in))
        else:
            products += [(rows, w_in[width:]), (pooled, w_in[:width])]
        products += [
            (pooled, block.attn.out_proj.weight.detach()),
            (pooled, block.mlp.c_fc.weight.detach()),
            (pooled, block.mlp.c_proj.weight.detach()),
        ]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(r, w.shape[1], generator=gen, dtype=w.dtype).to(w.device) for r, w in products]
    grads = [torch.randn(r, w.shape[0], generator=gen, dtype=w.dtype).to(w.device) for r, w in products]

    def forward() -> None:
        for x, (_, w) in zip(inputs, products):
            torch.mm(x, w.t())

    def backward() -> None:
        for g, (_, w) in zip(reversed(grads), reversed(products)):
            torch.mm(g, w)

    return forward, backward


def _class_names(k: int) -> list[str]:
    pool = [
        "golden retriever",
        "fire truck",
        "sunflower",
        "grand piano",
        "tabby cat",
        "sports car",
        "oak tree",
        "coffee mug",
        "mountain bike",
        "lighthouse",
        "jellyfish",
        "hot air balloon",
    ]
    return [pool[i % len(pool)] + ("" if i < len(pool) else f" {i}") for i in range(k)]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    from meta.infra.profiling import bytes_copied
    from meta.method.gram import GRAMMetaLearner, MetaSpec, TaskBatch
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss
    from meta.model.backbone import load_clip
    from meta.model.text_encoder import ClassTokenCache

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(args.model, pretrained=args.pretrained)
    names = _class_names(args.way)
    gen = torch.Generator().manual_seed(0)

    def features(shots: int) -> dict:
        feats = torch.nn.functional.normalize(torch.randn(args.way * shots, dims.embed_dim, generator=gen), dim=-1)
        return {"classnames": names, "features": feats, "label": torch.arange(args.way).repeat(shots)}

    support, query = features(args.support_shots), features(args.query_shots)
    spec = PromptSpec(n_ctx_text=args.n_ctx)

    def meta_task(first_order: bool, truncate: bool) -> Callable[[], None]:
        prompts = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
        ml = GRAMMetaLearner(prompts, MetaSpec(first_order=first_order))
        loss_fn = classification_loss(PromptedCLIP(clip, dims, args.n_ctx, truncate=truncate))
        return lambda: ml.accumulate([TaskBatch(support, query)], loss_fn)

    prompts = PromptParams.from_spec(spec, clip, dims, generator=torch.Generator().manual_seed(1))
    loss_fn = classification_loss(PromptedCLIP(clip, dims, args.n_ctx, truncate=True))
    both = {
        "classnames": names,
        "features": torch.cat([support["features"], query["features"]]),
        "label": torch.cat([support["label"], query["label"]]),
    }
    optim = torch.optim.SGD(prompts.parameters(), lr=0.002)

    def plain_step() -> None:
        optim.zero_grad()
        loss_fn(prompts, both)[0].backward()
        optim.step()

    steps = {
        "second": meta_task(first_order=False, truncate=True),
        "plain": plain_step,
        "first": meta_task(first_order=True, truncate=True),
        "full": meta_task(first_order=False, truncate=False),
    }
    sweeps = linear_products(clip.transformer, args.way, ClassTokenCache(clip, args.n_ctx).tokens(names).length)
    if sweeps is not None:
        steps["linear_forward"], steps["linear_backward"] = sweeps
    times = _interleaved_medians(steps, args.warmup, args.repeats)
    second, first, full, plain = times["second"], times["first"], times["full"], times["plain"]
    print(f"second-order meta-task: {second:.4f} s", flush=True)
    print(f"first-order meta-task:  {first:.4f} s", flush=True)
    print(f"second-order, 77 text positions: {full:.4f} s", flush=True)
    print(f"plain CoOp step:        {plain:.4f} s", flush=True)
    verdict = "within" if second / plain <= RATIO_GUARD else "ABOVE"
    print(
        f"second-order / plain: {second / plain:.3f} ({verdict} the guard {RATIO_GUARD}; floor {RATIO_FLOOR})",
        flush=True,
    )
    linear = None
    if sweeps is not None:
        linear = times["linear_forward"] + times["linear_backward"]
        print(
            f"linear products, one forward + one backward sweep: {linear:.4f} s; everything else: "
            f"plain {plain - linear:.4f} s, second order {second - 3 * linear:.4f} s",
            flush=True,
        )

    ml = GRAMMetaLearner(PromptParams.from_spec(spec, clip, dims), MetaSpec())
    own = sum(p.numel() * p.element_size() for p in ml.gbml.parameters())
    _, copied = bytes_copied(lambda: ml.gbml.clone())
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "second_order_s": round(second, 5),
        "first_order_s": round(first, 5),
        "plain_step_s": round(plain, 5),
        "ratio_second_to_plain": round(second / plain, 3),
        "ratio_floor": RATIO_FLOOR,
        "ratio_guard": RATIO_GUARD,
        "ratio_guard_pass": bool(second / plain <= RATIO_GUARD),
        "truncation_speedup": round(full / second, 3),
        "frozen_bytes_cloned_per_task": int(copied - own),
        "theta_phi_bytes_cloned_per_task": int(own),
        "peak_rss_mb": round(peak_kb / 1024, 1),
        "linear_forward_s": None if linear is None else round(times["linear_forward"], 5),
        "linear_backward_s": None if linear is None else round(times["linear_backward"], 5),
        "plain_other_s": None if linear is None else round(plain - linear, 5),
        "second_order_other_s": None if linear is None else round(second - 3 * linear, 5),
        "settings": {
            "model": args.model,
            "pretrained": args.pretrained,
            "way": args.way,
            "support_shots": args.support_shots,
            "query_shots": args.query_shots,
            "n_ctx": args.n_ctx,
            "inner_steps": 1,
            "image_side": "cached features",
            "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "warmup": args.warmup,
            "repeats": args.repeats,
            "timing": "round-robin medians",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "numerics": numerics_mode(),  # pinned CPU kernels or the machine's own (meta.infra.numerics)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B-16", help="open_clip architecture")
    parser.add_argument("--pretrained", default=None, help="local weights file (default: random weights)")
    parser.add_argument("--way", type=int, default=8)
    parser.add_argument("--support-shots", type=int, default=1)
    parser.add_argument("--query-shots", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads), >= 1")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--device", default="cpu", help="cpu (default: this benchmark) | cuda[:i] (gram_tools.bench_gpu)"
    )
    parser.add_argument(
        "--autocast",
        default="none",
        choices=("none", "bf16", "fp16"),
        help="--device cuda only: autocast of the forward passes",
    )
    parser.add_argument(
        "--scaling-tasks",
        default="1,4,16",
        help="--device cuda only: tasks per outer step of the sequential vs batched table ('' = skip)",
    )
    parser.add_argument(
        "--chc-batches",
        default="64,128,256,512",
        help="--device cuda only: CHC image batch sizes to measure ('' = skip)",
    )
    args = parser.parse_args(argv)
    minimums = {"threads": 1, "way": 1, "support_shots": 1, "query_shots": 1, "n_ctx": 1, "warmup": 0, "repeats": 1}
    problem = int_flag_problem(args, minimums)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.device != "cpu":
        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            print(
                f"error: --device {args.device}: "
                + (
                    "CUDA is not available on this machine"
                    if args.device.startswith("cuda")
                    else "expected cpu or cuda[:index]"
                ),
                file=sys.stderr,
            )
            return 2
        from . import bench_gpu

        def ints(text: str, key: str) -> tuple[int, ...]:
            try:
                return tuple(int(v) for v in text.split(",") if v.strip())
            except ValueError:
                raise SystemExit(f"error: {key}: expected comma-separated integers, got {text!r}") from None

        result = bench_gpu.run(
            args.model,
            args.device,
            args.autocast,
            warmup=args.warmup,
            repeats=args.repeats,
            pretrained=args.pretrained,
            scaling_tasks=ints(args.scaling_tasks, "--scaling-tasks"),
            chc_batches=ints(args.chc_batches, "--chc-batches"),
        )
        for name, row in result["variants"].items():
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        print(
            f"CHC image features: {result['chc_images_per_s']} images/s; by batch size: {result['chc_batch_sweep']}",
            flush=True,
        )
        print(
            f"bf16 matmul: {result['matmul_tflops']} TFLOP/s; tasks per step, sequential vs batched: "
            f"{result['task_scaling']}",
            flush=True,
        )
        print(json.dumps(result, sort_keys=True))
        return 0
    result = run(args)
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # the kernels meta-training runs with (GRAM_NUMERICS=fast: the machine's own)
    sys.exit(main())
