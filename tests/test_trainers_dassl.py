"""The GRAM Dassl trainers end to end on a tiny synthetic DTD (needs Dassl; skipped without it).

One module-scoped base-to-new experiment (``train.py`` in process, output laid out as
``scripts/base2new.sh`` writes it) for GRAM_CoOp / GRAM_VPT / UNIGRAM with GRAM on and off plus
zero-shot CLIP, then checks of its logs, checkpoints and the results parser; and direct checks of
the regulated update, eval-only loading for new classes, resume, registration and errors.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import re
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.dassl
pytest.importorskip("dassl", reason="Dassl not installed: the Dassl trainer tests need Dassl.pytorch")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dassl.engine import TRAINER_REGISTRY, build_trainer  # noqa: E402
from dassl.utils import Logger, load_pretrained_weights  # noqa: E402
from dassl.utils import load_checkpoint as dassl_load_checkpoint  # noqa: E402
from helpers import make_dtd, tiny_dassl_opts  # noqa: E402
from torch import nn  # noqa: E402

import train  # noqa: E402
from meta.finetune.init_io import InitMismatchError, export_gram_init, load_gram_init  # noqa: E402
from meta.method import methods  # noqa: E402
from meta.method.prompts import PromptParams  # noqa: E402
from meta.method.regulator import GradientRegulator, RegulatorSpec  # noqa: E402
from trainers.gram.export import export_for_coop  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
N_CLASSES, COUNTS, SHOTS = 4, {"train": 3, "val": 2, "test": 2}, 2  # make_dtd: class c has COUNTS[s] + c images
BASE, NEW = [0, 1], [2, 3]  # CoOp's split of 4 sorted labels: first ceil(4/2) are base
TINY = tiny_dassl_opts(shots=SHOTS)
METHODS = {
    k: (methods.get(k).trainer, methods.get(k).gram_file)  # key -> (trainer, GRAM on), trained ones
    for k in methods.dassl_keys()
    if not methods.get(k).zero_shot
}
PROMPT_SHAPES = {
    "GRAM_CoOp": {"ctx": (4, 64)},
    "GRAM_VPT": {"vpt": (1, 4, 64)},
    "UNIGRAM": {"ctx": (2, 64), "vpt": (1, 2, 64)},  # configs: 4 tokens; UNIGRAM 2 + 2
    # IVLP 2 + 2 in every layer of the tiny CLIP's 2-layer towers; MaPLe 2 tokens at depth 2
    "GRAM_IVLP": {"ctx": (2, 64), "vpt": (2, 2, 64), "ctx_deep": (1, 2, 64)},
    "GRAM_MaPLe": {"ctx": (2, 64), "ctx_deep": (1, 2, 64), "proj_weight": (2, 64, 64), "proj_bias": (2, 64)},
    # CoCoOp: 4 context vectors and the meta-net 64 -> 64 // 16 -> 64 (meta/method/cocoop.py)
    "GRAM_CoCoOp": {
        "ctx": (4, 64),
        "meta_net_linear1_weight": (4, 64),
        "meta_net_linear1_bias": (4,),
        "meta_net_linear2_weight": (64, 4),
        "meta_net_linear2_bias": (64,),
    },
}
PROMPT_LEARNER = {"GRAM_CoCoOp": "cocoop"}  # the trainers whose θ is not the built-in learner's
# the MaPLe configs' PROMPT_DEPTH 9 does not fit the tiny CLIP's 2 text layers
TINY_EXTRA = {"GRAM_MaPLe": ["TRAINER.GRAM.TEXT_DEPTH", "2"]}


def tiny(method: str) -> list[str]:
    """The tiny-model options for ``method`` (TINY plus what its trainer's config needs on the tiny CLIP)."""
    return TINY + TINY_EXTRA.get(methods.get(method).trainer, [])


def config_lr(method: str) -> float:
    import yaml

    return float(yaml.safe_load((REPO / methods.get(method).config).read_text())["OPTIM"]["LR"])


ACCURACY = re.compile(r"^\* accuracy: ([\d.]+)%", re.M)
TOTAL = re.compile(r"^\* total: (\d+)", re.M)


ENV_INFO = "(system info: not collected by tests/test_trainers_dassl.py)"


def run_train_py(argv: list[str]) -> None:
    """``python train.py argv`` in this process; undo Dassl's stdout tee afterwards.

    The log's system info (Dassl's ``collect_env_info``: ``pip list``, compiler and driver versions, in
    subprocesses) is a fixed line here: it took 1.4 of the ~1.9 s of each of the ~50 runs, and no check reads it
    (the train.py runs in subprocesses, tests/test_smoke_fork.py and the forks' tests, collect it as users do)."""
    saved, collect = sys.stdout, train.collect_env_info
    train.collect_env_info = lambda: ENV_INFO
    try:
        train.cli(argv)
    finally:
        train.collect_env_info = collect
        tee, sys.stdout = sys.stdout, saved
        while isinstance(tee, Logger):
            if tee.file is not None:
                tee.file.close()
                tee.file = None
            tee.console, tee = io.StringIO(), tee.console  # its __del__ must not close the real stdout


def images_per_class(split: str, labels: list[int]) -> int:
    return sum(COUNTS[split] + c for c in labels)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    make_dtd(root, n_classes=N_CLASSES, counts=COUNTS)
    return root


# what `python -m meta export` records and the default test-time switches read: the support size (regulation
# window 0 = 2 ways x 2 shots) and the inner step (launch)
PROVENANCE = {"mode": "gram", "tasks": {"k_way": 2, "n_support": 2}, "meta": {"inner_lr": 0.1, "inner_steps": 1}}
PER_IMAGE = ("TRAINER.GRAM.REG_WINDOW_IMAGES", "1", "TRAINER.GRAM.LAUNCH", "False")  # the paper-literal test time:
# R_φ on every batch (a window of 1 image is one whole batch)


@pytest.fixture(scope="module")
def init_files(tmp_path_factory, tiny_clip) -> dict[str, Path]:
    """A GRAM init per trainer (θ* and a non-identity φ), exported as the meta side does."""
    _, dims = tiny_clip
    folder = tmp_path_factory.mktemp("inits")
    g = torch.Generator().manual_seed(7)
    spec = RegulatorSpec(init="normal", init_std=0.2)
    out = {}
    for trainer, shapes in PROMPT_SHAPES.items():
        tensors = {k: torch.randn(*s, generator=g) * 0.02 for k, s in shapes.items()}
        torch.manual_seed(11)
        regs = {k: GradientRegulator(s[-1], spec) for k, s in shapes.items()}
        theta = PromptParams(PROMPT_LEARNER.get(trainer, "clip"), **tensors)
        out[trainer] = export_gram_init(folder / f"{trainer}.safetensors", theta, regs, dims, provenance=PROVENANCE)
    return out


def common_args(data_root: Path, method: str, seed: int = 1) -> list[str]:
    row = methods.get(method)
    return [
        "--root",
        str(data_root),
        "--seed",
        str(seed),
        "--trainer",
        row.trainer,
        "--dataset-config-file",
        str(REPO / "configs/datasets/dtd.yaml"),
        "--config-file",
        str(REPO / row.config),
    ]


def gram_opts(method: str, init_files) -> list[str]:
    trainer, on = METHODS[method]
    return ["TRAINER.GRAM.INIT", str(init_files[trainer])] if on else []


def write_run_info(run_dir: Path, mode: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "gram_run.txt").write_text(f"hash test\nmode {mode}\n")  # as scripts/run_methods.py writes it


@pytest.fixture(scope="module")
def experiment(tmp_path_factory, data_root, init_files) -> Path:
    """Base-to-new for every method key (seed 1, 1 epoch), laid out as scripts/base2new.sh writes it."""
    out = tmp_path_factory.mktemp("output")
    for method in METHODS:
        train_dir = out / f"base2new/train_base/dtd/shots_{SHOTS}/{method}/seed1"
        test_dir = out / f"base2new/test_new/dtd/shots_{SHOTS}/{method}/seed1"
        write_run_info(train_dir, "train")
        run_train_py(
            common_args(data_root, method)
            + ["--output-dir", str(train_dir)]
            + tiny(method)
            + gram_opts(method, init_files)
            + ["DATASET.SUBSAMPLE_CLASSES", "base"]
        )
        write_run_info(test_dir, "eval")
        run_train_py(
            common_args(data_root, method)
            + ["--output-dir", str(test_dir), "--model-dir", str(train_dir), "--load-epoch", "1", "--eval-only"]
            + tiny(method)
            + gram_opts(method, init_files)
            + ["DATASET.SUBSAMPLE_CLASSES", "new"]
        )
    for side, sub in (("base", "train_base"), ("new", "test_new")):  # zero-shot CLIP: eval-only both halves
        run_dir = out / f"base2new/{sub}/dtd/shots_{SHOTS}/zsclip/seed1"
        write_run_info(run_dir, "eval")
        run_train_py(
            common_args(data_root, "zsclip")
            + ["--output-dir", str(run_dir), "--eval-only"]
            + TINY
            + ["DATASET.SUBSAMPLE_CLASSES", side]
        )
    return out


def run_dirs(out: Path, method: str) -> tuple[Path, Path]:
    return (
        out / f"base2new/train_base/dtd/shots_{SHOTS}/{method}/seed1",
        out / f"base2new/test_new/dtd/shots_{SHOTS}/{method}/seed1",
    )


# ------------------------------------------------------------------------------------------ registry / cfg
def test_one_import_registers_all_three_and_a_second_import_path_does_not_crash(monkeypatch):
    import trainers  # noqa: F401

    for name in ("GRAM_CoOp", "GRAM_VPT", "UNIGRAM", "GRAM_IVLP", "GRAM_MaPLe"):
        assert getattr(TRAINER_REGISTRY.get(name), "gram_trainer", False)
    monkeypatch.setattr(TRAINER_REGISTRY, "_obj_map", dict(TRAINER_REGISTRY._obj_map))
    spec = importlib.util.spec_from_file_location(
        "copied_gram", REPO / "trainers/gram/__init__.py", submodule_search_locations=[str(REPO / "trainers/gram")]
    )
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "copied_gram", module)
    spec.loader.exec_module(module)  # the same package under a second name, as in a fork's copy
    assert TRAINER_REGISTRY.get("UNIGRAM") is module.UNIGRAM
    module.register_trainers()  # and again

    class UNIGRAM:  # a fork's unrelated trainer of the same name is never replaced silently
        pass

    TRAINER_REGISTRY._obj_map["UNIGRAM"] = UNIGRAM
    with pytest.raises(KeyError, match="already holds a different 'UNIGRAM'"):
        module.register_trainers()


