"""docs/dassl_plugin.md's CoOp recipe: stock CoOp and CoCoOp started from θ*, in unchanged KaiyangZhou/CoOp.

The fork comes from its source archive (``../shared/upstream``) or a checkout named by
``GRAM_COOP_SRC`` (tests/helpers_forks.py; skipped with a one-line reason without either).  A copy
gets only the lines of the doc's CoOp section; the context file and the options come from the export
tool's own output.  The fork's ``clip._download`` returns a tiny random CLIP saved as an OpenAI-style
state dict (no network here).  Checked: the doc's CoCoOp commands (and the same for CoOp) train on
base classes and ``--eval-only`` evaluates on new classes with Dassl's own checkpoints; the fork's
``parse_test_res.py`` and ours read the logs; a forgotten ``N_CTX`` stops with one line; and stock CoCoOp
starts from the export's ``cocoop_nctx<M>`` checkpoint folder (ctx and meta-net) both ways, training and
``--eval-only``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
import shlex
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

from meta.finetune.init_io import cocoop_checkpoint_usage, export_cocoop_checkpoint, export_gram_init  # noqa: E402
from meta.metatrain.export import COCOOP_EPOCH, cocoop_state  # noqa: E402
from meta.method import cocoop  # noqa: E402
from meta.method.prompts import PromptParams, PromptSpec  # noqa: E402
from trainers.gram.export import main as export_main  # noqa: E402

TINY_EPOCHS = 1
NODES = {"CoOp": "COOP", "CoCoOp": "COCOOP"}
COOP_CONFIG, COOP_EPOCHS = "CoOp/vit_b16_ep50", 50  # CoOp's ViT-B/16 config (the doc's commands are CoCoOp's)
ACCURACY = re.compile(r"^\* accuracy: ([\d.]+)%", re.M)
RESULT = re.compile(r"=> result\n(\* total: .*?\* macro_f1: [\d.]+%)", re.S)  # Dassl's evaluator summary
# A zero learning rate (warm-up included) keeps the weights as loaded: the saved epoch is what was loaded.
ZERO_LR = ["OPTIM.LR", "0.0", "OPTIM.WARMUP_CONS_LR", "0.0"]


def tiny_options(trainer: str) -> list[str]:
    return [
        "INPUT.SIZE",
        "(32, 32)",
        "DATALOADER.NUM_WORKERS",
        "0",
        "OPTIM.MAX_EPOCH",
        str(TINY_EPOCHS),
        "DATASET.NUM_SHOTS",
        "2",
        f"TRAINER.{NODES[trainer]}.PREC",
        "fp32",
    ]


def exported_options(init: Path) -> dict[str, list[str]]:
    """Run the export tool as the doc says; the options it prints, per stock trainer."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export_main([str(init)]) == 0
    out = printed.getvalue()
    return {
        name: shlex.split(next(ln for ln in out.splitlines() if ln.startswith(f"stock {name}: ")).split(": ", 1)[1])
        for name in NODES
    }


def commands_for(trainer: str) -> list[str]:
    """The doc's CoCoOp commands; for CoOp "the same with TRAINER.COOP.*" and CoOp's config."""
    commands = doc_recipe("CoOp").commands
    assert len(commands) == 2 and all("--trainer CoCoOp" in c for c in commands), commands
    if trainer == "CoCoOp":
        return commands
    cocoop_cfg = re.search(r"configs/trainers/(CoCoOp/\w+)\.yaml", commands[0]).group(1)
    return [
        re.sub(r"--load-epoch \d+", f"--load-epoch {COOP_EPOCHS}", c)
        .replace(cocoop_cfg, COOP_CONFIG)
        .replace("--trainer CoCoOp", "--trainer CoOp")
        .replace("TRAINER.COCOOP.", "TRAINER.COOP.")
        for c in commands
    ]


@pytest.fixture(scope="module")
def setup(upstream_fork, tmp_path_factory, tiny_clip):
    clip, dims = tiny_clip
    tmp = tmp_path_factory.mktemp("stock_coop")
    fork = add_gram(upstream_fork("CoOp"), tmp, "CoOp")
    torch.save(clip.state_dict(), tmp / "tiny_clip.pt")  # open_clip's keys are OpenAI's: CoOp's clip builds it
    make_dtd(tmp / "data", n_classes=4, counts={"train": 3, "val": 2, "test": 2})
    init_ctx = torch.randn(4, dims.text_width, generator=torch.Generator().manual_seed(5)) * 0.02
    init = export_gram_init(tmp / "gram_coop" / "gram_init.safetensors", PromptParams(ctx=init_ctx), {}, dims)
    return {"tmp": tmp, "fork": fork, "init": init, "ctx": init_ctx, "clip": clip, "dims": dims}


