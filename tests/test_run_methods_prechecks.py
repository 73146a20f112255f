"""scripts/run_methods.py checks DATA folders, CLIP weights and INIT once, before the first train.py starts.

The scripts run as the user runs them (``bash scripts/base2new.sh``) with the repository's own train.py as
TRAIN_PY (so CHECK_PATHS=auto checks) and a fake interpreter as PYTHON: it hands ``run_methods.py`` to the
real interpreter and only records the train.py command lines, so nothing trains.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import recorded_calls, run_bench_script, run_methods_module

REPO = Path(__file__).resolve().parents[1]
USAGE_LINE = "usage: bash scripts/base2new.sh METHOD [DATASET|all|a,b,c] [SEEDS...] [--] [KEY VALUE ...]"

# PYTHON for the scripts: base2new.sh execs "$PYTHON scripts/run_methods.py" (passed on to this interpreter);
# the runner then starts "$PYTHON train.py ..." (recorded, not run).
FAKE_PYTHON = r"""#!{python}
import json, os, sys
if sys.argv[1].endswith("run_methods.py"):
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])
with open(os.environ["FAKE_RECORD"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
"""

FAKE_TRAIN = "import json, os, sys\nopen(os.environ['FAKE_RECORD'], 'a').write(json.dumps(sys.argv) + '\\n')\n"


@pytest.fixture()
def env(tmp_path):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),  # ~/.cache/clip/ViT-B-16.pt lies here
        "PYTHON": str(fake),
        "DATA": str(tmp_path / "data"),
        "OUTPUT": str(tmp_path / "out"),
        "EPOCHS": "1",
        "FAKE_RECORD": str(tmp_path / "calls.jsonl"),
        "OMP_NUM_THREADS": "1",
    }


def provide(env, datasets=("dtd",), weights=True) -> None:
    for folder in datasets:
        Path(env["DATA"], folder).mkdir(parents=True, exist_ok=True)
    if weights:
        clip = Path(env["HOME"], ".cache", "clip")
        clip.mkdir(parents=True, exist_ok=True)
        (clip / "ViT-B-16.pt").write_bytes(b"not read by the checks")


def run(args, env, script="base2new.sh", **extra):
    return run_bench_script(script, args, env, **extra)


calls = recorded_calls


def assert_stopped(r, env, message: str) -> None:
    """Exit 2, exactly the one line ``error: <message>``, no output folder, train.py never started."""
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [f"error: {message}"], r.stderr
    assert "+ " not in r.stdout  # no command was printed either
    assert not Path(env["OUTPUT"]).exists() and calls(env) == []


@pytest.fixture(scope="module")
def init_file(tmp_path_factory) -> Path:
    """A real GRAM init file for gram_coop's shape (4 text context vectors of ViT-B/16's width 512)."""
    import torch

    from meta.finetune.init_io import export_gram_init
    from meta.method.prompts import PromptParams
    from meta.model.backbone import ClipDims

    dims = ClipDims("ViT-B-16", 512, 768, 512, 77, 12, 12, 224, 196)
    path = tmp_path_factory.mktemp("init") / "gram_init.safetensors"
    return export_gram_init(path, PromptParams(ctx=torch.zeros(4, 512)), None, dims)


def test_missing_dataset_folder_stops_before_anything_runs(env):
    provide(env, datasets=("dtd", "food101"))  # Food101's folder is food-101 (CoOp's layout), not its key
    data = env["DATA"]
    for dry in ("0", "1"):  # DRY_RUN checks too
        r = run(["coop", "dtd,food101", "1"], env, DRY_RUN=dry)
        assert_stopped(
            r,
            env,
            f"dataset 'food101' not found: expected the folder {data}/food-101 "
            f"(DATA={data}; layout: CoOp's DATASETS.md)",
        )
    shutil.rmtree(data)  # no data root at all: the first dataset is named, the root flagged, the rest listed
    r = run(["coop", "all", "1"], env)
    assert_stopped(
        r,
        env,
        f"dataset 'imagenet' not found: expected the folder {data}/imagenet (DATA={data}, which does not exist; "
        "layout: CoOp's DATASETS.md); also missing: caltech101, oxford_pets, stanford_cars, oxford_flowers, "
        "food101, fgvc_aircraft, sun397, dtd, eurosat, ucf101",
    )
    provide(env, datasets=("imagenet", "imagenet-sketch"))  # xdomain: ImageNet + the 4 variants
    r = run(["coop", "1"], env, script="xdomain.sh")
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: dataset 'imagenetv2' not found: expected the folder {data}/imagenetv2 "
    )
    assert r.stderr.rstrip().endswith("also missing: imagenet_a, imagenet_r") and calls(env) == []


def test_missing_clip_weights_stops_before_anything_runs(env, tmp_path):
    provide(env, weights=False)
    default = Path(env["HOME"], ".cache", "clip", "ViT-B-16.pt")
    r = run(["coop", "dtd", "1"], env, DRY_RUN=1)
    assert_stopped(
        r,
        env,
        f"CLIP weights file not found: {default} (TRAINER.GRAM.WEIGHTS is unset: the default for ViT-B/16; put "
        "OpenAI's ViT-B-16.pt there, or pass TRAINER.GRAM.WEIGHTS /path/to/weights.pt after the arguments)",
    )
    # from the trailing options: ~ expanded, as the trainer does
    r = run(["coop", "dtd", "1", "TRAINER.GRAM.WEIGHTS", "~/w/clip.pt"], env)
    assert_stopped(
        r,
        env,
        f"CLIP weights file not found: {env['HOME']}/w/clip.pt (TRAINER.GRAM.WEIGHTS from option TRAINER.GRAM.WEIGHTS)",
    )
    # from the method's config under CONFIGS
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "configs", configs)
    cfg = configs / "trainers" / "coop.yaml"
    text = cfg.read_text()
    assert text.count("\n  GRAM:\n") == 1  # coop.yaml has a TRAINER.GRAM node: add WEIGHTS to it
    cfg.write_text(text.replace("\n  GRAM:\n", "\n  GRAM:\n    WEIGHTS: /no/such/ViT-B-16.pt\n"))
    r = run(["coop", "dtd", "1"], env, CONFIGS=configs)
    assert_stopped(r, env, f"CLIP weights file not found: /no/such/ViT-B-16.pt (TRAINER.GRAM.WEIGHTS from {cfg})")
    # "none" (random weights) needs no file; the option overrides the config's value
    r = run(["coop", "dtd", "1", "TRAINER.GRAM.WEIGHTS", "none"], env, CONFIGS=configs)
    assert r.returncode == 0, r.stderr
    assert len(calls(env)) == 2


def test_init_unset_missing_or_unloadable_stops_before_anything_runs(env, tmp_path):
    provide(env)
    r = run(["gram_coop", "dtd", "1"], env)
    assert_stopped(
        r,
        env,
        "method 'gram_coop' starts from a GRAM init file but INIT is unset: set INIT=/path/to/gram_init.safetensors "
        "(python -m meta export --run-dir <meta-training run> writes it; a placeholder for wiring checks: "
        "python -m gram_tools.smoke --write-init FILE --method gram_coop --model ViT-B-16)",
    )
    # INIT given as a trailing option instead of the variable: same checks, named by its key
    r = run(["gram_coop", "dtd", "1", "TRAINER.GRAM.INIT", str(tmp_path / "nope.safetensors")], env)
    assert_stopped(r, env, f"TRAINER.GRAM.INIT file not found: {tmp_path}/nope.safetensors")
    # INIT=<missing file>: the runner's earlier argument check (message + usage line, as before)
    r = run(["gram_coop", "dtd", "1"], env, INIT=tmp_path / "nope.safetensors")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"INIT file not found: {tmp_path}/nope.safetensors",
        USAGE_LINE,
    ]
    assert not Path(env["OUTPUT"]).exists() and calls(env) == []
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    r = run(["gram_coop", "dtd", "1"], env, INIT=junk, DRY_RUN=1)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    line = r.stderr.rstrip("\n")  # the loader's message (safetensors' own words vary with the bytes), one line
    assert line.startswith(f"error: INIT: {junk}: not a readable safetensors file (")
    assert line.endswith("(expected a GRAM init file, as python -m meta export writes)")
    assert not Path(env["OUTPUT"]).exists() and calls(env) == []
    # a readable safetensors file that is no GRAM init (no "gram" metadata): the loader's message, one line
    import torch
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    r = run(["gram_coop", "dtd", "1"], env, INIT=other)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: INIT: {other}") and "python -m meta export" in r.stderr
    assert not Path(env["OUTPUT"]).exists() and calls(env) == []


def test_the_placeholder_command_the_init_check_offers_writes_an_init_the_jobs_take(env, tmp_path):
    """The INIT-unset line names the architecture the runs build (here the option's GRAM-Test-Tiny); its
    ``python -m gram_tools.smoke --write-init`` command, run as printed, writes a file the check then accepts."""
    from gram_tools import smoke

    provide(env)
    tiny = ["TRAINER.GRAM.MODEL_NAME", "GRAM-Test-Tiny"]
    r = run(["unigram", "dtd", "1", *tiny], env)
    assert r.returncode == 2 and calls(env) == [], r.stderr
    command = r.stderr.rstrip().rpartition("a placeholder for wiring checks: ")[2].removesuffix(")")
    assert command == "python -m gram_tools.smoke --write-init FILE --method unigram --model GRAM-Test-Tiny"
    init = tmp_path / "placeholder.safetensors"
    argv = command.split()[3:]
    argv[argv.index("FILE")] = str(init)
    assert smoke.main(argv) == 0
    r = run(["unigram", "dtd", "1", *tiny], env, INIT=init)
    assert r.returncode == 0, r.stderr
    assert len(calls(env)) == 2  # train + eval, each with the placeholder file
    from meta.finetune.init_io import load_gram_init

    loaded = load_gram_init(init)  # UNIGRAM's 2 text + 2 visual tokens at the tiny CLIP's width 64
    assert {k: tuple(v.shape) for k, v in loaded.prompt.items()} == {"ctx": (2, 64), "vpt": (1, 2, 64)}


def test_everything_present_starts_the_jobs(env, init_file):
    provide(env, datasets=("dtd", "eurosat"))
    r = run(["gram_coop", "dtd,eurosat", "1"], env, INIT=init_file)
    assert r.returncode == 0, r.stderr
    got = calls(env)
    assert len(got) == 4  # train + eval for each dataset
    for argv in got:  # the repository's own train.py, through $PYTHON
        assert argv[0] == str(REPO / "train.py")
        assert argv[argv.index("TRAINER.GRAM.INIT") + 1] == str(init_file)
    assert Path(env["OUTPUT"], "base2new/train_base/dtd/shots_16/gram_coop/seed1/gram_run.txt").is_file()
    # a method without a GRAM file ignores INIT and needs none
    r = run(["coop", "eurosat", "2"], env)
    assert r.returncode == 0 and len(calls(env)) == 2, r.stderr


def test_check_paths_switch(env, tmp_path):
    """auto: no checks for another TRAIN_PY (it may read other paths); 1 forces them; 0 turns them off."""
    fake_train = tmp_path / "fake_train.py"
    fake_train.write_text(FAKE_TRAIN)
    other = dict(env, TRAIN_PY=str(fake_train), PYTHON=sys.executable)  # nothing provided: no data, no weights
    r = run(["coop", "dtd", "1"], other)
    assert r.returncode == 0 and len(calls(env)) == 2, r.stderr
    r = run(["coop", "dtd", "2"], other, CHECK_PATHS=1)
    assert r.returncode == 2 and r.stderr.startswith("error: dataset 'dtd' not found") and calls(env) == []
    r = run(["coop", "dtd", "3"], env, CHECK_PATHS=0)  # the repository's train.py, checks off
    assert r.returncode == 0 and len(calls(env)) == 2, r.stderr
    r = run(["coop", "dtd", "3"], env, CHECK_PATHS="yes")
    assert r.returncode == 2 and r.stderr.splitlines() == ["CHECK_PATHS must be auto, 1 or 0, got 'yes'", USAGE_LINE]


def test_weights_file_is_the_one_the_trainer_resolves(tmp_path, monkeypatch):
    """run_methods resolves the weights with the trainer's own rule (meta.model.clip_weights): the same file."""
    config = pytest.importorskip("trainers.gram.config")
    from yacs.config import CfgNode as CN

    rm = run_methods_module()
    monkeypatch.setenv("HOME", str(tmp_path))
    for backbone, model_name, weights in (
        ("ViT-B/16", "", ""),
        ("ViT-L/14", "", ""),
        ("", "ViT-B-32", ""),
        ("ViT-B/16", "", "~/w/clip.pt"),
        ("ViT-B/16", "", "/abs/clip.safetensors"),
        ("ViT-B/16", "", "None"),
        ("ViT-B/16", "", "random"),
    ):
        cfg = CN()
        cfg.TRAINER = CN()
        cfg.TRAINER.NAME = "GRAM_CoOp"
        cfg.MODEL = CN()
        cfg.MODEL.BACKBONE = CN()
        cfg.MODEL.BACKBONE.NAME = backbone
        config.extend_cfg(cfg)
        cfg.TRAINER.GRAM.MODEL_NAME, cfg.TRAINER.GRAM.WEIGHTS = model_name, weights
        want = config.gram_settings(cfg).weights
        yaml_file = tmp_path / "m.yaml"
        yaml_file.write_text(f'MODEL:\n  BACKBONE:\n    NAME: "{backbone}"\n')
        opts = ["TRAINER.GRAM.MODEL_NAME", model_name, "TRAINER.GRAM.WEIGHTS", weights]
        got, _ = rm.clip_weights_file(rm.ResolvedConfig([yaml_file], opts))
        assert (None if got is None else str(got)) == want, (backbone, model_name, weights)