@pytest.mark.parametrize("method", sorted(METHODS) + ["zsclip"])
def test_method_configs_merge_into_dassls_defaults(method):
    args = train.build_parser().parse_args(common_args(Path("/data"), method))
    cfg = train.setup_cfg(args)
    # the MaPLe repository's protocol (5 epochs, batch 4) for its learners; CoCoOp's own folder keeps the paper's
    fork = methods.get(method).trainer in ("GRAM_IVLP", "GRAM_MaPLe")
    assert (cfg.OPTIM.MAX_EPOCH, cfg.DATALOADER.TRAIN_X.BATCH_SIZE) == ((5, 4) if fork else (10, 1))
    assert cfg.DATASET.NAME == "DescribableTextures" and cfg.SEED == 1


def test_train_py_honours_seed_zero():
    parser = train.build_parser()
    assert train.setup_cfg(parser.parse_args(["--seed", "0"])).SEED == 0  # CoOp's `if args.seed:` dropped it
    assert train.setup_cfg(parser.parse_args([])).SEED == -1  # Dassl's default stays without --seed
    assert train.setup_cfg(parser.parse_args(["--seed", "3", "SEED", "5"])).SEED == 5  # KEY VALUE last, as CoOp


# ------------------------------------------------------------------------------------------ the experiment
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_base_to_new_logs_and_checkpoints(experiment, method, init_files):
    trainer, on = METHODS[method]
    train_dir, test_dir = run_dirs(experiment, method)
    train_log = (train_dir / "log.txt").read_text()
    assert "Finish training" in train_log
    assert f"GRAM trainer {trainer}: GRAM {'on' if on else 'off (baseline)'}" in train_log
    assert "precision=fp32 (asked fp16)" in train_log  # the configs ask fp16; CPU runs fp32
    assert re.search(
        r"GRAM data: DescribableTextures subsample=base shots=2 seed=1 classes=2 train_x=4 "
        r"sha256=[0-9a-f]{64}",
        train_log,
    )
    regulated = sorted(PROMPT_SHAPES[trainer]) if methods.get(method).regulate else []
    assert f"regulated tensors {regulated}, " in train_log
    # 2 classes x 2 shots in batches of 2: the LR steps once, at the last batch (warm-up 1e-5 -> the config's LR)
    assert "batch [1/2]" in train_log and "lr 1.0000e-05" in train_log and f"lr {config_lr(method):.4e}" in train_log
    assert int(TOTAL.findall(train_log)[-1]) == images_per_class("test", BASE)

    ckpt_path = train_dir / "prompt_learner" / "model.pth.tar-1"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()} == PROMPT_SHAPES[trainer]
    assert ckpt["epoch"] == 1 and ckpt["gram"]["trainer"] == trainer
    assert dassl_load_checkpoint(str(ckpt_path))["epoch"] == 1  # stock Dassl's loader reads it too (torch 2.14)
    row = methods.get(method)
    launched = on and not row.one_step  # the default launch step; one-step rows keep the paper's start
    assert ("GRAM launch: θ <- θ − α " in train_log) == launched
    if launched:  # the log line says what runs: R_φ's gradient, or the raw one on θ*-only rows
        said = "R_φ(mean train gradient)" if row.regulate else "mean train gradient (R_φ off)"
        assert f"GRAM launch: θ <- θ − α {said}, α=0.1 steps=1 weight decay=0.0" in train_log
    support = PROVENANCE["tasks"]["k_way"] * PROVENANCE["tasks"]["n_support"]  # images; batches of 2 here
    window = (1 if row.one_step else support // 2) if row.regulate else 1
    assert f"regulation window {window}, launch step {'on' if launched else 'off'}" in train_log
    if on and not launched:  # one epoch at the warm-up LR (1e-5) barely moves θ away from θ*
        init = load_gram_init(init_files[trainer]).prompt
        for k, v in ckpt["state_dict"].items():  # (θ* entries are ~N(0, 0.02²): a fresh θ would be far off)
            assert (v - init[k]).abs().max() < 1e-3 and not torch.equal(v, init[k])

    test_log = (test_dir / "log.txt").read_text()
    assert f"Load {ckpt_path} to prompt_learner (epoch=1, val_result=-)" in test_log
    assert "subsample=new" in test_log and "Finish training" not in test_log
    assert int(TOTAL.findall(test_log)[-1]) == images_per_class("test", NEW)
    assert ACCURACY.search(test_log.split("=> result")[-1])


@pytest.mark.slow
def test_zero_shot_runs_without_a_model_dir(experiment):
    for run_dir in run_dirs(experiment, "zsclip"):
        log = (run_dir / "log.txt").read_text()
        assert "load_model() is skipped" in log and "=> result" in log
        assert not (run_dir / "prompt_learner").exists()


@pytest.mark.slow
def test_results_parser_on_the_produced_logs(experiment, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("parse_results", REPO / "scripts/parse_results.py")
    parser = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "parse_results", parser)  # its dataclasses look their module up
    spec.loader.exec_module(parser)
    assert parser.main([str(experiment), "--out", str(tmp_path), "--strict"]) == 0
    rows = {
        r["method"]: r for r in csv.DictReader(open(tmp_path / f"base2new_shots{SHOTS}.csv")) if r["dataset"] == "dtd"
    }
    assert set(rows) == set(METHODS) | {"zsclip"}
    for method, row in rows.items():
        train_dir, test_dir = run_dirs(experiment, method)
        base = float(ACCURACY.findall((train_dir / "log.txt").read_text())[-1])
        new = float(ACCURACY.findall((test_dir / "log.txt").read_text())[-1])
        assert float(row["base_mean"]) == pytest.approx(base, abs=1e-4)
        assert float(row["new_mean"]) == pytest.approx(new, abs=1e-4)
        expected_h = 0.0 if base + new == 0 else 2 * base * new / (base + new)
        assert float(row["H"]) == pytest.approx(expected_h, abs=1e-3)
    assert (tmp_path / f"base2new_shots{SHOTS}_H.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------ direct checks
def build(data_root: Path, method: str, *opts: str, init_files=None, subsample: str = "base"):
    args = train.build_parser().parse_args(
        common_args(data_root, method)
        + tiny(method)
        + (gram_opts(method, init_files) if init_files else [])
        + ["DATASET.SUBSAMPLE_CLASSES", subsample, *opts]
    )
    torch.manual_seed(0)
    return build_trainer(train.setup_cfg(args))


@pytest.mark.parametrize("method", ["gram_coop", "gram_vpt", "unigram", "gram_ivlp", "gram_maple"])
def test_training_step_applies_r_phi_to_the_gradient(data_root, init_files, method):
    """θ' = θ - lr · R_φ(∇θ L) with θ, φ from the init file (paper Eq. 7 at test time)."""
    trainer_name, _ = METHODS[method]
    trainer = build(
        data_root,
        method,
        "OPTIM.WARMUP_EPOCH",
        "0",
        "OPTIM.LR",
        "0.5",
        "OPTIM.MOMENTUM",
        "0.0",
        "OPTIM.WEIGHT_DECAY",
        "0.0",
        *PER_IMAGE,
        init_files=init_files,
    )
    init = load_gram_init(init_files[trainer_name])
    theta = dict(trainer.model.prompt_learner.named_parameters())
    for k, v in init.prompt.items():  # θ starts exactly at θ*
        assert torch.equal(theta[k].detach(), v)
    batch = next(iter(trainer.train_loader_x))
    images, labels = batch["img"], batch["label"]
    names = sorted(theta)
    grads = torch.autograd.grad(F.cross_entropy(trainer.model(images), labels), [theta[k] for k in names])
    regs = init.regulator_modules()
    before = {k: theta[k].detach().clone() for k in names}
    trainer.set_model_mode("train")
    trainer.batch_idx, trainer.num_batches = 0, 2  # not the last batch: no LR step in between
    trainer.forward_backward(batch)
    for k, g in zip(names, grads):
        with torch.no_grad():
            regulated = regs[k](g)
        assert (regulated - g).abs().max() > 0.05 * g.abs().max()  # φ is far from the identity
        assert torch.allclose(theta[k].detach(), before[k] - 0.5 * regulated, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(theta[k].detach(), before[k] - 0.5 * g, atol=1e-6, rtol=1e-5)


def test_window_and_launch_in_the_trainer(data_root, init_files, tiny_clip, tmp_path):
    """TRAINER.GRAM.REG_WINDOW_IMAGES 4 (two batches of 2): no step after the first batch, then
    θ -= lr · 2 R_φ(mean of the two gradients); 0 = the init file's k_way × n_support images in batches;
    LAUNCH: θ* − α R_φ(mean train gradient); the old REG_WINDOW (batches) is a one-line error."""
    plain = load_gram_init(init_files["GRAM_CoOp"])
    path = tmp_path / "with_provenance.safetensors"
    export_gram_init(
        path,
        PromptParams(**plain.prompt),
        plain.regulator_modules(),
        tiny_clip[1],
        provenance={"tasks": {"k_way": 3, "n_support": 2}, "meta": {"inner_lr": 0.3, "inner_steps": 1}},
    )
    opts = ("OPTIM.WARMUP_EPOCH", "0", "OPTIM.LR", "0.5", "OPTIM.MOMENTUM", "0.0", "OPTIM.WEIGHT_DECAY", "0.0")
    trainer = build(
        data_root,
        "gram_coop",
        *opts,
        "TRAINER.GRAM.REG_WINDOW_IMAGES",
        "4",
        "TRAINER.GRAM.LAUNCH",
        "False",
        init_files=init_files,
    )
    assert trainer.window.size == 2
    ctx, reg = trainer.model.prompt_learner.ctx, plain.regulator_modules()["ctx"]
    batches = iter(trainer.train_loader_x)
    b1, b2 = next(batches), next(batches)
    grads = [torch.autograd.grad(F.cross_entropy(trainer.model(b["img"]), b["label"]), [ctx])[0] for b in (b1, b2)]
    before = ctx.detach().clone()
    trainer.set_model_mode("train")
    trainer.batch_idx, trainer.num_batches = 0, 4
    trainer.forward_backward(b1)
    assert torch.equal(ctx.detach(), before)  # window still open
    trainer.batch_idx = 1
    trainer.forward_backward(b2)
    with torch.no_grad():
        expected = before - 0.5 * 2 * reg((grads[0] + grads[1]) / 2)
    torch.testing.assert_close(ctx.detach(), expected, atol=1e-6, rtol=1e-5)

    gram = ["TRAINER.GRAM.INIT", str(path), "TRAINER.GRAM.ENABLED", "True"]
    trainer = build(
        data_root, "gram_coop", *opts, "TRAINER.GRAM.REG_WINDOW_IMAGES", "0", "TRAINER.GRAM.LAUNCH", "True", *gram
    )
    assert trainer.window.size == 3 and trainer.launch_step.alpha == 0.3  # 3 x 2 support images, batches of 2
    ctx = trainer.model.prompt_learner.ctx
    start = ctx.detach().clone()
    loss = trainer._launch()
    trainer.model.reset_cache()
    # independent: the mean cross-entropy over every train image (test transform), one regulated α-step
    from dassl.data.data_manager import build_data_loader
    from dassl.data.transforms import build_transform

    with torch.no_grad():
        ctx.copy_(start)
    loader = build_data_loader(
        trainer.cfg,
        sampler_type="SequentialSampler",
        data_source=trainer.dm.dataset.train_x,
        batch_size=1000,
        tfm=build_transform(trainer.cfg, is_train=False),
        is_train=False,
    )
    (batch,) = list(loader)
    mean_ce = F.cross_entropy(trainer.model(batch["img"]), batch["label"])
    (g,) = torch.autograd.grad(mean_ce, [ctx])
    assert loss == pytest.approx(float(mean_ce.detach()), rel=1e-5)
    with torch.no_grad():
        expected = start - 0.3 * reg(g)
    trainer.model.reset_cache()
    trainer._launch()
    torch.testing.assert_close(ctx.detach(), expected, atol=1e-6, rtol=1e-5)

    bare = tmp_path / "bare.safetensors"
    export_gram_init(bare, PromptParams(**plain.prompt), plain.regulator_modules(), tiny_clip[1])
    with pytest.raises(ValueError, match="TRAINER.GRAM.INIT .*provenance.tasks"):
        build(
            data_root,
            "gram_coop",
            "TRAINER.GRAM.REG_WINDOW_IMAGES",
            "0",
            "TRAINER.GRAM.LAUNCH",
            "False",
            "TRAINER.GRAM.INIT",
            str(bare),
        )
    with pytest.raises(
        ValueError,
        match=r"TRAINER.GRAM.REG_WINDOW: renamed TRAINER.GRAM.REG_WINDOW_IMAGES, which "
        r"counts images",
    ):
        build(data_root, "gram_coop", "TRAINER.GRAM.REG_WINDOW", "2", init_files=init_files)


@pytest.mark.parametrize(
    "reg_only_key, baseline_key",
    [("gram_coop_reg_only", "coop"), ("gram_ivlp_reg_only", "ivlp"), ("gram_maple_reg_only", "maple")],
)
def test_r_phi_only_starts_from_the_baselines_theta(data_root, init_files, reg_only_key, baseline_key):
    """TRAINER.GRAM.INIT_PROMPTS False: θ is the baseline's start (same seed; the deep baselines' word-initialised
    "a photo" context included), R_φ the file's."""
    reg_only = build(data_root, reg_only_key, *PER_IMAGE, init_files=init_files)
    baseline = build(data_root, baseline_key)
    assert reg_only.regulation is not None and baseline.regulation is None
    ours, theirs = (dict(t.model.prompt_learner.named_parameters()) for t in (reg_only, baseline))
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name].detach(), theirs[name].detach())
    star = load_gram_init(init_files[METHODS[reg_only_key.replace("_reg_only", "")][0]]).prompt["ctx"]
    assert (ours["ctx"].detach() - star).abs().max() > 1e-2


def _assert_prompts_equal(trainer, prompt: dict) -> None:
    """Every tensor of the trainer's prompt learner equals ``prompt``'s, bit for bit (and no key is missing)."""
    state = trainer.model.prompt_learner.state_dict()
    assert set(state) == set(prompt)
    for k, v in state.items():
        assert torch.equal(v, prompt[k]), k


def test_regulate_off_keeps_the_init_but_not_the_regulator(data_root, init_files, tiny_clip, tmp_path):
    trainer = build(data_root, "unigram", "TRAINER.GRAM.REGULATE", "False", init_files=init_files)
    assert trainer.regulation is None
    init = load_gram_init(init_files["UNIGRAM"]).prompt
    _assert_prompts_equal(trainer, init)
    # unigram_no_reg (Table 4's "- gradient regulating") takes a θ* meta-trained without R_φ: a file with no φ
    no_phi = export_gram_init(
        tmp_path / "no_phi.safetensors", PromptParams(**init), None, tiny_clip[1], provenance=PROVENANCE
    )
    assert not load_gram_init(no_phi).regulators
    trainer = build(data_root, "unigram_no_reg", "TRAINER.GRAM.INIT", str(no_phi))
    assert trainer.regulation is None and not trainer.cfg.TRAINER.GRAM.REGULATE
    _assert_prompts_equal(trainer, init)
    with pytest.raises(ValueError, match="REGULATE=True but .*no_phi.safetensors holds no regulator"):
        build(data_root, "unigram", "TRAINER.GRAM.INIT", str(no_phi))


def test_baseline_step_is_plain_sgd(data_root):
    trainer = build(
        data_root,
        "coop",
        "OPTIM.WARMUP_EPOCH",
        "0",
        "OPTIM.LR",
        "0.5",
        "OPTIM.MOMENTUM",
        "0.0",
        "OPTIM.WEIGHT_DECAY",
        "0.0",
    )
    assert trainer.regulation is None
    ctx = trainer.model.prompt_learner.ctx
    batch = next(iter(trainer.train_loader_x))
    (g,) = torch.autograd.grad(F.cross_entropy(trainer.model(batch["img"]), batch["label"]), [ctx])
    before = ctx.detach().clone()
    trainer.batch_idx, trainer.num_batches = 0, 2
    trainer.forward_backward(batch)
    assert torch.allclose(ctx.detach(), before - 0.5 * g, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["unigram", "gram_ivlp", "gram_maple"])
@pytest.mark.parametrize("prec", ["fp16", "amp"])
def test_cuda_precision_paths_regulate_the_true_gradient(data_root, init_files, prec, method):
    """PREC fp16 (fp16 CLIP) and amp (autocast + GradScaler: scale, unscale, regulate, step) on CUDA."""
    trainer = build(
        data_root,
        method,
        "OPTIM.WARMUP_EPOCH",
        "0",
        "OPTIM.LR",
        "0.5",
        "OPTIM.MOMENTUM",
        "0.0",
        "OPTIM.WEIGHT_DECAY",
        "0.0",
        "TRAINER.GRAM.PREC",
        prec,
        *PER_IMAGE,
        init_files=init_files,
    )
    assert trainer.device.type == "cuda" and trainer.precision == prec
    assert (trainer.scaler is not None) == (prec == "amp")
    if prec == "amp":  # a moderate scale: the default 2^16 may overflow on the first step and skip it
        trainer.scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    theta = dict(trainer.model.prompt_learner.named_parameters())
    names = sorted(theta)
    assert all(theta[k].dtype == torch.float32 for k in names)  # θ stays fp32 under both
    batch = next(iter(trainer.train_loader_x))
    images, labels = trainer.parse_batch_train(batch)
    with trainer._autocast():
        logits = trainer.model(images).float()
    # the true gradient as amp sees it: the loss scaled as the GradScaler does (fp16 gradients below 2^-14
    # lose bits unscaled), then divided back
    scale = 1024.0 if prec == "amp" else 1.0
    grads = [g / scale for g in torch.autograd.grad(F.cross_entropy(logits, labels) * scale, [theta[k] for k in names])]
    init = load_gram_init(init_files[METHODS[method][0]])
    regs = {k: m.to(trainer.device) for k, m in init.regulator_modules().items()}
    before = {k: theta[k].detach().clone() for k in names}
    trainer.set_model_mode("train")
    trainer.batch_idx, trainer.num_batches = 0, 2
    trainer.forward_backward(batch)
    for k, g in zip(names, grads):
        with torch.no_grad():
            expected = before[k] - 0.5 * regs[k](g)
        assert torch.isfinite(theta[k]).all()
        assert torch.allclose(theta[k].detach(), expected, atol=1e-4, rtol=1e-3), k  # R_φ saw the unscaled gradient
    if prec == "amp":
        assert trainer.scaler.get_scale() == 1024.0  # no overflow: the step was taken at this scale


@pytest.mark.slow
def test_eval_only_loads_theta_for_new_classes_and_keeps_clip_in_eval(experiment, data_root):
    train_dir, _ = run_dirs(experiment, "unigram")
    trainer = build(data_root, "joint", subsample="new")  # same shapes; GRAM off: no init needed to evaluate
    assert trainer.dm.dataset.classnames == [f"texture_{c}" for c in NEW]
    trainer.load_model(str(train_dir))  # no epoch: no model-best (last_step), so the last checkpoint
    saved = torch.load(train_dir / "prompt_learner/model.pth.tar-1", weights_only=True)["state_dict"]
    for k, v in trainer.model.prompt_learner.state_dict().items():
        assert torch.equal(v, saved[k])
    seen = []
    trainer.model.clip.visual.conv1.register_forward_pre_hook(lambda m, inp: seen.append(m.training))
    trainer.set_model_mode("train")
    assert not any(m.training for m in trainer.model.clip.modules())
    accuracy = trainer.test()
    assert seen and not any(seen)
    assert not trainer.model.prompt_learner.training
    assert 0.0 <= accuracy <= 100.0


def test_resume_continues_epochs_and_schedule(tmp_path, data_root):
    out = tmp_path / "run"
    args = (
        common_args(data_root, "coop")
        + ["--output-dir", str(out)]
        + TINY
        + ["OPTIM.MAX_EPOCH", "2", "TRAIN.CHECKPOINT_FREQ", "1"]
    )
    run_train_py(args)
    first_log = (out / "log.txt").read_text()
    full = torch.load(out / "prompt_learner/model.pth.tar-2", weights_only=True)
    (out / "prompt_learner/model.pth.tar-2").unlink()  # as if the run had stopped after epoch 1
    (out / "prompt_learner/checkpoint").write_text("model.pth.tar-1\n")
    run_train_py(args)  # same folder: Dassl's before_train resumes
    log = next(p for p in out.iterdir() if p.name.startswith("log.txt-")).read_text()  # log.txt is never overwritten
    assert "Resumed prompt_learner from" in log and "(epochs done: 1)" in log
    assert "epoch [1/2]" not in log

    def lr_of_epoch2(text: str) -> str:
        return re.search(r"epoch \[2/2\] batch \[1/\d+\].* lr (\S+)", text).group(1)

    assert lr_of_epoch2(log) == lr_of_epoch2(first_log) == f"{0.002:.4e}"  # optimizer + schedule restored
    resumed = torch.load(out / "prompt_learner/model.pth.tar-2", weights_only=True)
    assert resumed["epoch"] == 2 and resumed["scheduler"] == full["scheduler"]


def test_resume_with_a_longer_schedule_follows_the_new_max_epoch(tmp_path, data_root):
    """1 epoch, then resumed with OPTIM.MAX_EPOCH 3: epochs 2-3 get the LRs of an uninterrupted 3-epoch run."""

    def run(out, epochs):
        run_train_py(
            common_args(data_root, "coop")
            + ["--output-dir", str(out)]
            + TINY
            + ["OPTIM.MAX_EPOCH", str(epochs), "OPTIM.WARMUP_EPOCH", "0"]
        )

    def lrs(text):
        return {int(e): float(lr) for e, lr in re.findall(r"epoch \[(\d+)/3\] batch \[1/\d+\].* lr (\S+)", text)}

    run(tmp_path / "straight", 3)
    straight = lrs((tmp_path / "straight" / "log.txt").read_text())
    assert straight[3] > 0  # cosine with T_max 3: 0.002, 0.0015, 0.0005
    run(tmp_path / "resumed", 1)
    run(tmp_path / "resumed", 3)
    log = next(p for p in (tmp_path / "resumed").iterdir() if p.name.startswith("log.txt-")).read_text()
    assert "(epochs done: 1)" in log and "follows the current OPTIM settings (OPTIM.MAX_EPOCH 3" in log
    assert set(lrs(log)) == {2, 3}
    for epoch in (2, 3):
        assert lrs(log)[epoch] == pytest.approx(straight[epoch], rel=1e-6)
    final = {
        k: torch.load(tmp_path / k / "prompt_learner/model.pth.tar-3", weights_only=True)["scheduler"]
        for k in ("straight", "resumed")
    }
    assert final["resumed"] == final["straight"]


def test_best_val_model_is_saved_and_deployed(tmp_path, data_root):
    out = tmp_path / "run"
    run_train_py(common_args(data_root, "vpt") + ["--output-dir", str(out)] + TINY + ["TEST.FINAL_MODEL", "best_val"])
    best = torch.load(out / "prompt_learner/model-best.pth.tar", weights_only=True)
    assert isinstance(best["val_result"], float) and best["epoch"] == 1
    log = (out / "log.txt").read_text()
    assert "Evaluate on the *val* set" in log
    best_path = out / "prompt_learner/model-best.pth.tar"
    assert f"Load {best_path} to prompt_learner (epoch=1, val_result={best['val_result']:.1f})" in log


@pytest.mark.slow
def test_stock_coop_loads_the_exported_context(experiment, init_files, tmp_path):
    """Dassl's load_pretrained_weights (what MODEL.INIT_WEIGHTS runs) into a CoOp-shaped prompt learner."""

    class CoOpPromptLearner(nn.Module):  # CoOp trainers/coop.py PromptLearner: ctx [n_ctx, d] + class buffers
        def __init__(self, n_ctx: int, n_cls: int = 3):
            super().__init__()
            self.ctx = nn.Parameter(torch.empty(n_ctx, 64).normal_(std=0.02))
            self.register_buffer("token_prefix", torch.ones(n_cls, 1, 64))
            self.register_buffer("token_suffix", torch.ones(n_cls, 72, 64))

    sources = {"init": init_files["GRAM_CoOp"], "run": run_dirs(experiment, "gram_coop")[0]}
    for label, source in sources.items():
        dst = export_for_coop(source, tmp_path / f"{label}.pth")
        learner = CoOpPromptLearner(4)
        load_pretrained_weights(learner, str(dst))
        exported = torch.load(dst, weights_only=True)["state_dict"]["ctx"]
        assert torch.equal(learner.ctx.detach(), exported)
        assert torch.equal(learner.token_prefix, torch.ones(3, 1, 64))
    init_ctx = load_gram_init(init_files["GRAM_CoOp"]).prompt["ctx"]
    assert torch.equal(torch.load(tmp_path / "init_nctx4.pth", weights_only=True)["state_dict"]["ctx"], init_ctx)


class _TensorNode(nn.Module):
    """One level of a state-dict key hierarchy, holding only tensors (for a TorchScript archive)."""


class _ArchiveRoot(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def write_openai_style_archive(state_dict: dict, path: Path) -> None:
    """A TorchScript ``.pt`` whose state dict is ``state_dict``: the form of OpenAI's released CLIP files."""
    root = _ArchiveRoot()
    for key, value in state_dict.items():
        *parents, leaf = key.split(".")
        module = root
        for name in parents:
            if not hasattr(module, name):
                module.add_module(name, _TensorNode())
            module = getattr(module, name)
        module.register_buffer(leaf, value.detach().clone())
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(root).save(str(path))


def test_default_weights_are_openais_torchscript_file_in_the_clip_cache(data_root, tiny_clip, tmp_path, monkeypatch):
    """WEIGHTS "" reads ~/.cache/clip/ViT-B-16.pt (what CoOp users have) through open_clip, with QuickGELU."""
    clip, _ = tiny_clip
    monkeypatch.setenv("HOME", str(tmp_path))
    write_openai_style_archive(clip.state_dict(), tmp_path / ".cache/clip/ViT-B-16.pt")
    trainer = build(data_root, "coop", "TRAINER.GRAM.WEIGHTS", "")
    assert "QuickGELU" in type(trainer.model.clip.transformer.resblocks[0].mlp.gelu).__name__
    loaded, original = trainer.model.clip.state_dict(), clip.state_dict()
    assert set(loaded) == set(original)
    for key, value in original.items():  # OpenAI's loader stores linear/conv weights through fp16
        assert torch.equal(loaded[key], value) or torch.equal(loaded[key], value.half().float()), key
    assert torch.equal(loaded["token_embedding.weight"], original["token_embedding.weight"])


# ------------------------------------------------------------------------------------------ errors
def test_missing_weights_file_is_a_one_line_error_naming_path_and_key(data_root, tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "ViT-B-16.pt"
    with pytest.raises(FileNotFoundError) as err:
        build(data_root, "coop", "TRAINER.GRAM.WEIGHTS", str(missing))
    assert "TRAINER.GRAM.WEIGHTS" in str(err.value) and str(missing) in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("HOME", str(tmp_path))  # default: OpenAI's cache file for MODEL.BACKBONE.NAME ViT-B/16
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / ".cache/clip/ViT-B-16.pt"))):
        build(data_root, "coop", "TRAINER.GRAM.WEIGHTS", "")


