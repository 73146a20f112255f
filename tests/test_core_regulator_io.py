"""R_φ initialisation and forms, the GBML transform factory, test-time regulation, init file I/O."""

import json

import pytest
import torch

from meta.finetune.init_io import InitMismatchError, export_coop_context, export_gram_init, load_gram_init
from meta.finetune.regulated import GradientRegulation
from meta.method.gram import GRAMMetaLearner, MetaSpec
from meta.method.prompts import PromptParams, PromptSpec
from meta.method.regulator import GradientRegulator, RegulatorFactory, RegulatorSpec
from meta.model.backbone import ClipDims


@pytest.mark.parametrize("scale", [1e-6, 1e-2, 10.0])
def test_residual_zero_init_is_identity_at_any_scale(scale):
    reg = GradientRegulator(8, RegulatorSpec(form="residual", init="zero"))
    g = torch.randn(4, 8) * scale
    torch.testing.assert_close(reg(g), g)


def test_paper_form_zero_init_gives_zero_update():
    reg = GradientRegulator(8, RegulatorSpec(form="paper", init="zero", input_norm=False, beta_scale=1.0))
    assert torch.count_nonzero(reg(torch.randn(4, 8))) == 0


def test_regulator_matches_the_formula():
    spec = RegulatorSpec(form="paper", input_norm=False, beta_scale=0.5, init="normal", init_std=0.3)
    reg = GradientRegulator(5, spec)
    with torch.no_grad():
        reg.gamma.bias.normal_()
        reg.beta.bias.normal_()
    g = torch.randn(3, 5)
    gamma = torch.tanh(g @ reg.gamma.weight.T + reg.gamma.bias)
    beta = 0.5 * torch.tanh(g @ reg.beta.weight.T + reg.beta.bias)
    torch.testing.assert_close(reg(g), gamma * g + beta)
    # input normalisation + relative beta make R_φ scale-equivariant: R(c g) = c R(g)
    reg2 = GradientRegulator(5, RegulatorSpec(init="normal", init_std=0.3))
    reference = reg2(g)
    # exact but for the ε = 1e-12 under the rms square root: relative effect ~ ε / mean((c g)²),
    # about 1e-4 at c = 1e-4 (amplified where γ g and β nearly cancel), below float32 rounding at c >= 1e-2
    for c, tol in ((1e-4, 2e-3), (1e-2, 1e-5), (1e3, 1e-5)):
        torch.testing.assert_close(reg2(g * c) / c, reference, rtol=tol, atol=tol * float(reference.abs().max()))


def test_residual_regulator_matches_the_formula_and_keeps_its_parameter_names():
    """ĝ = (1 + tanh(W_γ u + b_γ)) ⊙ g + rms(g) · tanh(W_β u + b_β), u = g / rms(g), written out; ``parts`` gives β
    as the β share; the default R_φ's parameters are the two maps only (the names init files carry)."""
    reg = GradientRegulator(5, RegulatorSpec(init="normal", init_std=0.3))
    with torch.no_grad():
        reg.gamma.bias.normal_()
        reg.beta.bias.normal_()
    g = torch.randn(2, 3, 5)
    rms = g.pow(2).mean().add(1e-12).sqrt()
    u = g / rms
    gamma = 1.0 + torch.tanh(u @ reg.gamma.weight.T + reg.gamma.bias)
    beta = rms * torch.tanh(u @ reg.beta.weight.T + reg.beta.bias)
    out, b = reg.parts(g)
    torch.testing.assert_close(out, gamma * g + beta)
    torch.testing.assert_close(b, beta)
    torch.testing.assert_close(reg(g), out)
    assert sorted(reg.state_dict()) == ["beta.bias", "beta.weight", "gamma.bias", "gamma.weight"]
    assert sorted(n for n, _ in GradientRegulator(5).named_parameters()) == sorted(reg.state_dict())


def test_factory_is_plain_callable_and_skips_frozen_tensors():
    factory = RegulatorFactory(RegulatorSpec())
    assert not isinstance(factory, torch.nn.Module)
    frozen = torch.zeros(3, 7)
    live = torch.zeros(3, 7, requires_grad=True)
    assert factory(frozen) is None
    assert isinstance(factory(live), GradientRegulator) and factory(live).dim == 7
    assert RegulatorFactory(enabled=False)(live) is None


def test_bad_regulator_settings_are_rejected():
    with pytest.raises(ValueError, match="form"):
        RegulatorSpec(form="affine")
    with pytest.raises(ValueError, match="beta_scale"):
        RegulatorSpec(beta_scale="big")


def test_test_time_regulation_rewrites_grads_in_place():
    reg = GradientRegulator(4, RegulatorSpec(init="normal", init_std=0.5))
    regulation = GradientRegulation({"ctx": reg})
    p = torch.nn.Parameter(torch.zeros(2, 4))
    p.grad = torch.randn(2, 4)
    expected = reg(p.grad).detach()
    other = torch.nn.Parameter(torch.zeros(3))
    other.grad = torch.ones(3)
    n = regulation.apply_([("ctx", p), ("bias", other)])
    assert n == 1
    torch.testing.assert_close(p.grad, expected)
    assert torch.equal(other.grad, torch.ones(3))
    assert not any(q.requires_grad for q in regulation.parameters())


