"""Dassl-free tests: weights_only checkpoints, class-independent loading, CoOp export, the GramCLIP wrapper."""

from __future__ import annotations

import pytest
import torch
from helpers import optim_cfg
from torch import nn

from meta.finetune.init_io import export_gram_init
from meta.method.prompts import PromptParams
from meta.method.regulator import GradientRegulator
from trainers.gram.dassl_checkpoint import checkpoint_file, load_checkpoint, prompt_state, save_checkpoint
from trainers.gram.dassl_schedule import build_lr_scheduler
from trainers.gram.export import export_for_coop
from trainers.gram.export import main as export_main
from trainers.gram.model import GramCLIP
from trainers.gram.run_trace import sample_digest


def _trained_prompts(seed: int = 0) -> tuple[PromptParams, torch.optim.Optimizer, object]:
    g = torch.Generator().manual_seed(seed)
    prompts = PromptParams(ctx=torch.randn(4, 64, generator=g), vpt=torch.randn(1, 2, 64, generator=g))
    opt = torch.optim.SGD(prompts.parameters(), lr=0.002, momentum=0.9, weight_decay=5e-4)
    sched = build_lr_scheduler(opt, optim_cfg())
    (prompts.ctx.sum() + prompts.vpt.pow(2).sum()).backward()
    opt.step()
    sched.step()
    return prompts, opt, sched