def test_init_that_does_not_fit_names_the_key_and_fields(data_root, init_files):
    with pytest.raises(InitMismatchError, match=r"TRAINER.GRAM.INIT: .*n_ctx_text: file has 4, model expects 2"):
        build(data_root, "gram_coop", "TRAINER.GRAM.N_CTX_TEXT", "2", init_files=init_files)
    with pytest.raises(InitMismatchError, match="n_ctx_vision: file has 2, model expects 0"):
        build(data_root, "gram_coop", "TRAINER.GRAM.INIT", str(init_files["UNIGRAM"]), "TRAINER.GRAM.N_CTX_TEXT", "2")


def test_configs_num_workers_and_fp16_become_cpu_values_with_one_log_line(data_root, capsys, monkeypatch):
    import trainers.gram.dassl_trainers as dt

    monkeypatch.setattr(dt, "available_cpus", lambda: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither torch's DataLoader nor the precision fallback may warn
        warnings.filterwarnings("ignore", message=".*RANDOM weights")  # the tiny test CLIP's own note
        trainer = build(data_root, "coop", "DATALOADER.NUM_WORKERS", "8")
        next(iter(trainer.train_loader_x))
    assert trainer.train_loader_x.num_workers == 1 and trainer.cfg.DATALOADER.NUM_WORKERS == 1
    out = capsys.readouterr().out
    assert out.count("GRAM effective settings on cpu:") == 1
    assert (
        "GRAM effective settings on cpu: TRAINER.GRAM.PREC fp32 (config fp16); "
        "DATALOADER.NUM_WORKERS 1 (config 8, 2 CPUs)"
    ) in out


def test_input_size_must_match_the_backbone(data_root):
    with pytest.raises(ValueError, match="INPUT.SIZE: GRAM-Test-Tiny takes 32x32"):
        build(data_root, "vpt", "INPUT.SIZE", "(224, 224)")
