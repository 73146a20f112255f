"""The ceiling probe (gram_world.probe): linear probes on frozen world-CLIP image features vs zero-shot."""
import json
import math

import numpy as np
import pytest

from gram_world import build_world
from gram_world.__main__ import main as world_main
from gram_world.probe import C_GRID, linear_probe, probe_table, probe_world


def _blobs(rng, n_per_class, centres, noise):
    x = np.concatenate([c + noise * rng.standard_normal((n_per_class, centres.shape[1])) for c in centres])
    y = np.repeat(np.arange(len(centres)), n_per_class)
    return x.astype(np.float32), y


def test_linear_probe_picks_C_on_val_and_reports_test_accuracy():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((3, 8))
    train, val, test = (_blobs(rng, n, centres, 0.05) for n in (10, 10, 50))
    r = linear_probe(train, val, test)
    assert r["accuracy"] == 100.0 and r["C"] in C_GRID and r["val_accuracy"] == 100.0
    # the test split never chooses C: labels scrambled on test change the accuracy, not C
    scrambled = (test[0], rng.permutation(test[1]))
    r2 = linear_probe(train, val, scrambled)
    assert r2["C"] == r["C"] and r2["accuracy"] < 60.0


@pytest.fixture(scope="module")
def quick_world(tmp_path_factory):
    # same parent as the other world tests' fixture, so a session builds the quick world once
    return build_world(quick=True, root=tmp_path_factory.getbasetemp() / "worlds", seed=0)


@pytest.mark.slow
def test_probe_world_on_random_weights_reports_base_classes(quick_world):
    result = probe_world(quick_world, None, seeds=(1, 2), shots=4, with_coop=True, datasets=("WorldMixed",),
                         log=lambda m: None)
    r = result["WorldMixed"]
    n_classes = len(quick_world.dataset("WorldMixed").classnames)
    split = json.loads(quick_world.dataset("WorldMixed").split_file.read_text())
    assert r["n_base"] == math.ceil(n_classes / 2)
    assert r["n_test"] == sum(1 for row in split["test"] if row[1] < r["n_base"])
    assert r["n_train"] == sum(1 for row in split["train"] if row[1] < r["n_base"])
    for acc in (r["zeroshot"], r["probe_all"]["accuracy"], r["probe_16"]["accuracy"], r["coop_fit"]["accuracy"]):
        assert 0.0 <= acc <= 100.0
    assert len(r["probe_16"]["per_seed"]) == 2
    assert r["probe_16"]["accuracy"] == pytest.approx(np.mean(r["probe_16"]["per_seed"]))
    table = probe_table(result, shots=4)
    assert "| WorldMixed |" in table and "| average |" in table and "4 shots" in table


@pytest.mark.slow
def test_probe_cli_refuses_a_missing_weights_file(tmp_path, quick_world, capsys):
    root = quick_world.root.parent
    assert world_main(["probe", "--quick", "--root", str(root), "--weights", str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors: no such file" in capsys.readouterr().err