def run_commands(setup, trainer: str, options: list[str]) -> dict[str, Path]:
    """The base-class training and new-class evaluation commands of ``trainer``, with the exported options."""
    fork, folders = setup["fork"], {}
    for command in commands_for(trainer):
        argv = expand(command, {"DATA": str(setup["tmp"] / "data"), "CTX": options[1]})
        tail = argv[argv.index("MODEL.INIT_WEIGHTS") :]
        assert tail == options, f"the doc's options {tail} differ from what the export tool prints: {options}"
        if "--eval-only" in argv:
            config = yaml.safe_load((fork / arg_value(argv, "--config-file")).read_text())
            assert arg_value(argv, "--load-epoch") == str(config["OPTIM"]["MAX_EPOCH"]), "load the last epoch"
            argv[argv.index("--load-epoch") + 1] = str(TINY_EPOCHS)
            assert fork / arg_value(argv, "--model-dir") == folders["train"]
        r = run_train(fork, argv + tiny_options(trainer), clip_weights=setup["tmp"] / "tiny_clip.pt")
        assert r.returncode == 0, f"{command}\n{failure(r)}"
        folders["eval" if "--eval-only" in argv else "train"] = fork / arg_value(argv, "--output-dir")
    return folders


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, dict[str, Path]]:
    """trainer -> its training and evaluation folders, both trainers started from the exported θ*."""
    options = exported_options(setup["init"])
    return {trainer: run_commands(setup, trainer, options[trainer]) for trainer in sorted(NODES)}


@pytest.mark.parametrize("trainer", sorted(NODES))
def test_stock_trainer_trains_from_the_gram_context_and_evaluates(setup, runs, trainer):
    opts = exported_options(setup["init"])[trainer]
    assert Path(opts[1]).name == "coop_ctx_nctx4.pth"
    folders = runs[trainer]
    log = (folders["train"] / "log.txt").read_text()
    assert f"Successfully loaded pretrained weights from {opts[1]}" in log and "Finish training" in log
    ckpt = torch.load(folders["train"] / "prompt_learner" / f"model.pth.tar-{TINY_EPOCHS}", weights_only=True)
    ctx = ckpt["state_dict"]["prompt_learner.ctx" if "prompt_learner.ctx" in ckpt["state_dict"] else "ctx"]
    assert (ctx - setup["ctx"]).abs().max() < 1e-3  # one warm-up epoch at 1e-5 from θ*: still θ*, not random
    test_log = (folders["eval"] / "log.txt").read_text()
    assert re.search(r"=> result\n\* total: \d+\n\* correct: \d+\n\* accuracy: [\d.]+%", test_log)


def test_the_forks_parser_and_ours_read_the_logs(setup, runs):
    """The doc's parse_test_res.py commands and parse_results.py give the numbers of the CoCoOp logs."""
    fork, folders = setup["fork"], runs["CoCoOp"]
    accuracy = {k: float(ACCURACY.findall((folders[k] / "log.txt").read_text())[-1]) for k in ("train", "eval")}
    commands = doc_recipe("CoOp").parser_commands
    assert len(commands) == 2
    for command, kind in zip(commands, ("train", "eval")):
        argv = expand(command, {})
        assert fork / argv[0] == folders[kind].parent
        r = run_script(fork, "parse_test_res.py", argv)
        assert r.returncode == 0, failure(r)
        assert f"* accuracy: {accuracy[kind]:.2f}% +- 0.00%" in r.stdout, r.stdout
    out = setup["tmp"] / "tables"
    assert parse_results([str(fork / "output"), "--out", str(out), "--strict"]) == 0
    method = f"CoCoOp/{folders['train'].parent.name}"
    row = next(
        row
        for path in out.glob("base2new_shots*.csv")
        for row in csv.DictReader(path.open())
        if row["method"] == method and row["dataset"] == "dtd"
    )
    assert float(row["base_mean"]) == pytest.approx(accuracy["train"])
    assert float(row["new_mean"]) == pytest.approx(accuracy["eval"])