def test_checkpoint_layout_and_weights_only_content(tmp_path):
    prompts, opt, sched = _trained_prompts()
    path = save_checkpoint(tmp_path, "prompt_learner", 3, prompts, opt, sched, extra={"trainer": "UNIGRAM"})
    assert path == tmp_path / "prompt_learner" / "model.pth.tar-3"
    assert (tmp_path / "prompt_learner" / "checkpoint").read_text().strip() == "model.pth.tar-3"
    assert checkpoint_file(tmp_path, "prompt_learner") == path == checkpoint_file(tmp_path, "prompt_learner", 3)
    raw = torch.load(path, weights_only=True)  # the torch >= 2.6 default must accept it
    assert set(raw) == {"state_dict", "epoch", "optimizer", "scheduler", "val_result", "gram"}
    assert raw["epoch"] == 3 and raw["val_result"] is None and raw["gram"] == {"trainer": "UNIGRAM"}
    assert set(raw["state_dict"]) == {"ctx", "vpt"}
    assert torch.equal(raw["state_dict"]["ctx"], prompts.ctx.detach())
    assert torch.equal(raw["optimizer"]["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    assert raw["scheduler"]["last_epoch"] == 1
    assert load_checkpoint(path)["epoch"] == 3


def test_unsafe_or_missing_checkpoints_give_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model checkpoint at"):
        load_checkpoint(tmp_path / "nope.pth.tar")
    bad = tmp_path / "pickled.pth.tar"
    torch.save({"state_dict": {}, "scheduler": nn.Linear(1, 1)}, bad)  # an object, as Dassl's schedulers pickle
    with pytest.raises(RuntimeError, match="not a weights-only checkpoint") as err:
        load_checkpoint(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="checkpoint pointer"):
        checkpoint_file(tmp_path, "prompt_learner")


def test_prompt_state_drops_class_buffers_and_names_mismatches():
    prompts = PromptParams(ctx=torch.zeros(4, 64))
    coop_like = {
        "ctx": torch.ones(4, 64),
        "token_prefix": torch.zeros(10, 1, 64),
        "token_suffix": torch.zeros(10, 72, 64),
    }
    kept = prompt_state(coop_like, prompts)
    assert set(kept) == {"ctx"} and torch.equal(kept["ctx"], torch.ones(4, 64))
    assert set(prompt_state({"module.ctx": torch.ones(4, 64)}, prompts)) == {"ctx"}
    with pytest.raises(RuntimeError) as err:
        prompt_state({"ctx": torch.ones(2, 64)}, prompts, source="x")
    assert str(err.value) == "x does not fit this model: ctx: checkpoint (2, 64), model (4, 64)"  # not also "missing"
    unigram = PromptParams(ctx=torch.zeros(2, 64), vpt=torch.zeros(1, 2, 64))
    with pytest.raises(RuntimeError) as err:
        prompt_state({"ctx": torch.ones(4, 64)}, unigram, source="y")
    assert str(err.value) == "y does not fit this model: ctx: checkpoint (4, 64), model (2, 64); missing key vpt"
    with pytest.raises(RuntimeError, match="missing key ctx"):
        prompt_state({"token_prefix": torch.zeros(1)}, prompts)
    with pytest.raises(RuntimeError, match="unexpected key vpt"):
        prompt_state({"ctx": torch.ones(4, 64), "vpt": torch.ones(1, 2, 64)}, prompts)


def test_export_for_stock_coop_from_init_file_and_from_checkpoint(tmp_path, tiny_clip, capsys):
    _, dims = tiny_clip
    prompts, opt, sched = _trained_prompts(1)
    init = export_gram_init(tmp_path / "init.safetensors", prompts, {"ctx": GradientRegulator(64)}, dims)
    dst = export_for_coop(init, tmp_path / "coop_ctx.pth")
    loaded = torch.load(dst, weights_only=True)
    assert set(loaded["state_dict"]) == {"ctx"}
    assert torch.equal(loaded["state_dict"]["ctx"], prompts.ctx.detach())
    assert dst == tmp_path / "coop_ctx_nctx4.pth" and loaded["n_ctx"] == 4  # the N_CTX to set is in the name
    assert export_for_coop(init) == tmp_path / "coop_ctx_nctx4.pth"  # default: beside the init file
    save_checkpoint(tmp_path / "run", "prompt_learner", 1, prompts, opt, sched)
    assert export_main([str(tmp_path / "run"), str(tmp_path / "from_run.pth"), "--epoch", "1"]) == 0
    printed = capsys.readouterr().out
    written = tmp_path / "from_run_nctx4.pth"
    assert f'stock CoOp: MODEL.INIT_WEIGHTS {written} TRAINER.COOP.N_CTX 4 TRAINER.COOP.CTX_INIT ""' in printed
    assert f'stock CoCoOp: MODEL.INIT_WEIGHTS {written} TRAINER.COCOOP.N_CTX 4 TRAINER.COCOOP.CTX_INIT ""' in printed
    again = torch.load(written, weights_only=True)["state_dict"]["ctx"]
    assert torch.equal(again, prompts.ctx.detach())
    vpt_only = export_gram_init(tmp_path / "vpt.safetensors", PromptParams(vpt=torch.zeros(1, 2, 64)), None, dims)
    with pytest.raises(ValueError, match="no text context"):
        export_for_coop(vpt_only, tmp_path / "x.pth")


def test_gramclip_keeps_clip_in_eval_and_predict_equals_forward(tiny_clip):
    clip, dims = tiny_clip
    g = torch.Generator().manual_seed(3)
    prompts = PromptParams(ctx=torch.randn(2, 64, generator=g) * 0.02, vpt=torch.randn(1, 2, 64, generator=g) * 0.02)
    model = GramCLIP(clip, dims, prompts, ["cat", "dog", "red car"])
    model.train()
    assert model.training and model.prompt_learner.training
    assert not any(m.training for m in model.clip.modules())
    images = torch.randn(5, 3, 32, 32, generator=g)
    logits = model(images)
    assert logits.shape == (5, 3)
    (logits.logsumexp(-1).sum()).backward()
    assert prompts.ctx.grad is not None and prompts.vpt.grad is not None
    assert all(p.grad is None for p in model.clip.parameters())
    model.eval()
    assert torch.allclose(model.predict(images), logits.detach(), atol=1e-5)
    with torch.no_grad():
        prompts.ctx.add_(torch.randn(2, 64, generator=g))  # (a constant shift would be LayerNorm-invariant)
    stale = model.predict(images)  # cached text side until reset
    model.reset_cache()
    fresh = model.predict(images)
    assert torch.allclose(fresh, model(images).detach(), atol=1e-5)
    assert not torch.allclose(stale, fresh, atol=1e-4)


@pytest.mark.parametrize("with_vpt", [False, True])
def test_gramclip_runs_a_half_precision_clip_with_fp32_prompts(tiny_clip, with_vpt):
    """PREC fp16 (GPU): the CLIP is fp16, θ and its gradient stay fp32 (checked on CPU, where fp16 also runs)."""
    import copy

    clip, dims = tiny_clip
    half = copy.deepcopy(clip).half()
    g = torch.Generator().manual_seed(5)
    prompts = PromptParams(
        ctx=torch.randn(2, 64, generator=g) * 0.02, vpt=torch.randn(1, 2, 64, generator=g) * 0.02 if with_vpt else None
    )
    model = GramCLIP(half, dims, prompts, ["cat", "dog"])
    images = torch.randn(3, 3, 32, 32, generator=g)  # the loader gives fp32 images
    logits = model(images)
    assert logits.dtype == torch.float16 and logits.shape == (3, 2)
    logits.float().sum().backward()
    assert prompts.ctx.grad.dtype == torch.float32 and torch.isfinite(prompts.ctx.grad).all()
    full = GramCLIP(clip, dims, prompts, ["cat", "dog"])
    assert torch.allclose(logits.float(), full(images).detach(), atol=0.1)


class _Datum:
    def __init__(self, impath, label, classname):
        self.impath, self.label, self.classname = impath, label, classname


def test_sample_digest_is_root_relative_and_order_free(tmp_path):
    a = [_Datum(str(tmp_path / "r1" / "x" / f"{i}.jpg"), i % 2, f"c{i % 2}") for i in range(4)]
    b = [_Datum(str(tmp_path / "r2" / "x" / f"{i}.jpg"), i % 2, f"c{i % 2}") for i in reversed(range(4))]
    assert sample_digest(a, str(tmp_path / "r1")) == sample_digest(b, str(tmp_path / "r2"))
    assert sample_digest(a, str(tmp_path / "r1"))[0] == 4
    c = a[:3] + [_Datum(a[3].impath, 0, "c0")]
    assert sample_digest(c, str(tmp_path / "r1")) != sample_digest(a, str(tmp_path / "r1"))
