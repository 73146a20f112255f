"""The ceiling probe (gram_world.probe): linear probes on frozen world-CLIP image features vs zero-shot."""

import json
import math
import warnings

import numpy as np
import pytest

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


@pytest.mark.slow
def test_probe_world_on_random_weights_reports_base_classes(quick_world):
    result = probe_world(
        quick_world,
        None,
        seeds=(1, 2),
        shots=4,
        with_coop=True,
        datasets=("WorldMixed",),
        log=lambda m: None,
        with_vpt=True,
    )
    r = result["WorldMixed"]
    n_classes = len(quick_world.dataset("WorldMixed").classnames)
    split = json.loads(quick_world.dataset("WorldMixed").split_file.read_text())
    assert r["n_base"] == math.ceil(n_classes / 2)
    assert r["n_test"] == sum(1 for row in split["test"] if row[1] < r["n_base"])
    assert r["n_train"] == sum(1 for row in split["train"] if row[1] < r["n_base"])
    for acc in (
        r["zeroshot"],
        r["probe_all"]["accuracy"],
        r["probe_16"]["accuracy"],
        r["coop_fit"]["accuracy"],
        r["vpt_fit"]["accuracy"],
    ):
        assert 0.0 <= acc <= 100.0
    assert r["vpt_fit"]["best_train_accuracy"] >= r["vpt_fit"]["train_accuracy"]
    assert len(r["probe_16"]["per_seed"]) == 2
    assert r["probe_16"]["accuracy"] == pytest.approx(np.mean(r["probe_16"]["per_seed"]))
    table = probe_table(result, shots=4)
    assert "| WorldMixed |" in table and "| average |" in table and "4 shots" in table and "VPT fit" in table


@pytest.mark.slow
def test_probe_cli_refuses_a_missing_weights_file(tmp_path, quick_world, capsys):
    root = quick_world.root.parent
    assert world_main(["probe", "--quick", "--root", str(root), "--weights", str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors: no such file" in capsys.readouterr().err


def _tiny_clip():
    import open_clip
    import torch

    from meta.model.backbone import load_clip

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights on purpose
        clip, dims = load_clip("GRAM-World-ViT-T", pretrained=None)
    clip.eval()
    for p in clip.parameters():
        p.requires_grad_(False)
    return clip, dims, open_clip.get_tokenizer("GRAM-World-ViT-T")


def test_vpt_fit_reports_what_an_independent_forward_pass_measures(monkeypatch):
    import torch

    from gram_world.clip_io import to_model_input
    from gram_world.probe import vpt_fit
    from meta.model.visual_encoder import encode_image_with_prompts

    clip, dims, tokenizer = _tiny_clip()
    rng = np.random.default_rng(0)
    # two classes told apart by brightness, so 4 visual tokens can fit the train set
    images = np.concatenate([rng.integers(0, 80, (12, 32, 32, 3)), rng.integers(170, 256, (12, 32, 32, 3))]).astype(
        np.uint8
    )
    labels = np.repeat([0, 1], 12)
    train, test = (torch.from_numpy(images[::2]), labels[::2]), (torch.from_numpy(images[1::2]), labels[1::2])
    import gram_world.probe as probe_module
    from meta.method.prompts import PromptParams

    captured = {}
    original = PromptParams.from_spec

    def keep(*args, **kwargs):
        captured["prompts"] = original(*args, **kwargs)
        return captured["prompts"]

    monkeypatch.setattr(PromptParams, "from_spec", keep)
    r = vpt_fit(clip, dims, ["circle", "square"], train, test, epochs=20, lr=0.05, batch_size=4)
    vpt = captured["prompts"].vpt.detach()
    assert vpt.shape == (1, 4, dims.vision_width)
    # independent evaluation: prompted image features against the template's text features
    from gram_world.clip_io import class_text_features

    text = class_text_features(clip, tokenizer, ["circle", "square"], probe_module.TEMPLATE)
    with torch.no_grad():
        feats = torch.nn.functional.normalize(encode_image_with_prompts(clip, to_model_input(test[0]), vpt), dim=-1)
    expected = 100.0 * float(((feats @ text.T).argmax(1).numpy() == test[1]).mean())
    assert r["accuracy"] == pytest.approx(expected)
    assert r["train_accuracy"] > 50.0 and r["best_train_accuracy"] >= r["train_accuracy"]


@pytest.mark.slow
def test_capture_scan_rows_average_and_table():
    from gram_world import world_settings
    from gram_world.capture_scan import COLUMNS, render_base_classes, scan_condition, scan_table

    clip, dims, tokenizer = _tiny_clip()
    rendered = render_base_classes(world_settings(quick=True), (("train", 4), ("val", 2), ("test", 3)))
    plans = [p for p in world_settings(quick=True).plans if "base2new" in p.roles]
    assert list(rendered) == [p.name for p in plans]
    names, splits = rendered["WorldPolygons"]
    assert names == sorted(plans[1].classnames)[: (len(plans[1].classnames) + 1) // 2]
    assert splits["test"][0].shape == (3 * len(names), 32, 32, 3) and list(splits["test"][1][:3]) == [0, 0, 0]
    rows = scan_condition(clip, dims, tokenizer, rendered, "dark", vpt_epochs=2)
    assert set(rows) == set(rendered) | {"average"}
    for column in COLUMNS:
        values = [rows[n][column] for n in rendered]
        assert all(0.0 <= v <= 100.0 for v in values)
        assert rows["average"][column] == pytest.approx(np.mean(values))
    table = scan_table({"dark": rows})
    a = rows["average"]
    assert f"| dark | {a['zeroshot']:.1f} |" in table and f"{a['vpt'] - a['zeroshot']:+.1f} |" in table


def test_capture_scan_refuses_an_unknown_condition_before_any_work():
    from gram_world.capture_scan import scan_captures

    with pytest.raises(ValueError, match=r"--captures: unknown conditions \['infrared'\]; known: none, grayscale"):
        scan_captures(None, ["dark", "infrared"], log=lambda m: None)
