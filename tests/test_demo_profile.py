"""The demo's stage profile (gram_world.demo.profile): wall time and product share per stage, written and re-read."""

from __future__ import annotations

import json

import torch

from gram_world.demo import pool
from gram_world.demo.profile import StageProfile


def _products(n: int) -> float:
    """``n`` products of 256 x 256 matrices (a pool task; module level so spawned workers can import it)."""
    x = torch.ones(256, 256)
    for _ in range(n):
        x = (x @ x) / 256.0
    return float(x[0, 0])


def test_stage_profile_counts_own_and_worker_products(tmp_path):
    profile = StageProfile()
    with profile.stage("own"):
        assert _products(5) == 1.0
    with profile.stage("pooled", processes=2):
        results = pool.run_with_progress(_products, [3, 4], 2, 2, lambda: 0, "test", "task")
    assert results == [1.0, 1.0]
    own, pooled = profile.rows
    gflop = 2 * 256**3 / 1e9
    assert abs(own["product_gflop"] - 5 * gflop) < 2e-3 and own["product_seconds"] > 0
    assert abs(pooled["product_gflop"] - 7 * gflop) < 2e-3, "the workers' products are counted"
    assert 0 <= own["product_share"] <= 1 and own["processes"] == 1 and pooled["processes"] == 2
    md = profile.write(tmp_path)
    record = json.loads((tmp_path / "stage_profile.json").read_text())
    assert [r["stage"] for r in record["stages"]] == ["own", "pooled"]
    assert record["mode"] == "pinned" and record["matrix_products"].startswith("numpy OpenBLAS")
    assert record["total_seconds"] == round(own["seconds"] + pooled["seconds"], 1)
    text = md.read_text()
    assert "| own |" in text and "| pooled |" in text and "product share" in text
    assert profile.seconds() == {"own": own["seconds"], "pooled": pooled["seconds"]}
