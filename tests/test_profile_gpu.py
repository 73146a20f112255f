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
