"""docs/dassl_plugin.md "Using θ* in stock CoOp / CoCoOp", run on a copy of KaiyangZhou/CoOp.

Needs Dassl and a CoOp checkout named by ``GRAM_COOP_SRC`` (skipped otherwise).  The fork gets the
doc's one ``dassl_compat`` import line; the context file and the options come from the export tool's
own output.  CoOp's ``clip._download`` is pointed at a tiny random CLIP saved as an OpenAI-style
state dict (no network here).  Checked: train on base classes, ``--eval-only`` on new classes with
Dassl's own checkpoints, for CoOp and CoCoOp, and a forgotten ``N_CTX`` stops with one line.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dassl
pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")
COOP_SRC = os.environ.get("GRAM_COOP_SRC", "")
if not COOP_SRC or not (Path(COOP_SRC) / "trainers" / "coop.py").is_file():
    pytest.skip("set GRAM_COOP_SRC to a KaiyangZhou/CoOp checkout to run the stock-CoOp recipe",
                allow_module_level=True)

import torch  # noqa: E402

from meta.init_io import export_gram_init  # noqa: E402
from meta.prompts import PromptParams  # noqa: E402
from helpers import make_dtd  # noqa: E402
from trainers.gram.export import main as export_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "dassl_plugin.md"
RUNNER = '''import runpy, sys
fork, weights = sys.argv[1], sys.argv[2]
sys.path.insert(0, fork)
sys.argv = [fork + "/train.py"] + sys.argv[3:]
from clip import clip as _clip
_clip._download = lambda url, root=None: weights  # test harness only: no network
runpy.run_path(fork + "/train.py", run_name="__main__")
'''
TINY = ["INPUT.SIZE", "(32, 32)", "DATALOADER.NUM_WORKERS", "0", "OPTIM.MAX_EPOCH", "1", "DATASET.NUM_SHOTS", "2"]
TRAINERS = {"CoOp": ("configs/trainers/CoOp/vit_b16_ep50.yaml", "COOP"),
            "CoCoOp": ("configs/trainers/CoCoOp/vit_b16_c4_ep10_batch1_ctxv1.yaml", "COCOOP")}


def doc_import_line() -> str:
    lines = [ln.strip() for ln in DOC.read_text().splitlines() if "dassl_compat" in ln and ln.strip().startswith("import")]
    assert len(set(lines)) == 1, f"the doc should give one dassl_compat import line, found {lines}"
    return lines[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_clip):
    clip, dims = tiny_clip
    tmp = tmp_path_factory.mktemp("stock_coop")
    fork = tmp / "fork"
    shutil.copytree(COOP_SRC, fork, ignore=shutil.ignore_patterns(".git", "output"))
    shutil.copytree(REPO / "trainers" / "gram", fork / "trainers" / "gram")  # doc step 2
    train_py = fork / "train.py"
    text = train_py.read_text()
    assert "import trainers.zsclip\n" in text
    train_py.write_text(text.replace("import trainers.zsclip\n", "import trainers.zsclip\n" + doc_import_line() + "\n"))
    torch.save(clip.state_dict(), tmp / "tiny_clip.pt")
    make_dtd(tmp / "data", n_classes=4, counts={"train": 3, "val": 2, "test": 2})
    init_ctx = torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(5)) * 0.02
    init = export_gram_init(tmp / "gram_coop" / "gram_init.safetensors", PromptParams(ctx=init_ctx), {}, dims)
    (tmp / "runner.py").write_text(RUNNER)
    return {"tmp": tmp, "fork": fork, "init": init, "ctx": init_ctx}


def exported_options(setup, capsys) -> dict[str, list[str]]:
    """Run the export tool as the doc says; the options it prints, per trainer."""
    assert export_main([str(setup["init"])]) == 0
    out = capsys.readouterr().out
    options = {}
    for name in TRAINERS:
        line = next(ln for ln in out.splitlines() if ln.startswith(f"stock {name}: "))
        options[name] = shlex.split(line.split(": ", 1)[1])
    return options


def run_fork(setup, trainer: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    cfg, node = TRAINERS[trainer]
    cmd = [sys.executable, str(setup["tmp"] / "runner.py"), str(setup["fork"]), str(setup["tmp"] / "tiny_clip.pt"),
           "--root", str(setup["tmp"] / "data"), "--seed", "1", "--trainer", trainer,
           "--dataset-config-file", str(setup["fork"] / "configs/datasets/dtd.yaml"),
           "--config-file", str(setup["fork"] / cfg), "--output-dir", str(out), *args,
           *TINY, f"TRAINER.{node}.PREC", "fp32"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=setup["fork"], env=env)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_stock_trainer_trains_from_the_gram_context_and_evaluates(setup, trainer, capsys):
    opts = exported_options(setup, capsys)[trainer]
    assert Path(opts[1]).name == "coop_ctx_nctx4.pth"
    train_dir, test_dir = setup["tmp"] / f"{trainer}_base", setup["tmp"] / f"{trainer}_new"
    r = run_fork(setup, trainer, train_dir, *opts, "DATASET.SUBSAMPLE_CLASSES", "base")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    log = (train_dir / "log.txt").read_text()
    assert f"Successfully loaded pretrained weights from {opts[1]}" in log and "Finish training" in log
    ckpt = torch.load(train_dir / "prompt_learner" / "model.pth.tar-1", weights_only=True)  # Dassl's own file
    ctx = ckpt["state_dict"]["prompt_learner.ctx" if "prompt_learner.ctx" in ckpt["state_dict"] else "ctx"]
    assert (ctx - setup["ctx"]).abs().max() < 1e-3  # one warm-up epoch at 1e-5 from θ*: still θ*, not random
    r = run_fork(setup, trainer, test_dir, "--model-dir", str(train_dir), "--load-epoch", "1", "--eval-only",
                 *opts, "DATASET.SUBSAMPLE_CLASSES", "new")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    test_log = (test_dir / "log.txt").read_text()
    assert re.search(r"=> result\n\* total: \d+\n\* correct: \d+\n\* accuracy: [\d.]+%", test_log)


def test_forgotten_n_ctx_stops_with_one_line(setup, capsys):
    opts = exported_options(setup, capsys)["CoOp"][:2]  # MODEL.INIT_WEIGHTS only: CoOp's N_CTX stays 16
    r = run_fork(setup, "CoOp", setup["tmp"] / "forgot", *opts)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: MODEL.INIT_WEIGHTS") and "set TRAINER.COOP.N_CTX 4" in last, last