def test_test_time_regulation_finds_each_regulator_by_its_parameter():
    """R_φ is bound to θ's own parameters by their tensor names (as meta-training's transforms are one per
    parameter); a regulator that matches no parameter is refused in one line, not left silently unused (a wrapper's
    prefixed names, ``prompt_learner.ctx``, used to be matched by their last part)."""
    reg = GradientRegulator(4, RegulatorSpec(init="normal", init_std=0.5))
    regulation = GradientRegulation({"ctx": reg})
    p, other = torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(3))
    assert [(n, q is p, r is regulation.regulators["ctx"]) for n, q, r in regulation.bind([("ctx", p)])] == [
        ("ctx", True, True)
    ]
    assert regulation.bind([("ctx", p), ("bias", other)])[1][2] is None
    p.grad = torch.ones(2, 4)
    with pytest.raises(
        ValueError, match=r"^R_φ holds regulators for ctx, which θ's parameters \(bias, prompt_learner\.ctx\)"
    ):
        regulation.apply_([("prompt_learner.ctx", p), ("bias", other)])
    assert torch.equal(p.grad, torch.ones(2, 4))  # refused before any gradient was touched


def _dims(model_name="GRAM-Test-Tiny"):
    return ClipDims(
        model_name=model_name,
        text_width=64,
        vision_width=64,
        embed_dim=64,
        context_length=77,
        text_layers=2,
        vision_layers=2,
        image_size=32,
        num_patches=16,
    )


def _trained_learner(tiny_clip):
    clip, dims = tiny_clip
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=2, n_ctx_vision=2, vision_depth=2), clip, dims)
    ml = GRAMMetaLearner(prompts, MetaSpec(regulator=RegulatorSpec(init="normal")))
    return ml, dims


def test_init_export_import_round_trip(tiny_clip, tmp_path):
    ml, dims = _trained_learner(tiny_clip)
    path = export_gram_init(
        tmp_path / "init.safetensors", ml.prompt_module, ml.regulators(), dims, provenance={"steps": 3}
    )
    loaded = load_gram_init(
        path,
        expect={
            "text_width": 64,
            "vision_width": 64,
            "n_ctx_text": 2,
            "n_ctx_vision": 2,
            "vision_depth": 2,
            "model_name": "GRAM-Test-Tiny",
        },
    )
    module = loaded.prompt_module()
    torch.testing.assert_close(module.ctx, ml.prompt_module.ctx.detach())
    torch.testing.assert_close(module.vpt, ml.prompt_module.vpt.detach())
    regs = loaded.regulator_modules()
    assert set(regs) == {"ctx", "vpt"}
    g = torch.randn(2, 2, 64)
    torch.testing.assert_close(regs["vpt"](g), ml.regulators()["vpt"](g))
    assert loaded.metadata["provenance"] == {"steps": 3}
    assert loaded.metadata["regulator"]["init"] == "normal"


