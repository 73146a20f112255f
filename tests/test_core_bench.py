"""The benchmark runs end to end and reports what it promises (on the tiny model)."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gram_tools import bench


def test_bench_prints_one_json_line_with_required_keys(capsys):
    bench.main(["--model", "GRAM-Test-Tiny", "--way", "3", "--warmup", "0", "--repeats", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    for key in (
        "second_order_s",
        "first_order_s",
        "plain_step_s",
        "ratio_second_to_plain",
        "peak_rss_mb",
        "frozen_bytes_cloned_per_task",
        "truncation_speedup",
        "settings",
    ):
        assert key in result, key
    assert result["frozen_bytes_cloned_per_task"] == 0
    assert result["theta_phi_bytes_cloned_per_task"] > 0
    assert result["settings"]["way"] == 3 and result["settings"]["model"] == "GRAM-Test-Tiny"
    assert result["ratio_second_to_plain"] > 0
    for key in ("linear_forward_s", "linear_backward_s"):
        assert result[key] > 0, key


def test_bench_derived_numbers_from_known_timings(monkeypatch, capsys):
    """With fixed step times the derived fields are the documented ones, worked out by hand:
    the plain step holds one forward + one backward linear sweep, the second-order task three of each."""
    seen = {}

    def fixed_times(fns, warmup, repeats):
        seen.update(names=sorted(fns), warmup=warmup, repeats=repeats)
        return {
            "second": 0.5,
            "plain": 0.25,
            "first": 0.3,
            "full": 0.75,
            "linear_forward": 0.03,
            "linear_backward": 0.05,
        }

    monkeypatch.setattr(bench, "_interleaved_medians", fixed_times)
    bench.main(["--model", "GRAM-Test-Tiny", "--way", "3", "--warmup", "4", "--repeats", "5"])
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert seen == {
        "names": ["first", "full", "linear_backward", "linear_forward", "plain", "second"],
        "warmup": 4,
        "repeats": 5,
    }
    assert result["second_order_s"] == 0.5 and result["first_order_s"] == 0.3 and result["plain_step_s"] == 0.25
    assert result["ratio_second_to_plain"] == 2.0 and result["truncation_speedup"] == 1.5
    assert result["linear_forward_s"] == 0.03 and result["linear_backward_s"] == 0.05
    assert result["plain_other_s"] == 0.17  # 0.25 - (0.03 + 0.05)
    assert result["second_order_other_s"] == 0.26  # 0.5 - 3 * (0.03 + 0.05)
    assert "everything else: plain 0.1700 s, second order 0.2600 s" in "\n".join(lines[:-1])


def _matmul_flops(fn) -> int:
    """Multiply-add FLOPs of the aten.mm / aten.addmm calls ``fn`` makes (torch's own flop counter)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    ops = counter.get_flop_counts()["Global"]
    return sum(v for k, v in ops.items() if str(k).split(".")[-1] in ("mm", "addmm"))


def test_linear_products_are_the_text_towers_own_matmuls(tiny_clip):
    """The bench's matmul-only sweeps do exactly the matrix products of a real text forward / backward."""
    from meta.model.blocks import transformer_forward
    from meta.model.text_encoder import ClassTokenCache

    clip, _ = tiny_clip
    names = ["golden retriever", "fire truck", "tabby cat"]
    tokens = ClassTokenCache(clip, 4).tokens(names)
    length, width = tokens.length, clip.transformer.resblocks[0].ln_1.normalized_shape[0]
    x = torch.randn(len(names), length, width, requires_grad=True)
    mask = clip.attn_mask[:length, :length]
    real_forward = _matmul_flops(lambda: transformer_forward(clip.transformer, x, mask, last_rows=tokens.eot_index))
    out = transformer_forward(clip.transformer, x, mask, last_rows=tokens.eot_index)
    real_backward = _matmul_flops(lambda: torch.autograd.grad(out.sum(), x))
    forward, backward = bench.linear_products(clip.transformer, len(names), length)
    assert real_forward > 0 and real_backward > 0
    assert _matmul_flops(forward) == real_forward
    assert _matmul_flops(backward) == real_backward
    # one row more per sequence is a different count: the comparison can tell shapes apart
    longer, _ = bench.linear_products(clip.transformer, len(names), length + 1)
    assert _matmul_flops(longer) != real_forward


def test_bench_reports_the_ratio_guard(capsys):
    bench.main(["--model", "GRAM-Test-Tiny", "--way", "3", "--warmup", "0", "--repeats", "1"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ratio_floor"] == 3.0 and result["ratio_guard"] == 3.3
    assert result["ratio_guard_pass"] == (result["ratio_second_to_plain"] <= 3.3)


def test_bench_device_cuda_without_cuda_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --device cuda: CUDA is not available on this machine"
    assert bench.main(["--device", "tpu"]) == 2
    assert capsys.readouterr().err.strip() == "error: --device tpu: expected cpu or cuda[:index]"


def test_device_bench_measures_every_variant_and_its_cost():
    """gram_tools.bench_gpu's code path on CPU with the tiny CLIP and a tiny task (the GPU run adds only
    sync/memory)."""
    from gram_tools import bench_gpu

    size = {"way": 3, "support_shots": 1, "query_shots": 2, "meta_batch": 2, "steps": 100, "chc_batch": 8}
    result = bench_gpu.run(
        "GRAM-Test-Tiny",
        "cpu",
        warmup=0,
        repeats=1,
        size=size,
        chc_images=16,
        scaling_tasks=(1, 2),
        scaling_variants=("coop", "vpt"),
        chc_batches=(4, 16),
        matmul_n=128,
    )
    assert set(result["variants"]) == {"coop", "vpt", "unigram", "ivlp", "maple", "cocoop"}
    assert result["matmul_tflops"] > 0 and result["matmul_dtype"] == "float32"
    for name, row in result["variants"].items():
        assert row["second_order_step_s"] > 0 and row["first_order_step_s"] > 0
        assert row["second_order_peak_mb"] is None  # device memory is only counted on CUDA
        # an exact second-order step does strictly more arithmetic than a first-order one
        assert row["second_order_tflop"] > row["first_order_tflop"] > 0, name
        for order in ("second", "first"):
            achieved = row[f"{order}_order_tflop"] / row[f"{order}_order_step_s"]
            assert row[f"{order}_order_tflops_achieved"] == pytest.approx(achieved, rel=2e-3)
            assert row[f"{order}_order_matmul_fraction"] == pytest.approx(
                row[f"{order}_order_tflops_achieved"] / result["matmul_tflops"], rel=2e-3
            )
        hours = result["cost"]["meta_train_gpu_hours"][name]
        assert abs(hours - round(100 * row["second_order_step_s"] / 3600, 3)) < 1e-9
    assert result["chc_images_per_s"] > 0
    assert set(result["chc_batch_sweep"]) == {"4", "16"} and all(v > 0 for v in result["chc_batch_sweep"].values())
    assert set(result["task_scaling"]) == {"coop", "vpt"}
    for cells in result["task_scaling"].values():
        assert set(cells) == {"1", "2"}
        for cell in cells.values():
            assert cell["sequential"]["step_s"] > 0 and cell["batched"]["step_s"] > 0
            assert cell["batched"]["task_chunk"] is None  # nothing ran out of memory
    assert abs(result["cost"]["chc_gpu_hours_cc3m"] - round(3.1e6 / result["chc_images_per_s"] / 3600, 3)) < 2e-3
    assert result["settings"]["meta_batch"] == 2 and result["settings"]["gpu"] is None
    assert bench_gpu.task_size()["way"] == 5  # the defaults come from the meta-training config
