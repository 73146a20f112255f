"""A Dassl run's stderr (Python warnings, this repository's ``warning:`` lines) is in its ``log.txt`` too, and still
on stderr: through ``train.py`` as a user runs it, and through a fork's own ``train.py`` that only calls Dassl's
``setup_logger`` and ``build_trainer`` (the trainers' ``check_cfg`` installs the copy)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dassl", reason="Dassl is not installed")

from dassl.engine import build_trainer  # noqa: E402
from dassl.utils import setup_logger  # noqa: E402
from helpers import make_dtd, tiny_dassl_opts, train_argv  # noqa: E402
from helpers_dassl import restore_stdout  # noqa: E402

import train  # noqa: E402
from trainers.gram.log_tee import StderrToLog  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RANDOM = "CLIP GRAM-Test-Tiny is built with RANDOM weights"  # meta.model.backbone's warnings.warn
SHORT = "class(es) with fewer images than DATASET.NUM_SHOTS 16: 'texture_0' has 2"  # datasets.coop_layout's line


def _args(root: Path, out: Path) -> list[str]:
    return train_argv(root, out, "GRAM_CoOp", "configs/trainers/coop.yaml", *tiny_dassl_opts(shots=16))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    make_dtd(root, n_classes=2, counts={"train": 2, "val": 1, "test": 1}, real_images=False)
    return root


def test_train_py_puts_warnings_into_log_txt_and_keeps_them_on_stderr(data, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--no-train", *_args(data, out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "log.txt").read_text()
    for text in (RANDOM, SHORT):
        assert text in proc.stderr, text
        assert text in log, text
    assert "warning: DescribableTextures: 2 " + SHORT in log  # the whole line, once
    assert log.count(SHORT) == 1


def test_a_forks_train_py_gets_the_copy_from_the_trainer(data, tmp_path, capsys, monkeypatch):
    """CoOp's train.py: ``setup_logger(cfg.OUTPUT_DIR)`` then ``build_trainer(cfg)``, no call of ours: the
    trainer's ``check_cfg`` copies stderr into the log from then on."""
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # restored after the test
    out = tmp_path / "fork_run"
    cfg = train.setup_cfg(train.build_parser().parse_args(_args(data, out)))
    saved = sys.stdout
    try:
        setup_logger(cfg.OUTPUT_DIR)
        build_trainer(cfg)
        assert isinstance(sys.stderr, StderrToLog)
    finally:
        restore_stdout(saved)
    print("after the run", file=sys.stderr)  # no Dassl logger any more: stderr only, no error
    err = capsys.readouterr().err
    log = (out / "log.txt").read_text()
    # (pytest records Python warnings in-process instead of printing them; the train.py test above checks those)
    assert SHORT in err and SHORT in log
    assert "after the run" in err and "after the run" not in log