def test_init_mismatch_names_every_field(tiny_clip, tmp_path):
    ml, dims = _trained_learner(tiny_clip)
    path = export_gram_init(tmp_path / "init.safetensors", ml.prompt_module, ml.regulators(), dims)
    with pytest.raises(InitMismatchError) as err:
        load_gram_init(path, expect={"text_width": 512, "n_ctx_text": 4}, config_key="TRAINER.GRAM.INIT")
    msg = str(err.value)
    assert "TRAINER.GRAM.INIT" in msg and "text_width: file has 64, model expects 512" in msg
    assert "n_ctx_text: file has 2, model expects 4" in msg
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_gram_init(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(InitMismatchError, match="not a readable safetensors"):
        load_gram_init(bad)


def test_coop_context_export_loads_with_weights_only(tmp_path):
    ctx = torch.randn(4, 512)
    path = export_coop_context(tmp_path / "ctx.pth", ctx, epoch=0)
    state = torch.load(path, weights_only=True)
    assert set(state["state_dict"]) == {"ctx"}
    torch.testing.assert_close(state["state_dict"]["ctx"], ctx)


def _rewrite(path, tensors=None, meta=None, raw=None):
    """Re-save ``path`` with other tensors and/or another 'gram' header (a tampered file)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    tensors = load_file(str(path)) if tensors is None else tensors
    text = raw if raw is not None else json.dumps(meta if meta is not None else json.loads(header["gram"]))
    out = path.with_name("tampered.safetensors")
    save_file(tensors, str(out), metadata={"gram": text})
    return out


@pytest.mark.parametrize(
    "change, field",
    [
        ("bad_json", "metadata 'gram': not valid JSON"),
        ("list", "metadata 'gram': expected a JSON object"),
        ("no_backbone", "backbone: missing"),
        ("string_version", "format_version: expected the integer 1, got '1' (str)"),
        ("unknown_regulator_field", "regulator.gain: unknown field"),
        ("regulator_list", "regulator: expected null or an object"),
        ("width_string", "backbone.text_width: expected an integer >= 1"),
        ("shape_vs_metadata", "tensor prompt.ctx: has shape [2, 128], but the metadata's"),
        ("shape_vs_shapes", "tensor prompt.ctx: has shape [3, 64], but shapes.prompt.ctx records [2, 64]"),
        ("regulator_shape", "tensor regulator.ctx.gamma.weight: has shape [64, 32]"),
        ("nan", "tensor prompt.vpt: holds NaN"),
    ],
)
def test_tampered_init_files_fail_in_one_line_naming_file_and_field(tiny_clip, tmp_path, change, field):
    ml, dims = _trained_learner(tiny_clip)
    path = export_gram_init(tmp_path / "init.safetensors", ml.prompt_module, ml.regulators(), dims)
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["gram"])
    tensors = load_file(str(path))
    if change == "bad_json":
        bad = _rewrite(path, raw="{not json")
    elif change == "list":
        bad = _rewrite(path, raw="[1, 2]")
    elif change == "no_backbone":
        del meta["backbone"]
        bad = _rewrite(path, meta=meta)
    elif change == "string_version":
        meta["format_version"] = "1"
        bad = _rewrite(path, meta=meta)
    elif change == "unknown_regulator_field":
        meta["regulator"]["gain"] = 2.0
        bad = _rewrite(path, meta=meta)
    elif change == "regulator_list":
        meta["regulator"] = ["residual"]
        bad = _rewrite(path, meta=meta)
    elif change == "width_string":
        meta["backbone"]["text_width"] = "64"
        bad = _rewrite(path, meta=meta)
    elif change == "shape_vs_metadata":  # a [2, 128] context labelled width 64, shapes table consistent
        tensors["prompt.ctx"] = torch.zeros(2, 128)
        meta["shapes"]["prompt.ctx"] = [2, 128]
        bad = _rewrite(path, tensors=tensors, meta=meta)
    elif change == "shape_vs_shapes":
        tensors["prompt.ctx"] = torch.zeros(3, 64)
        bad = _rewrite(path, tensors=tensors, meta=meta)
    elif change == "regulator_shape":
        tensors["regulator.ctx.gamma.weight"] = torch.zeros(64, 32)
        meta["shapes"]["regulator.ctx.gamma.weight"] = [64, 32]
        bad = _rewrite(path, tensors=tensors, meta=meta)
    else:
        tensors["prompt.vpt"] = tensors["prompt.vpt"].clone()
        tensors["prompt.vpt"][0, 0, 0] = float("nan")
        bad = _rewrite(path, tensors=tensors, meta=meta)
    with pytest.raises(InitMismatchError) as err:
        load_gram_init(bad, config_key="TRAINER.GRAM.INIT")
    msg = str(err.value)
    assert msg.startswith(f"TRAINER.GRAM.INIT: {bad}: ") and "\n" not in msg, msg
    assert field in msg, msg


def test_init_accepts_files_without_newer_regulator_fields(tiny_clip, tmp_path):
    """Regulator fields are checked against RegulatorSpec; a file may omit fields (their defaults apply)."""
    ml, dims = _trained_learner(tiny_clip)
    path = export_gram_init(tmp_path / "init.safetensors", ml.prompt_module, ml.regulators(), dims)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["gram"])
    del meta["regulator"]["init_std"]
    loaded = load_gram_init(_rewrite(path, meta=meta))
    assert loaded.regulator_modules()["ctx"].spec.init_std == RegulatorSpec().init_std


def test_exports_are_atomic_with_plain_file_mode(tmp_path, monkeypatch):
    """A failed write leaves the previous file and no temporary; new files get 0666 & ~umask like open()."""
    import errno

    import meta.infra.fileio as fileio

    ctx = torch.randn(4, 64)
    path = export_coop_context(tmp_path / "ctx.pth", ctx)
    before = path.read_bytes()
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", full)
    with pytest.raises(OSError) as err:
        export_coop_context(path, torch.zeros(4, 64))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx.pth", "plain"]


def test_stale_temp_files_of_dead_writers_are_cleaned(tmp_path):
    import os
    import subprocess
    import sys

    from meta.infra.fileio import clean_stale_temps

    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    names = [
        f".a.pth.tmp-{dead}-0123abcd",
        f".b.pt.tmp-{dead}",
        ".c.pth.tmp-1-0123abcd",
        f".d.pth.tmp-{os.getpid()}-0123abcd",
        "e.tmp",
        "f.safetensors",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    clean_stale_temps(tmp_path)  # without the folder's lock: only files whose writer is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    clean_stale_temps(tmp_path, all_pids=True)  # with it: every writer's but this process's own
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[3:])
