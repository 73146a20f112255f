"""base2new.sh -> real Dassl -> parse_results.py, with a stand-in trainer (skips without Dassl).

The GRAM trainers are tested elsewhere; here Dassl's own ``Vanilla`` trainer, registered as
``GRAM_CoOp`` inside a throwaway CoOp-style ``train.py``, produces real Dassl logs and checkpoints,
so the scripts' checkpoint-epoch lookup and the parser's end signals meet the real formats.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dassl
pytest.importorskip("dassl", reason="Dassl is not installed (end-to-end run through real Dassl)")

from helpers import make_dtd  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

STAND_IN_TRAIN = r"""
import argparse, sys
import torch
sys.path.insert(0, {repo!r})
from dassl.config import get_cfg_default
from dassl.engine import TRAINER_REGISTRY, build_trainer
from dassl.engine.dg.vanilla import Vanilla
from dassl.utils import set_random_seed, setup_logger
import datasets
datasets.register_all()

@TRAINER_REGISTRY.register()
class GRAM_CoOp(Vanilla):
    def load_model(self, directory, epoch=None):  # Dassl's own crashes on val_result None (reference §2)
        if not directory:
            return
        for name in self.get_model_names():
            ck = torch.load(f"{{directory}}/{{name}}/model.pth.tar-{{epoch}}", map_location="cpu", weights_only=False)
            state = {{k: v for k, v in ck["state_dict"].items() if not k.startswith("classifier")}}
            self._models[name].load_state_dict(state, strict=False)

p = argparse.ArgumentParser()
for a in ("--root", "--trainer", "--dataset-config-file", "--config-file", "--output-dir", "--model-dir"):
    p.add_argument(a, default="")
p.add_argument("--seed", type=int, default=-1)
p.add_argument("--load-epoch", type=int)
p.add_argument("--eval-only", action="store_true")
p.add_argument("opts", nargs=argparse.REMAINDER)
args = p.parse_args()
cfg = get_cfg_default()
cfg.DATASET.SUBSAMPLE_CLASSES = "all"
cfg.merge_from_file(args.dataset_config_file)
cfg.merge_from_file(args.config_file)
cfg.DATASET.ROOT, cfg.OUTPUT_DIR, cfg.TRAINER.NAME = args.root, args.output_dir, args.trainer
if args.seed:
    cfg.SEED = args.seed
cfg.merge_from_list(args.opts)
cfg.freeze()
set_random_seed(cfg.SEED)
setup_logger(cfg.OUTPUT_DIR)
trainer = build_trainer(cfg)
if args.eval_only:
    trainer.load_model(args.model_dir, epoch=args.load_epoch)
    trainer.test()
else:
    trainer.train()
"""

TRAINER_CFG = """MODEL:
  BACKBONE:
    NAME: "resnet18"
    PRETRAINED: False
INPUT:
  SIZE: (32, 32)
  TRANSFORMS: ["normalize"]
DATALOADER:
  NUM_WORKERS: 0
  TRAIN_X:
    BATCH_SIZE: 4
  TEST:
    BATCH_SIZE: 16
OPTIM:
  NAME: "sgd"
  LR: 0.01
  MAX_EPOCH: 2
"""


@pytest.mark.slow
def test_base2new_through_dassl_then_parser(tmp_path):
    make_dtd(tmp_path / "data", n_classes=4, counts={"train": 6, "val": 2, "test": 3}, real_images=True)
    (tmp_path / "train.py").write_text(STAND_IN_TRAIN.format(repo=str(REPO)))
    configs = tmp_path / "configs"
    (configs / "trainers").mkdir(parents=True)
    (configs / "datasets").mkdir()
    (configs / "datasets" / "dtd.yaml").write_text((REPO / "configs" / "datasets" / "dtd.yaml").read_text())
    (configs / "trainers" / "coop.yaml").write_text(TRAINER_CFG)
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        TRAIN_PY=str(tmp_path / "train.py"),
        CONFIGS=str(configs),
        DATA=str(tmp_path / "data"),
        OUTPUT=str(tmp_path / "out"),
        SHOTS="2",
        OMP_NUM_THREADS="1",
    )
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "base2new.sh"), "coop", "dtd", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "--load-epoch 2" in r.stdout  # read from Dassl's <dir>/model/checkpoint
    train_log = (tmp_path / "out/base2new/train_base/dtd/shots_2/coop/seed1/log.txt").read_text()
    test_log = (tmp_path / "out/base2new/test_new/dtd/shots_2/coop/seed1/log.txt").read_text()
    base = float(re.findall(r"\* accuracy: ([\d.]+)%", train_log.split("Finish training")[1])[-1])
    new = float(re.findall(r"\* accuracy: ([\d.]+)%", test_log.split("=> result")[1])[-1])
    spec = importlib.util.spec_from_file_location("parse_results_e2e", REPO / "scripts" / "parse_results.py")
    pr = importlib.util.module_from_spec(spec)
    sys.modules["parse_results_e2e"] = pr
    spec.loader.exec_module(pr)
    assert pr.main([str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "tables" / "base2new_shots2.csv") as f:
        row = next(r for r in csv.DictReader(f) if r["dataset"] == "dtd")
    assert float(row["base_mean"]) == pytest.approx(base) and float(row["new_mean"]) == pytest.approx(new)
    assert float(row["H"]) == pytest.approx(2 * base * new / (base + new) if base + new else 0.0, abs=1e-3)
    # second call: both jobs skipped, nothing rerun
    again = subprocess.run(
        ["bash", str(REPO / "scripts" / "base2new.sh"), "coop", "dtd", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0 and again.stdout.count("so skip this job") == 2
