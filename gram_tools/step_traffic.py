"""Bytes and FLOPs of one meta-step, operator by operator, without a GPU: ``python -m gram_tools.step_traffic``.

The step is the one :func:`gram_tools.profile_gpu.profile_steps` times on a GPU: the task-batched second-order outer
step (learner, ``META.AUTOCAST``, ``MODEL.PRECISION``, ``META.SUPPORT_ATTENTION_LOWP``,
``META.CLOSED_FORM_LAYER_NORM``, the meta-training config's task size).  Here it runs on fake tensors
(``torch._subclasses.FakeTensorMode``: shapes, dtypes and strides, no data, no memory), so ViT-B/16 with 4 or 16
stacked tasks takes about a second on any CPU.  :class:`TrafficCensus` records
every operator the step dispatches (autograd's backward and double backward included) with

* the bytes it reads and writes: its tensor arguments (distinct elements: a broadcast view counts once) and its
  results; views, metadata queries and uninitialised allocations move nothing;
* its FLOPs where it is a matrix product or fused attention (torch's ``flop_counter`` formulas, as ``FlopCounterMode``
  counts them), with the dtype the product computes in;
* the autograd node that ran it (``forward`` outside the backward; ``NativeLayerNormBackwardBackward`` is the double
  backward of a LayerNorm, the second-order term).

:func:`roofline` turns a census into a floor on a card: operators run one after another on one stream, each at
least ``max(FLOPs / product rate of its dtype, bytes / memory bandwidth)``.  The step's FLOPs over that floor is the
highest share of the matmul rate the step's operator graph allows at that bandwidth.  The default card is the H200
of the project's GPU runs: 4.8 TB/s HBM3e and 67 TFLOP/s fp32 (NVIDIA's H200 datasheet,
https://www.nvidia.com/en-us/data-center/h200/), 769 TFLOP/s for a bf16 product (the square bf16 matmul measured on
that H200, docs/benchmark.md).

What it models, and what not: the dtypes are those of PyTorch's CPU autocast, whose policy differs from CUDA's for
a few operators (softmax outside attention, some losses: small tensors at this task size); the fused attention
kernel is the CPU one (the same tensors in and out as CUDA's); no caches, no launch latency, no overlap.  Against the
2026-11-27 H200 profile of the same step the operator counts agree (``mm`` 206, ``addmm`` 100, ``sum`` 301 both) and
the elementwise operators ran at 2.2-3.1 TB/s of the modelled bytes (``--compare``; docs/benchmark.md).

Any learner of :data:`gram_tools.bench_gpu.VARIANTS` runs (``--learners``, default VPT and UNIGRAM, the ones the GPU
targets name); CoOp's step here encodes its images with the frozen tower, where the bench caches image features.

Prints one JSON object as the last line (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gram_tools.bench_gpu import _sig
from meta.infra.cli_errors import int_flag_problem

# operators that allocate without writing, or only answer questions about a tensor: no bytes moved
NO_TRAFFIC_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "sym_size", "sym_stride",
     "sym_numel", "sym_storage_offset", "is_same_size", "device", "_local_scalar_dense", "resize_",
     "_unsafe_view"}
)  # fmt: skip
FORWARD = "forward"  # the node label of operators run outside autograd's backward


@dataclass(frozen=True)
class Card:
    """The two rates of a roofline: memory bandwidth (TB/s) and matrix-product rates (TFLOP/s) by dtype."""

    name: str
    bandwidth_tb_s: float
    matmul_tflops: float  # bf16 / fp16 products
    fp32_tflops: float  # fp32 products without TF32

    def product_rate(self, dtype: str) -> float:
        """TFLOP/s of a product computing in ``dtype`` (``"bfloat16"``, ``"float16"``, else the fp32 rate)."""
        return self.matmul_tflops if dtype in ("bfloat16", "float16") else self.fp32_tflops


# NVIDIA H200 datasheet (bandwidth, fp32); bf16: the square matmul of the 2026-11-27 H200 run (docs/benchmark.md)
H200 = Card("NVIDIA H200 (HBM3e 4.8 TB/s; bf16 matmul 769 TFLOP/s as measured)", 4.8, 769.0, 67.0)


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor view covers: a dimension of stride 0 (broadcast) counts once."""
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _cpu_attention_flops() -> dict:
    """Flop formulas for the CPU fused attention operators (torch registers the CUDA ones only)."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten

    def forward(query, key, value, *args, **kwargs) -> int:
        return fc.sdpa_flop_count(query.shape, key.shape, value.shape)

    def backward(grad_out, query, key, value, *args, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)

    return {
        aten._scaled_dot_product_flash_attention_for_cpu: forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }


class OpRecord(NamedTuple):
    """One dispatched operator of a step."""

    op: str  # aten overload packet, e.g. "mul"
    node: str  # the autograd node that ran it (:data:`FORWARD` outside the backward)
    bytes: int  # read and written
    flops: int  # of a matrix product or fused attention, else 0
    dtype: str  # the dtype a product computes in ("" for other operators)


@dataclass
class OpTotals:
    """What one kind of operator (or one autograd node) added up to over a step."""

    calls: int = 0
    bytes: int = 0
    flops: int = 0


class TrafficCensus(TorchDispatchMode):
    """Records each dispatched operator as an :class:`OpRecord` in ``records``.

    Use inside a ``FakeTensorMode`` (enter that first): a data-dependent read (``.item()``, ``bool(t)``,
    ``.tolist()``) then gets 1 of the tensor's type, so a step's host-side checks pass and its metric transfers run;
    on real tensors the census passes every operator through unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        from torch.utils.flop_counter import flop_registry

        self._flops = {**flop_registry, **_cpu_attention_flops()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and _is_fake(args[0]):
            dtype = args[0].dtype
            return True if dtype == torch.bool else (1 if not dtype.is_floating_point else 1.0)
        out = func(*args, **kwargs)
        if func.is_view or name in NO_TRAFFIC_OPS:
            return out
        moved = sum(_distinct_bytes(t) for t in _tensors((args, kwargs))) + sum(
            t.numel() * t.element_size() for t in _tensors(out)
        )
        flops, dtype = 0, ""
        formula = self._flops.get(func.overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            dtype = str(_tensors(args)[0].dtype).replace("torch.", "")
        node = torch._C._current_autograd_node()
        label = FORWARD if node is None else type(node).__name__.rstrip("0123456789")
        self.records.append(OpRecord(name, label, moved, flops, dtype))
        return out

    def totals(self, key: str = "op") -> dict[str, OpTotals]:
        """Per operator (``key="op"``) or per autograd node (``"node"``), largest byte count first."""
        out: dict[str, OpTotals] = defaultdict(OpTotals)
        for row in self.records:
            t = out[row.op if key == "op" else row.node]
            t.calls += 1
            t.bytes += row.bytes
            t.flops += row.flops
        return dict(sorted(out.items(), key=lambda kv: -kv[1].bytes))


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def roofline(census: TrafficCensus, card: Card = H200) -> dict:
    """The step's floor on ``card``: totals, the floor in seconds, and its split into bandwidth- and product-bound
    operators.  ``matmul_fraction_ceiling`` = FLOPs / floor / the card's bf16 rate: no run of this operator graph on
    that card reaches a larger share of its matmul rate."""
    bw = card.bandwidth_tb_s * 1e12
    memory_s = compute_s = 0.0
    for row in census.records:
        t_mem = row.bytes / bw
        t_flop = row.flops / (card.product_rate(row.dtype) * 1e12)
        if t_flop > t_mem:
            compute_s += t_flop
        else:
            memory_s += t_mem
    floor = memory_s + compute_s
    total_bytes = sum(r.bytes for r in census.records)
    total_flops = sum(r.flops for r in census.records)
    return {
        "card": card.name,
        "operators": len(census.records),
        "gbytes": _sig(total_bytes / 1e9),
        "tflop": _sig(total_flops / 1e12),
        "floor_s": _sig(floor),
        "bandwidth_bound_s": _sig(memory_s),
        "product_bound_s": _sig(compute_s),
        "matmul_fraction_ceiling": _sig(total_flops / floor / (card.matmul_tflops * 1e12)) if floor else 0.0,
    }


def _table(totals: dict[str, OpTotals], card: Card, top: int) -> list[dict]:
    bw = card.bandwidth_tb_s * 1e12
    return [
        {"name": k, "calls": t.calls, "gbytes": _sig(t.bytes / 1e9), "tflop": _sig(t.flops / 1e12),
         "ms_at_bandwidth": _sig(t.bytes / bw * 1e3)}
        for k, t in list(totals.items())[:top]
    ]  # fmt: skip


@lru_cache(maxsize=2)
def _frozen_clip(model: str, weights: str) -> tuple:
    """The frozen CLIP (random weights, seed 0) of :func:`step_census`, built once per model and dtype: the step
    never changes it, and on fake tensors its weights are read, never written."""
    from meta.model.backbone import load_clip

    torch.manual_seed(0)
    return load_clip(model, pretrained=None, precision=weights)


def step_census(
    learner: str = "vpt",
    autocast: str = "bf16",
    weights: str = "fp32",
    lowp_attention: bool = False,
    closed_form_norm: bool = False,
    tasks: Optional[int] = None,
    model: str = "ViT-B-16",
    size: Optional[dict] = None,
    first_order: bool = False,
    fake: bool = True,
    beside: Sequence[TorchDispatchMode] = (),
) -> TrafficCensus:
    """The :class:`TrafficCensus` of one whole outer step (``OuterStep.meta_step``: stacked inner loop, query
    losses, backward to θ and φ, clipped Adam update) on fake tensors, as :func:`gram_tools.profile_gpu.profile_steps`
    builds it (``learner`` one of :data:`gram_tools.bench_gpu.VARIANTS`; ``tasks``: the meta-batch, default the
    config's; ``size``: task-size keys of :func:`gram_tools.bench_gpu.task_size` to override).  The frozen CLIP is
    built with real weights (random, ``pretrained=None``) on the CPU; everything the step computes is fake
    (``fake=False``: the same step on real random images, for checks on a small CLIP).  ``beside``: other dispatch
    modes active during the step only (e.g. a ``FlopCounterMode`` to check the census against)."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from gram_tools.bench_gpu import task_size
    from gram_tools.profile_gpu import step_learner
    from meta.metatrain.outer import OuterStep
    from meta.method.gram import MetaSpec, TaskBatch

    size = {**task_size(), **(size or {})}
    n_tasks = tasks or size["meta_batch"]
    clip, dims = _frozen_clip(model, weights)
    meta_spec = MetaSpec(
        autocast=autocast,
        task_batching="on",
        support_attention_lowp=lowp_attention,
        closed_form_layer_norm=closed_form_norm,
        first_order=first_order,
    )
    ml, loss_fn, pclip = step_learner(learner, clip, dims, meta_spec)
    names = [f"class {i}" for i in range(size["way"])]
    # class names are tokenised (data-dependent: EOT positions) and fixed-template text features cached on
    # real tensors before the step, as the first real step would
    if pclip.n_ctx_text == 0:
        pclip.text_features(None, names)
    else:
        pclip.tokens.tokens(names)
    outer = OuterStep(ml)
    census = TrafficCensus()
    gen = torch.Generator().manual_seed(0)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():

        def part(shots: int) -> dict:
            k = size["way"]
            images = torch.randn(k * shots, 3, dims.image_size, dims.image_size, generator=None if fake else gen)
            return {"classnames": names, "label": torch.arange(k).repeat(shots), "images": images}

        batch = [TaskBatch(part(size["support_shots"]), part(size["query_shots"])) for _ in range(n_tasks)]
        with contextlib.ExitStack() as modes:
            for mode in beside:
                modes.enter_context(mode)
            modes.enter_context(census)
            outer.meta_step(batch, loss_fn)
    return census


def compare_with_profile(census: TrafficCensus, profile_row: dict) -> list[dict]:
    """The census beside a GPU profile of the same step (a learner's row of ``gram_tools.profile_gpu``'s JSON: its
    ``top_ops``, or ``top`` in the first version): per aten operator listed there, calls in both, the measured
    self-CUDA ms, the modelled bytes and the bandwidth they imply (GB / ms = TB/s).  ``copy_`` on a device is what
    ``_to_copy`` and ``clone`` dispatch to; it is compared with their sum."""
    rows = profile_row.get("top_ops") or profile_row.get("top") or []
    ops = census.totals("op")
    out = []
    for row in rows:
        name = str(row.get("op", ""))
        if not name.startswith("aten::"):
            continue
        op = name.split("::", 1)[1]
        parts = ("_to_copy", "clone", "copy_") if op == "copy_" else (op,)
        calls = sum(ops[p].calls for p in parts if p in ops)
        moved = sum(ops[p].bytes for p in parts if p in ops)
        ms = float(row.get("self_cuda_ms", 0.0))
        out.append(
            {"op": op, "calls_measured": int(row.get("calls", 0)), "calls_modelled": calls, "ms_measured": ms,
             "gbytes_modelled": _sig(moved / 1e9), "tb_s_implied": _sig(moved / 1e9 / ms) if ms else 0.0}
        )  # fmt: skip
    return out


def describe(census: TrafficCensus, card: Card = H200, top: int = 12) -> dict:
    """The roofline plus the top operators and autograd nodes by bytes."""
    return {
        **roofline(census, card),
        "top_ops": _table(census.totals("op"), card, top),
        "top_nodes": _table(census.totals("node"), card, top),
    }


VARIANT_FLAGS: dict[str, dict] = {
    "bf16": {"autocast": "bf16"},
    "bf16_support_attention_lowp": {"autocast": "bf16", "lowp_attention": True},
    "bf16_support_attention_lowp_closed_form_layer_norm": {
        "autocast": "bf16",
        "lowp_attention": True,
        "closed_form_norm": True,
    },
    "bf16_weights_lowp": {"autocast": "bf16", "weights": "bf16", "lowp_attention": True},
    "fp32": {"autocast": "none"},
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gram_tools.step_traffic", description=__doc__.splitlines()[0])
    parser.add_argument("--learners", nargs="+", default=["vpt", "unigram"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_FLAGS), choices=list(VARIANT_FLAGS))
    parser.add_argument("--more-tasks", type=int, default=16, help="also the step of this many stacked tasks (0: no)")
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--top", type=int, default=12, help="operators and nodes listed per step (>= 1)")
    parser.add_argument("--bandwidth-tb-s", type=float, default=H200.bandwidth_tb_s)
    parser.add_argument("--matmul-tflops", type=float, default=H200.matmul_tflops, help="bf16/fp16 product rate")
    parser.add_argument("--fp32-tflops", type=float, default=H200.fp32_tflops)
    parser.add_argument("--compare", type=Path, help="a gram_tools.profile_gpu JSON of the same step (bf16 part)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    problem = int_flag_problem(args, {"top": 1, "more_tasks": 0})
    from gram_tools.bench_gpu import VARIANTS

    unknown = [name for name in args.learners if name not in VARIANTS]
    if not problem and unknown:
        problem = f"--learners: expected some of {', '.join(VARIANTS)}, got {unknown[0]!r}"
    rates = {
        "bandwidth_tb_s": args.bandwidth_tb_s,
        "matmul_tflops": args.matmul_tflops,
        "fp32_tflops": args.fp32_tflops,
    }
    bad = [k for k, v in rates.items() if not (math.isfinite(v) and v > 0)]
    if not problem and bad:
        problem = f"--{bad[0].replace('_', '-')}: expected a number > 0, got {rates[bad[0]]}"
    profile = None
    if not problem and args.compare is not None:
        try:
            profile = json.loads(args.compare.read_text())["bf16"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            problem = f"--compare {args.compare}: expected a gram_tools.profile_gpu JSON with a 'bf16' part ({err})"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    card = replace(H200, **rates)
    card = card if card == H200 else replace(card, name="custom rates")
    result: dict = {"model": args.model, "card": asdict(card), "steps": {}}
    for learner in args.learners:
        for variant in args.variants:
            flags = VARIANT_FLAGS[variant]
            census = step_census(learner, model=args.model, **flags)
            row = describe(census, card, args.top)
            if profile is not None and variant == "bf16" and learner in profile:
                row["compare_with_profile"] = compare_with_profile(census, profile[learner])
            if args.more_tasks:
                many = roofline(step_census(learner, model=args.model, tasks=args.more_tasks, **flags), card)
                row[f"tasks_{args.more_tasks}"] = many
                row[f"tasks_{args.more_tasks}_floor_over_default"] = _sig(many["floor_s"] / row["floor_s"])
            result["steps"][f"{learner}/{variant}"] = row
            print(
                f"{learner:8s} {variant:28s} {row['gbytes']:8.1f} GB {row['tflop']:7.2f} TFLOP "
                f"floor {row['floor_s'] * 1e3:7.1f} ms  ceiling {row['matmul_fraction_ceiling']:.1%} of matmul",
                flush=True,
            )
    text = json.dumps(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
