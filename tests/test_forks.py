"""GRAM trainers inside the unchanged MaPLe and PromptSRC forks, exactly as docs/dassl_plugin.md says.

Each fork comes from its source archive (``../shared/upstream``, tests/helpers_forks.py; skipped with
a one-line reason without it).  A copy gets only the lines of its doc section; then the section's own
commands run with the fork's ``train.py`` (train on base classes, ``--eval-only`` on new classes),
with a tiny random CLIP, one epoch and a few images appended as yacs options.  Checked: θ starts at
the θ* of the init file and is trained, the new-class evaluation loads that checkpoint, and both our
``scripts/parse_results.py`` and the fork's own ``parse_test_res.py`` report the accuracies of the logs.
The stock CoOp fork: tests/test_stock_coop_recipe.py.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dassl, pytest.mark.slow]
pytest.importorskip("dassl", reason="Dassl is not installed (scripts/setup.sh --with-dassl)")

import torch  # noqa: E402
import yaml  # noqa: E402
from helpers import make_dtd  # noqa: E402
from helpers_forks import (  # noqa: E402
    add_gram,
    arg_value,
    doc_recipe,
    expand,
    failure,
    parse_results,  # noqa: E402
    run_script,
    run_train,
    script_variables,
)

from meta.finetune.init_io import export_gram_init  # noqa: E402
from meta.method.prompts import PromptParams  # noqa: E402
from meta.method.regulator import GradientRegulator, RegulatorSpec  # noqa: E402

N_CLASSES, COUNTS = 4, {"train": 3, "val": 2, "test": 2}  # make_dtd: class c has COUNTS[split] + c images
BASE, NEW = [0, 1], [2, 3]  # CoOp's base/new split of 4 sorted labels
TINY_EPOCHS = 1
WIDTH = 64  # the tiny CLIP's text and vision widths
PROMPT_SHAPES = {
    "GRAM_CoOp": {"ctx": (4, WIDTH)},
    "GRAM_VPT": {"vpt": (1, 4, WIDTH)},
    "UNIGRAM": {"ctx": (2, WIDTH), "vpt": (1, 2, WIDTH)},  # the configs' token counts (UNIGRAM 2 + 2)
    # deep learners on the tiny CLIP's 2 layers: IVLP's depth 0 = every layer; MaPLe's 9 capped to 2
    "GRAM_IVLP": {"ctx": (2, WIDTH), "ctx_deep": (1, 2, WIDTH), "vpt": (2, 2, WIDTH)},
    "GRAM_MaPLe": {
        "ctx": (2, WIDTH),
        "ctx_deep": (1, 2, WIDTH),
        "proj_weight": (2, WIDTH, WIDTH),
        "proj_bias": (2, WIDTH),
    },
}
TRAINER_OPTIONS = {"GRAM_MaPLe": ["TRAINER.GRAM.TEXT_DEPTH", "2"]}  # the config's 9 > the tiny CLIP's 2 layers
ACCURACY = re.compile(r"^\* accuracy: ([\d.]+)%", re.M)
TOTAL = re.compile(r"^\* total: (\d+)", re.M)


def tiny_options(clip_file: Path) -> list[str]:
    return [
        "TRAINER.GRAM.MODEL_NAME",
        "GRAM-Test-Tiny",
        "TRAINER.GRAM.WEIGHTS",
        str(clip_file),
        "INPUT.SIZE",
        "(32, 32)",
        "DATALOADER.NUM_WORKERS",
        "0",
        "OPTIM.MAX_EPOCH",
        str(TINY_EPOCHS),
        "DATASET.NUM_SHOTS",
        "2",
        # θ* must be visible in the checkpoint below; the default launch step is checked against an
        # independent computation in tests/test_trainers_dassl.py
        "TRAINER.GRAM.LAUNCH",
        "False",
    ]


def make_init(path: Path, trainer: str, dims) -> dict[str, torch.Tensor]:
    """θ* for ``trainer`` (small random prompts) and a non-identity φ per tensor, exported as meta does."""
    assert dims.text_width == dims.vision_width == WIDTH
    g = torch.Generator().manual_seed(7)
    theta = {k: torch.randn(*shape, generator=g) * 0.02 for k, shape in PROMPT_SHAPES[trainer].items()}
    torch.manual_seed(11)
    regs = {k: GradientRegulator(WIDTH, RegulatorSpec(init="normal", init_std=0.2)) for k in theta}
    export_gram_init(
        path,
        PromptParams(**theta),
        regs,
        dims,  # the provenance `python -m meta export` writes
        provenance={"mode": "gram", "tasks": {"k_way": 2, "n_support": 2}, "meta": {"inner_lr": 0.1}},
    )
    return theta


def last_accuracy(log: str) -> float:
    found = ACCURACY.findall(log)
    assert found, "no '* accuracy:' line in the log"
    return float(found[-1])


@pytest.fixture(scope="module", params=["MaPLe", "PromptSRC"])
def fork_run(request, upstream_fork, tmp_path_factory, tiny_clip) -> dict:
    """The fork with GRAM added, and every train / eval-only command of its doc section run once."""
    key = request.param
    source = upstream_fork(key)
    clip, dims = tiny_clip
    tmp = tmp_path_factory.mktemp(f"fork_{key}")
    fork = add_gram(source, tmp, key)
    clip_file = tmp / "tiny_clip.pt"
    torch.save(clip.state_dict(), clip_file)  # open_clip's keys are OpenAI's: the file CoOp-style code loads
    make_dtd(tmp / "data", n_classes=N_CLASSES, counts=COUNTS)
    recipe = doc_recipe(key)
    runs: dict[str, dict] = {}
    for command in recipe.commands:
        argv = expand(command, {"DATA": str(tmp / "data"), "INIT": str(tmp / "init.safetensors")})
        trainer = arg_value(argv, "--trainer")
        run = runs.setdefault(trainer, {"config": fork / arg_value(argv, "--config-file")})
        if "theta" not in run:
            run["theta"] = make_init(tmp / "init.safetensors", trainer, dims)
        if "--eval-only" in argv:
            epochs = yaml.safe_load(run["config"].read_text())["OPTIM"]["MAX_EPOCH"]
            assert arg_value(argv, "--load-epoch") == str(epochs), "the doc must load the config's last epoch"
            argv[argv.index("--load-epoch") + 1] = str(TINY_EPOCHS)
            run["eval"] = fork / arg_value(argv, "--output-dir")
            run["model_dir"] = fork / arg_value(argv, "--model-dir")
        else:
            run["train"] = fork / arg_value(argv, "--output-dir")
        r = run_train(fork, argv + tiny_options(clip_file) + TRAINER_OPTIONS.get(trainer, []))
        assert r.returncode == 0, f"{key}: {command}\n{failure(r)}"
    assert runs, f"docs/dassl_plugin.md section {key}: no 'python train.py' command"
    return {"key": key, "fork": fork, "tmp": tmp, "runs": runs, "recipe": recipe}


def test_trains_from_the_init_on_base_and_evaluates_that_checkpoint_on_new(fork_run):
    for trainer, run in fork_run["runs"].items():
        assert run["model_dir"] == run["train"], "the eval-only command must load the training run's folder"
        log = (run["train"] / "log.txt").read_text()
        assert f"GRAM trainer {trainer}: GRAM on" in log and "Finish training" in log
        assert int(TOTAL.findall(log)[-1]) == sum(COUNTS["test"] + c for c in BASE)
        ckpt = torch.load(run["train"] / "prompt_learner" / f"model.pth.tar-{TINY_EPOCHS}", weights_only=True)
        assert ckpt["state_dict"].keys() == run["theta"].keys()
        for name, start in run["theta"].items():
            moved = (ckpt["state_dict"][name] - start).abs().max().item()
            assert 0 < moved < 1e-3, (trainer, name, moved)  # trained, but from θ* (one warm-up epoch at 1e-5)
        test_log = (run["eval"] / "log.txt").read_text()
        assert re.search(rf"Load \S+model\.pth\.tar-{TINY_EPOCHS} to prompt_learner \(epoch={TINY_EPOCHS}", test_log)
        assert "subsample=new" in test_log
        assert int(TOTAL.findall(test_log)[-1]) == sum(COUNTS["test"] + c for c in NEW)


def test_our_parser_reads_the_forks_layout(fork_run):
    out = fork_run["tmp"] / "tables"
    assert parse_results([str(fork_run["fork"] / "output"), "--out", str(out), "--strict"]) == 0
    rows = [row for path in out.glob("base2new_shots*.csv") for row in csv.DictReader(path.open())]
    for trainer, run in fork_run["runs"].items():
        method = f"{trainer}/{run['config'].stem}"
        row = next(row for row in rows if row["method"] == method and row["dataset"] == "dtd")
        base = last_accuracy((run["train"] / "log.txt").read_text())
        new = last_accuracy((run["eval"] / "log.txt").read_text())
        assert float(row["base_mean"]) == pytest.approx(base) and float(row["new_mean"]) == pytest.approx(new)
        h = 0.0 if base + new == 0 else 2 * base * new / (base + new)
        assert float(row["H"]) == pytest.approx(h, abs=0.01)


def test_the_forks_parser_as_the_doc_says(fork_run):
    """The section's parse_test_res.py commands print each log's accuracy; without --test-log it finds nothing."""
    commands = fork_run["recipe"].parser_commands
    assert commands, f"section {fork_run['key']}: no parse_test_res.py command"
    for command in commands:
        argv = expand(command, {})
        r = run_script(fork_run["fork"], "parse_test_res.py", argv)
        assert r.returncode == 0, failure(r)
        folder = fork_run["fork"] / argv[0]
        assert argv[1:] == ["--test-log"]  # this fork's end signal for training logs is not what Dassl prints
        accuracy = last_accuracy((folder / "seed1" / "log.txt").read_text())
        assert f"* accuracy: {accuracy:.2f}% +- 0.00%" in r.stdout, r.stdout
    r = run_script(fork_run["fork"], "parse_test_res.py", [expand(commands[0], {})[0]])
    assert r.returncode != 0 and "AssertionError: Nothing found in" in r.stderr, failure(r)


def test_the_scripts_the_doc_names_have_the_variables_it_says_to_set(fork_run):
    scripts = fork_run["recipe"].scripts
    assert scripts and len(scripts) % 2 == 0, scripts  # base-to-new scripts come in train / test pairs
    for script in scripts:
        assert script_variables(fork_run["fork"] / script).keys() >= {"TRAINER", "CFG"}, script
