"""gram_tools.profile_gpu on a machine without CUDA: its synthetic JPEGs and its refusals (the GPU parts run on the
device machine: scripts/device_run.sh)."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from gram_tools import profile_gpu


def test_synthetic_jpegs_are_decodable_photos_of_the_asked_size():
    jpegs = profile_gpu.synthetic_jpegs(3, width=50, height=40, quality=90, seed=1)
    assert len(jpegs) == 3 and len(set(jpegs)) == 3  # three different images
    for data in jpegs:
        with Image.open(io.BytesIO(data)) as img:
            assert img.format == "JPEG" and img.size == (50, 40) and img.mode == "RGB"
    assert profile_gpu.synthetic_jpegs(1, width=50, height=40, seed=1)[0] == jpegs[0]  # seeded


def test_kernel_shares_are_read_off_kernel_names():
    rows = [
        ("ampere_bf16_gemm_128x64", 2, 3.0),
        ("flash_fwd_kernel", 1, 1.0),
        ("bfloat16_copy_kernel_cuda", 5, 1.0),
        ("vectorized_elementwise_kernel<mul>", 9, 5.0),
    ]
    assert profile_gpu._shares(rows, 10.0) == {"matmul": 0.3, "attention": 0.1, "casts": 0.1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_stops_with_one_line(capsys):
    assert profile_gpu.main(["--decode-images", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: gram_tools.profile_gpu: CUDA is not available on this machine"]


def test_counts_below_one_are_refused(capsys):
    assert profile_gpu.main(["--steps", "0"]) == 2
    captured = capsys.readouterr()  # one line, no usage text first
    assert captured.err.strip().splitlines() == ["error: --steps: expected an integer >= 1, got 0"]
    assert captured.out == ""


def test_product_census_counts_products_by_the_dtype_they_compute_in():
    """Products are counted after autocast's casts; other ops are not counted; a 1-d operand does not decide."""
    a, b = torch.randn(4, 5), torch.randn(5, 3)

    def step():
        a @ b  # fp32
        torch.nn.functional.linear(a, b.T, torch.zeros(3))  # fp32 (its bias is 1-d)
        (a + 1).sum()  # not a product
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.bmm(a[None], b[None])  # cast to bf16 first
            a @ b

    assert profile_gpu.product_dtypes(step) == {"bfloat16": 2, "float32": 2}
    census = profile_gpu.census_of(step)
    assert census.casts == 4  # autocast casts both fp32 operands of each bf16 product
    assert profile_gpu.census_of(lambda: (a.to(torch.bfloat16), a.float(), a.clone())).casts == 1


def test_profile_steps_runs_on_a_cpu_and_reports_the_products_the_key_moves():
    """The step profile's own code (census, FLOPs, the larger meta-batch) on a CPU with the test CLIP, so a device
    call never meets a Python error; CPU autocast shows the MATH kernel's fp32 products, which the key moves to bf16."""
    small = {"way": 3, "support_shots": 1, "query_shots": 2, "meta_batch": 2}
    kwargs = dict(steps=1, top=3, matmul_peak=1.0, more_tasks=3, device="cpu", model="GRAM-Test-Deep", size=small)
    default = profile_gpu.profile_steps(["vpt"], "bf16", False, **kwargs)["vpt"]
    lowp = profile_gpu.profile_steps(["vpt"], "bf16", False, lowp_attention=True, **kwargs)["vpt"]
    assert lowp["dtype_casts"] < default["dtype_casts"]  # the MATH kernel's upcasts and downcasts are gone
    for row in (default, lowp):
        assert row["step_s"] > 0 and row["tflop"] > 0 and row["tasks_3_step_s"] > 0 and row["tasks_3_over_2"] > 0
        assert row["matmul_fraction"] == pytest.approx(row["tflops_achieved"], rel=1e-3)  # peak 1.0
        assert row["kernel_ms_per_step"] == 0 and row["top_kernels"] == []  # no CUDA kernels on a CPU
        # the 3-task step's FLOPs are 3/2 of the 2-task step's (each task's graph is its own), its rate read off them
        assert row["tasks_3_tflop"] == pytest.approx(1.5 * row["tflop"], rel=2e-3)
        assert row["tasks_3_matmul_fraction"] == pytest.approx(row["tasks_3_tflop"] / row["tasks_3_step_s"], rel=2e-3)
    # the frozen CLIP in bf16 (--bf16-weights): the same products, all in bf16 but R_φ's
    weights = profile_gpu.profile_steps(["vpt"], "bf16", False, lowp_attention=True, weights="bf16", **kwargs)["vpt"]
    assert weights["products_by_dtype"] == lowp["products_by_dtype"]
    fp32 = default["products_by_dtype"]["float32"]
    assert 0 < lowp["products_by_dtype"]["float32"] < fp32
    assert sum(lowp["products_by_dtype"].values()) == sum(default["products_by_dtype"].values())
    # the support pass's LayerNorms in closed form (META.CLOSED_FORM_LAYER_NORM): elementwise work only, the same
    # products and FLOPs
    closed = profile_gpu.profile_steps(["vpt"], "bf16", False, lowp_attention=True, closed_form_norm=True, **kwargs)
    assert closed["vpt"]["products_by_dtype"] == lowp["products_by_dtype"]
    assert closed["vpt"]["tflop"] == lowp["tflop"]


def test_read_rates_read_back_the_shards_they_wrote_at_each_thread_count():
    """read_rates writes the JPEGs into shards, reads them back through CHC's PairIndex (it raises if one byte
    differs) and reports a rate per thread count, from storage and from the page cache."""
    jpegs = profile_gpu.synthetic_jpegs(5, width=40, height=30)
    rates = profile_gpu.read_rates(jpegs, threads=(1, 3), copies=7, shard_size=8, repeats=2)  # 35 images, 5 shards
    assert rates["images"] == 35
    assert rates["jpeg_kib_mean"] == round(sum(map(len, jpegs)) / 5 / 1024, 1)
    keys = {f"read_{cache}_threads{n}_img_s" for n in (1, 3) for cache in ("evicted", "cached")}
    assert set(rates) == keys | {"images", "jpeg_kib_mean"}
    assert all(rates[k] > 0 for k in keys)
