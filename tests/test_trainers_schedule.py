"""Dassl-free tests of the per-epoch LR schedule against closed forms (and Dassl's own, when present)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from helpers import lr_per_epoch, optim_cfg
from yacs.config import CfgNode as CN

from trainers.gram.dassl_schedule import build_lr_scheduler


def lrs_per_epoch(cfg: CN, epochs: int) -> list[float]:
    """LR used during each epoch when stepping once per epoch (what the trainers do)."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=cfg.LR, momentum=0.9)
    return lr_per_epoch(opt, build_lr_scheduler(opt, cfg), epochs)


def cosine(base: float, t: float, t_max: float) -> float:
    return base * (1 + math.cos(math.pi * t / t_max)) / 2


def test_constant_warmup_then_cosine_matches_closed_form():
    got = lrs_per_epoch(optim_cfg(), 10)
    want = [1e-5] + [cosine(0.002, e - 1, 10) for e in range(1, 10)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert got[1] == pytest.approx(0.002) and got[9] < got[2] < got[1]


def test_longer_warmup_linear_warmup_and_no_warmup():
    got = lrs_per_epoch(optim_cfg(WARMUP_EPOCH=3, MAX_EPOCH=8), 8)
    assert got == pytest.approx([1e-5] * 3 + [cosine(0.002, e - 3, 8) for e in range(3, 8)], rel=1e-9)
    got = lrs_per_epoch(optim_cfg(WARMUP_EPOCH=4, WARMUP_TYPE="linear", MAX_EPOCH=8), 8)
    assert got == pytest.approx(
        [1e-5, 0.0005, 0.001, 0.0015] + [cosine(0.002, e - 4, 8) for e in range(4, 8)], rel=1e-9
    )
    got = lrs_per_epoch(optim_cfg(WARMUP_EPOCH=0, MAX_EPOCH=5), 5)
    assert got == pytest.approx([cosine(0.002, e, 5) for e in range(5)], rel=1e-9)


def test_step_schedules():
    got = lrs_per_epoch(optim_cfg(LR_SCHEDULER="single_step", STEPSIZE=(3,), WARMUP_EPOCH=0), 7)
    assert got == pytest.approx([0.002] * 3 + [0.0002] * 3 + [0.00002], rel=1e-9)
    got = lrs_per_epoch(optim_cfg(LR_SCHEDULER="multi_step", STEPSIZE=(2, 5), WARMUP_EPOCH=1), 7)
    # after the warm-up the main schedule restarts: milestones count from epoch W = 1
    assert got == pytest.approx([1e-5, 0.002, 0.002, 0.0002, 0.0002, 0.0002, 0.00002], rel=1e-9)


def test_bad_schedule_settings_name_the_key():
    with pytest.raises(ValueError, match="OPTIM.LR_SCHEDULER"):
        lrs_per_epoch(optim_cfg(LR_SCHEDULER="poly"), 1)
    with pytest.raises(ValueError, match="OPTIM.WARMUP_TYPE"):
        lrs_per_epoch(optim_cfg(WARMUP_TYPE="exp"), 1)
    with pytest.raises(ValueError, match="OPTIM.WARMUP_RECOUNT"):
        lrs_per_epoch(optim_cfg(WARMUP_RECOUNT=False), 1)


def test_state_is_weights_only_and_resumes_the_same_sequence():
    cfg = optim_cfg()
    full = lrs_per_epoch(cfg, 10)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=cfg.LR, momentum=0.9)
    sched = build_lr_scheduler(opt, cfg)
    for _ in range(4):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    param2 = torch.nn.Parameter(torch.zeros(2))
    opt2 = torch.optim.SGD([param2], lr=cfg.LR, momentum=0.9)
    sched2 = build_lr_scheduler(opt2, cfg)
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    assert lr_per_epoch(opt2, sched2, 6) == pytest.approx(full[4:], rel=1e-12)


def evaluator_lrs(spec) -> list[float]:
    from meta.evaluation import make_optimizer, make_scheduler

    opt = make_optimizer([torch.nn.Parameter(torch.zeros(2))], spec)
    return lr_per_epoch(opt, make_scheduler(opt, spec), spec.epochs)


EVALUATOR_CASES = [  # (TrainSpec changes, the same schedule as Dassl OPTIM overrides)
    ({}, {}),
    (dict(epochs=6, warmup_epochs=2, warmup_lr=1e-4), dict(MAX_EPOCH=6, WARMUP_EPOCH=2, WARMUP_CONS_LR=1e-4)),
    (dict(epochs=5, warmup_epochs=0, lr=0.01), dict(MAX_EPOCH=5, WARMUP_EPOCH=0, LR=0.01)),
]


@pytest.mark.parametrize("spec_changes, optim_changes", EVALUATOR_CASES)
def test_evaluator_and_trainers_share_one_schedule(spec_changes, optim_changes):
    """meta.evaluation's TrainSpec schedule and the trainers' OPTIM schedule are one implementation
    (meta.finetune.schedule)."""
    from meta.evaluation import TrainSpec

    spec = TrainSpec(**spec_changes)
    assert evaluator_lrs(spec) == pytest.approx(lrs_per_epoch(optim_cfg(**optim_changes), spec.epochs), rel=1e-12)
    assert evaluator_lrs(TrainSpec(epochs=3, scheduler="constant", warmup_epochs=1)) == pytest.approx(
        [1e-5, 0.002, 0.002], rel=1e-12
    )
    assert evaluator_lrs(TrainSpec(epochs=2, lr=0.0, warmup_lr=0.0)) == [0.0, 0.0]
    with pytest.raises(ValueError, match="OPTIM.LR: a warm-up to 1e-05 needs a positive learning rate"):
        evaluator_lrs(TrainSpec(epochs=2, lr=0.0))


@pytest.mark.dassl
def test_same_values_as_dassls_own_scheduler(monkeypatch):
    """Dassl's warm-up classes crash on torch >= 2.7 (``verbose``); with that argument dropped they give our values."""
    lr_scheduler = pytest.importorskip("dassl.optim.lr_scheduler", reason="Dassl not installed")
    from torch.optim.lr_scheduler import LRScheduler, _LRScheduler

    def init_without_verbose(self, optimizer, last_epoch=-1, verbose=None):
        LRScheduler.__init__(self, optimizer, last_epoch)

    monkeypatch.setattr(_LRScheduler, "__init__", init_without_verbose)

    def dassl_lrs(cfg) -> list:
        """The lr of each epoch under Dassl's own scheduler."""
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=cfg.LR)
        return lr_per_epoch(opt, lr_scheduler.build_lr_scheduler(opt, cfg), cfg.MAX_EPOCH)

    for cfg in (
        optim_cfg(),
        optim_cfg(WARMUP_EPOCH=2, MAX_EPOCH=6),
        optim_cfg(WARMUP_TYPE="linear", WARMUP_EPOCH=3),
        optim_cfg(LR_SCHEDULER="multi_step", STEPSIZE=(2, 5), MAX_EPOCH=7),
    ):
        assert lrs_per_epoch(cfg, cfg.MAX_EPOCH) == pytest.approx(dassl_lrs(cfg), rel=1e-9)
    from meta.evaluation import TrainSpec

    for spec_changes, optim_changes in EVALUATOR_CASES:  # the evaluator's schedule is Dassl's too
        assert evaluator_lrs(TrainSpec(**spec_changes)) == pytest.approx(
            dassl_lrs(optim_cfg(**optim_changes)), rel=1e-9
        )
