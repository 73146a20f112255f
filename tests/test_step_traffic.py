"""gram_tools.step_traffic: bytes and FLOPs of a meta-step on fake tensors, and the roofline built from them.

The numbers are checked against independent counts: a product's bytes and FLOPs from its shapes, the step's FLOPs
against ``FlopCounterMode`` on the same step run on real tensors, the roofline against a hand-summed census."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from gram_tools import step_traffic
from gram_tools.step_traffic import Card, OpRecord, TrafficCensus, roofline, step_census

TINY = "GRAM-Test-Tiny"
SMALL = {"way": 3, "support_shots": 1, "query_shots": 2}
CPU_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def test_a_broadcast_view_counts_its_distinct_elements_once():
    row = torch.zeros(1, 8)
    assert step_traffic._distinct_bytes(row.expand(4, 8)) == 8 * 4
    assert step_traffic._distinct_bytes(torch.zeros(4, 8)) == 32 * 4
    assert step_traffic._distinct_bytes(torch.zeros(4, 8).t()) == 32 * 4  # a transpose is still every element


def test_a_linear_layer_moves_its_operands_and_result_and_does_its_products():
    """``F.linear`` on fake [R, N] x [M, N] + [M]: one addmm reading x, W, b and writing [R, M]; 2 R N M FLOPs."""
    r, n, m = 6, 5, 3
    census = TrafficCensus()
    with FakeTensorMode(), census:
        F.linear(torch.empty(r, n), torch.empty(m, n), torch.empty(m))
    assert [(op, node) for op, node, *_ in census.records] == [("addmm", "forward")]  # w.t() is a view: no bytes
    _, _, moved, flops, dtype = census.records[0]
    assert moved == 4 * (r * n + m * n + m + r * m)
    assert flops == 2 * r * n * m and dtype == "float32"


def test_data_dependent_reads_of_fake_tensors_answer_one():
    census = TrafficCensus()
    with FakeTensorMode(), census:
        t = torch.empty(3)
        assert t.sum().item() == 1.0 and bool(torch.isfinite(t).all()) is True
        assert torch.empty(2, dtype=torch.long).tolist() == [1, 1]


def test_the_fake_step_does_the_products_of_the_real_step(tiny_clip):
    """FLOPs of the census on fake tensors = FlopCounterMode's on the same step run on real tensors (the CPU's fused
    attention, which torch's counter does not know, left out of the census's sum)."""
    from torch.utils.flop_counter import FlopCounterMode

    for learner in ("vpt", "unigram"):
        fake = step_census(learner, autocast="none", model=TINY, size=SMALL, tasks=2)
        counter = FlopCounterMode(display=False)
        real = step_census(learner, autocast="none", model=TINY, size=SMALL, tasks=2, fake=False, beside=[counter])
        without_attention = sum(f for op, _, _, f, _ in fake.records if op not in CPU_ATTENTION)
        assert without_attention == counter.get_total_flops() > 0
        # the same operators, nodes and bytes up to the outer update (after the last backward operator), whose
        # optimiser runs torch's _foreach kernels on real tensors and one operator per tensor on fake ones
        same = next(i for i, (a, b) in enumerate(zip(fake.records, real.records)) if a[:3] != b[:3])
        assert fake.records[:same] == real.records[:same]
        for census in (fake, real):
            assert same > max(i for i, r in enumerate(census.records) if r.node != "forward")


def test_only_a_second_order_step_runs_double_backward_nodes():
    def double_backward_bytes(census: TrafficCensus) -> int:
        return sum(t.bytes for node, t in census.totals("node").items() if node.endswith("BackwardBackward"))

    second = step_census("vpt", model=TINY, size=SMALL, tasks=2)
    first = step_census("vpt", model=TINY, size=SMALL, tasks=2, first_order=True)
    assert double_backward_bytes(second) > 0 and double_backward_bytes(first) == 0
    assert roofline(first)["gbytes"] < roofline(second)["gbytes"]


def test_stacked_tasks_add_bytes_but_no_operators():
    two = step_census("unigram", model=TINY, size=SMALL, tasks=2)
    four = step_census("unigram", model=TINY, size=SMALL, tasks=4)
    assert len(four.records) == len(two.records)
    assert sum(r.bytes for r in four.records) > sum(r.bytes for r in two.records)
    assert sum(r.flops for r in four.records) > sum(r.flops for r in two.records)


def test_support_attention_lowp_moves_fewer_bytes_under_bf16():
    """The key's products in bf16 instead of the MATH kernel's fp32: fewer bytes, the same FLOPs."""
    off = roofline(step_census("vpt", model=TINY, size=SMALL, tasks=2, autocast="bf16"))
    on = roofline(step_census("vpt", model=TINY, size=SMALL, tasks=2, autocast="bf16", lowp_attention=True))
    assert on["gbytes"] < off["gbytes"] and on["tflop"] == off["tflop"]


def test_the_roofline_sums_each_operators_larger_time():
    card = Card("test", bandwidth_tb_s=1.0, matmul_tflops=10.0, fp32_tflops=2.0)
    census = TrafficCensus()
    census.records = [
        OpRecord("mul", "forward", 3_000_000_000, 0, ""),  # 3 ms of bandwidth
        OpRecord("mm", "forward", 1_000_000_000, 40_000_000_000, "bfloat16"),  # 4 ms of bf16 products > 1 ms of bytes
        OpRecord("mm", "forward", 5_000_000_000, 4_000_000_000, "float32"),  # 2 ms of fp32 products < 5 ms of bytes
    ]
    out = roofline(census, card)
    assert out["floor_s"] == pytest.approx(0.003 + 0.004 + 0.005)
    assert out["product_bound_s"] == pytest.approx(0.004) and out["bandwidth_bound_s"] == pytest.approx(0.008)
    assert out["matmul_fraction_ceiling"] == pytest.approx(44e9 / 0.012 / 10e12, rel=1e-3)
    assert out["gbytes"] == 9.0 and out["operators"] == 3


def test_compare_with_profile_reads_the_bandwidth_a_measured_op_implies():
    census = TrafficCensus()
    census.records = [
        OpRecord("mul", "forward", 2_000_000_000, 0, ""),
        OpRecord("_to_copy", "forward", 1_000_000_000, 0, ""),
        OpRecord("clone", "forward", 1_000_000_000, 0, ""),
    ]
    row = {"top_ops": [{"op": "aten::mul", "calls": 1, "self_cuda_ms": 1.0}, {"op": "aten::copy_", "calls": 2,
           "self_cuda_ms": 4.0}, {"op": "some_kernel<float>", "calls": 3, "self_cuda_ms": 9.0}]}  # fmt: skip
    out = step_traffic.compare_with_profile(census, row)
    assert [(r["op"], r["calls_modelled"], r["tb_s_implied"]) for r in out] == [("mul", 1, 2.0), ("copy_", 2, 0.5)]


def test_cli_writes_its_json_and_refuses_bad_flags(tmp_path, capsys):
    out = tmp_path / "traffic.json"
    argv = ["--model", TINY, "--learners", "vpt", "--variants", "bf16", "--more-tasks", "8", "--out", str(out)]
    assert step_traffic.main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = json.loads(out.read_text())
    assert printed == written
    row = written["steps"]["vpt/bf16"]
    assert row["tasks_8"]["gbytes"] > row["gbytes"] > 0 and row["tasks_8_floor_over_default"] > 1
    assert row["top_nodes"][0]["gbytes"] >= row["top_nodes"][-1]["gbytes"]
    for bad, line in [
        (["--top", "0"], "error: --top: expected an integer >= 1, got 0"),
        (
            ["--learners", "clip"],
            "error: --learners: expected some of coop, vpt, unigram, ivlp, maple, cocoop, got 'clip'",
        ),
        (["--bandwidth-tb-s", "0"], "error: --bandwidth-tb-s: expected a number > 0, got 0.0"),
    ]:
        assert step_traffic.main(bad) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    missing = tmp_path / "none.json"
    assert step_traffic.main(["--compare", str(missing)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --compare {missing}: expected a gram_tools.profile_gpu JSON")


def test_the_committed_vit_b16_figures_are_what_the_tool_counts_now():
    """docs/gpu/step_traffic_vit_b16.json (the source of docs/benchmark.md's table) against a fresh count of two of its
    steps, and the table's VPT cells against the JSON: a change to the step that moves its bytes shows here."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    committed = json.loads((root / "docs/gpu/step_traffic_vit_b16.json").read_text())["steps"]
    table = (root / "docs/benchmark.md").read_text()
    for variant in ("bf16", "bf16_support_attention_lowp_closed_form_layer_norm"):
        fresh = roofline(step_census("vpt", model="ViT-B-16", **step_traffic.VARIANT_FLAGS[variant]))
        row = committed[f"vpt/{variant}"]
        for key in ("gbytes", "tflop", "floor_s", "matmul_fraction_ceiling", "operators"):
            assert fresh[key] == row[key], (variant, key)
        cells = f"{row['gbytes']:.1f} | {row['floor_s'] * 1e3:.1f} | {row['matmul_fraction_ceiling'] * 100:.1f} %"
        assert cells in table, cells