def test_forgotten_n_ctx_stops_with_one_line(setup):
    opts = exported_options(setup["init"])["CoOp"][:2]  # MODEL.INIT_WEIGHTS only: CoOp's N_CTX stays 16
    argv = expand(commands_for("CoOp")[0], {"DATA": str(setup["tmp"] / "data"), "CTX": opts[1]})
    argv = argv[: argv.index("MODEL.INIT_WEIGHTS")] + opts
    argv[argv.index("--output-dir") + 1] = str(setup["tmp"] / "forgot")
    r = run_train(setup["fork"], argv + tiny_options("CoOp"), clip_weights=setup["tmp"] / "tiny_clip.pt")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: MODEL.INIT_WEIGHTS") and "set TRAINER.COOP.N_CTX 4" in last, last


def test_the_scripts_the_doc_names_load_the_epoch_it_says(setup):
    """The doc: CoCoOp's scripts run these commands once the options are appended; their LOADEP=10 fits."""
    scripts = doc_recipe("CoOp").scripts
    assert len(scripts) == 2
    found = {script: script_variables(setup["fork"] / script) for script in scripts}
    assert all(v["TRAINER"] == "CoCoOp" and v["CFG"] == "vit_b16_c4_ep10_batch1_ctxv1" for v in found.values())
    load_epoch = arg_value(expand(doc_recipe("CoOp").commands[1], {"DATA": "d", "CTX": "c"}), "--load-epoch")
    assert [v.get("LOADEP") for v in found.values()].count(load_epoch) == 1, found


def test_stock_cocoop_starts_from_the_exported_ctx_and_meta_net(setup):
    """θ* of the ``cocoop`` learner, exported as ``cocoop_nctx4/prompt_learner/model.pth.tar-0``: stock CoCoOp
    trains one epoch from it (``MODEL.INIT_WEIGHTS``, zero learning rate) and its saved ctx and meta-net are θ*
    exactly; ``--model-dir <folder> --load-epoch 0 --eval-only`` loads the folder and scores what training scored."""
    spec = PromptSpec(learner=cocoop.KEY, n_ctx_text=4)
    theta = PromptParams.from_spec(spec, setup["clip"], setup["dims"], generator=torch.Generator().manual_seed(9))
    folder = setup["tmp"] / "cocoop_nctx4"
    file = export_cocoop_checkpoint(folder, cocoop_state(theta), epoch=COCOOP_EPOCH)
    head, ways = cocoop_checkpoint_usage(folder, 4, COCOOP_EPOCH).split(": ", 1)
    length_opts = shlex.split(head.split("options ", 1)[1])
    assert length_opts == ["TRAINER.COCOOP.N_CTX", "4", "TRAINER.COCOOP.CTX_INIT", ""]
    eval_part, train_part = ways.split(", or ")
    train_opts, eval_args = shlex.split(train_part), shlex.split(eval_part)
    base = expand(commands_for("CoCoOp")[0], {"DATA": str(setup["tmp"] / "data"), "CTX": "unused"})
    base = base[: base.index("MODEL.INIT_WEIGHTS")]
    assert "TRAINER.COCOOP.N_CTX" not in base  # the recipe's own length options come from the usage line alone
    out = {kind: setup["tmp"] / "from_checkpoint" / kind for kind in ("train", "eval")}
    for kind, argv in (("train", base + train_opts + length_opts + ZERO_LR), ("eval", eval_args + base + length_opts)):
        argv[argv.index("--output-dir") + 1] = str(out[kind])
        r = run_train(setup["fork"], argv + tiny_options("CoCoOp"), clip_weights=setup["tmp"] / "tiny_clip.pt")
        assert r.returncode == 0, failure(r)
    train_log, eval_log = ((out[k] / "log.txt").read_text() for k in ("train", "eval"))
    assert f"Successfully loaded pretrained weights from {file.resolve()}" in train_log
    assert "discarded" not in train_log and "Finish training" in train_log
    assert f'Loading weights to prompt_learner from "{folder.resolve() / "prompt_learner" / file.name}"' in eval_log
    saved = torch.load(out["train"] / "prompt_learner" / f"model.pth.tar-{TINY_EPOCHS}", weights_only=True)
    for name, stock in cocoop.STOCK_NAMES.items():
        assert torch.equal(saved["state_dict"][stock], getattr(theta, name).detach()), stock
    trained, evaluated = RESULT.findall(train_log), RESULT.findall(eval_log)
    assert trained and evaluated and evaluated[-1] == trained[-1]  # same weights, same test split: same scores
