"""trainers.gram.dassl_compat on Dassl's own code (needs Dassl; no CoOp source).

Runs in a child process, because the module patches Dassl for the whole interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import sys, warnings
import torch
from torch import nn
from yacs.config import CfgNode as CN
from dassl.config import get_cfg_default
from dassl.optim import build_lr_scheduler
from dassl.utils import save_checkpoint
sys.path.insert(0, sys.argv[2])
out = sys.argv[1]
cfg = get_cfg_default().OPTIM
cfg.defrost()
cfg.LR, cfg.MAX_EPOCH, cfg.LR_SCHEDULER, cfg.WARMUP_EPOCH, cfg.WARMUP_TYPE = 0.002, 3, "cosine", 1, "constant"
cfg.WARMUP_CONS_LR = 1e-5
p = nn.Parameter(torch.zeros(4, 8))
opt = torch.optim.SGD([p], lr=cfg.LR)
try:
    build_lr_scheduler(opt, cfg)
    print("BUILD-OK-WITHOUT-COMPAT")
except TypeError as err:
    print("BUILD-TYPEERROR", "verbose" in str(err) or "positional" in str(err))
import trainers.gram.dassl_compat  # noqa: F401  (as the fork's train.py does)
from dassl.utils import load_checkpoint, load_pretrained_weights
sched = build_lr_scheduler(opt, cfg)
lrs = []
for _ in range(3):
    lrs.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
print("LRS", lrs)
save_checkpoint({"state_dict": {"ctx": p.detach()}, "epoch": 3, "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict()}, out, is_best=False)
ckpt = load_checkpoint(out + "/model.pth.tar-3")  # torch's weights_only default: Dassl's own file now loads
sched2 = build_lr_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.LR), cfg)
sched2.load_state_dict(ckpt["scheduler"])
print("RESTORED", sched2.last_epoch, sched2.successor.last_epoch, sched2.successor.T_max,
      sched2.get_last_lr() == sched.get_last_lr())
class Learner(nn.Module):
    def __init__(self, n):
        super().__init__(); self.ctx = nn.Parameter(torch.zeros(n, 8))
torch.save({"state_dict": {"ctx": torch.ones(4, 8)}, "epoch": 0}, out + "/ctx.pth")
m = Learner(4); load_pretrained_weights(m, out + "/ctx.pth"); print("LOADED", bool((m.ctx == 1).all()))
try:
    load_pretrained_weights(Learner(16), out + "/ctx.pth")
except ValueError as err:
    print("MISMATCH", err)
"""


def test_dassl_warmup_checkpoints_and_init_weights_under_compat(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    r = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["BUILD-TYPEERROR"] == "True"  # stock Dassl on torch >= 2.7, before the import
    assert lines["LRS"] == repr([1e-5, 0.002, 0.0015])  # constant warm-up, then cosine restarted (T_max 3)
    assert lines["RESTORED"] == "1 2 3.0 True"  # warm-up done after 1 epoch, the cosine successor stepped twice
    assert lines["LOADED"] == "True"
    assert lines["MISMATCH"].startswith("MODEL.INIT_WEIGHTS ") and "set TRAINER.COOP.N_CTX 4" in lines["MISMATCH"]
    assert "\n" not in lines["MISMATCH"]
