"""Export a run's θ* (and φ) in the forms the trainers load.

* ``gram_init.safetensors`` (:func:`meta.finetune.init_io.export_gram_init`), with provenance;
* ``coop_ctx_nctx<M>.pth`` (:func:`meta.finetune.init_io.export_coop_context`) when θ has M text context vectors, for
  stock CoOp/CoCoOp ``MODEL.INIT_WEIGHTS`` with ``N_CTX M``;
* for CoCoOp's learner also ``cocoop_nctx<M>/prompt_learner/model.pth.tar-0``
  (:func:`meta.finetune.init_io.export_cocoop_checkpoint`), for stock CoCoOp's ``load_model`` or ``MODEL.INIT_WEIGHTS``.

Everything is rebuilt from the checkpoint alone and written atomically; :func:`verify_exports` checks that a finished
run's files exist, load and hold the checkpoint's θ, so a resume can rewrite any that do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from yacs.config import CfgNode as CN

from meta.config import refuse_yaml_aliases
from meta.finetune.init_io import (
    COCOOP_CHECKPOINT,
    cocoop_checkpoint_usage,
    coop_context_usage,
    export_cocoop_checkpoint,
    export_coop_context,
    export_gram_init,
    load_gram_init,
)
from meta.infra.cli_errors import UserError
from meta.infra.fileio import clean_stale_temps
from meta.infra.runlock import RunLock
from meta.metatrain import settings
from meta.metatrain.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from meta.method import cocoop
from meta.method.gram import GRAMMetaLearner
from meta.method.learners import get_learner
from meta.method.prompts import PromptParams
from meta.model.backbone import ClipDims


def saved_cfg(state: dict) -> CN:
    """The config a checkpoint records (``config_yaml``), read as config files are: YAML aliases refused
    before yacs builds the tree (:func:`meta.config.refuse_yaml_aliases`), so a doctored checkpoint cannot
    make the export build an exponentially large one."""
    text = state.get("config_yaml")
    if not isinstance(text, str):
        raise CheckpointError(
            f"checkpoint config_yaml: expected the run's config as YAML text, got {type(text).__name__}"
        )
    refuse_yaml_aliases("checkpoint config_yaml", text)
    return CN.load_cfg(text)


def learner_from_state(state: dict) -> tuple[GRAMMetaLearner, CN]:
    """Rebuild θ and φ (with the optimiser) from a checkpoint; returns ``(learner, cfg)``."""
    cfg = saved_cfg(state)
    gbml = state["learner"]["gbml"]
    key = settings.prompt_spec(cfg).learner
    shapes = {
        name: gbml[f"module.{name}"] for name in get_learner(key).tensor_names if gbml.get(f"module.{name}") is not None
    }
    if not shapes:
        raise CheckpointError(
            f"checkpoint holds no prompt tensors (module.<{'|'.join(get_learner(key).tensor_names)}>)"
        )
    theta = PromptParams(key, **{name: torch.zeros_like(t) for name, t in shapes.items()})
    learner = GRAMMetaLearner(theta, settings.meta_spec(cfg))
    learner.load_state(state["learner"])
    return learner, cfg


def provenance(state: dict, cfg: CN) -> dict:
    return {
        "tool": "python -m meta train",
        "mode": state.get("mode", cfg.META.MODE),
        "config_hash": state["config_hash"],
        "step": int(state["step"]),
        "steps_total": int(state.get("steps_total", cfg.META.STEPS)),
        "finished": int(state["step"]) >= int(state.get("steps_total", cfg.META.STEPS)),
        "seed": int(cfg.SEED),
        "prompt": settings.prompt_spec(cfg).as_dict(),
        "meta": {**settings.meta_spec(cfg).as_dict(), **settings.outer_spec(cfg).as_dict()},  # one flat record
        "tasks": {
            "k_way": int(cfg.TASKS.K_WAY),
            "n_support": int(cfg.TASKS.N_SUPPORT),
            "n_query": int(cfg.TASKS.N_QUERY),
            "domain_shift": bool(cfg.TASKS.DOMAIN_SHIFT),
            "query_new_share": float(cfg.TASKS.QUERY_NEW_SHARE),
            "source": cfg.TASKS.SOURCE,
            "meta_batch": int(cfg.META.META_BATCH),
        },
        "hierarchy": state.get("hierarchy", {}),
    }


# The stock-CoCoOp checkpoint's folder beside the init file (``{n_ctx}`` = M): it holds Dassl's prompt_learner/ layout.
COCOOP_DIR_NAME = "cocoop_nctx{n_ctx}"
# The epoch the checkpoint is filed under (θ* before any fine-tuning epoch; ``--load-epoch 0``).
COCOOP_EPOCH = 0


def cocoop_dir(init_path: Path, n_ctx: int, out: bool) -> Path:
    """The stock-CoCoOp folder of init file ``init_path``: its sibling ``cocoop_nctx<M>`` in a run folder, or
    ``<init stem>_cocoop_nctx<M>`` beside an ``--out`` file."""
    name = COCOOP_DIR_NAME.format(n_ctx=int(n_ctx))
    return init_path.with_name(init_path.name.split(".")[0] + "_" + name if out else name)


def cocoop_state(theta) -> dict:
    """θ of the ``cocoop`` learner under stock CoCoOp's ``PromptLearner`` keys (``meta_net.linear1.weight``, ...)."""
    return {cocoop.STOCK_NAMES[name]: p.detach().float().cpu() for name, p in theta.named_parameters()}


def export_paths(run_dir: Path, export_name: str, coop_ctx_name: str, out: Optional[str] = None) -> tuple[Path, Path]:
    """(init file, stock-CoOp ctx file): ``run_dir/export_name`` (``META.EXPORT_NAME``) or ``out``, and its sibling
    named by ``coop_ctx_name`` (``META.COOP_CTX_NAME``)."""
    if out:
        init = Path(out)
        return init, init.with_name(init.name.split(".")[0] + "_" + coop_ctx_name)
    return run_dir / export_name, run_dir / coop_ctx_name


def exported_files(paths: dict) -> str:
    """The files an export wrote (:func:`export_state`'s ``paths``): the init file, and the CoOp context when there is
    one."""
    return f"{paths['init']}" + (f" and {paths['coop_ctx']}" if paths.get("coop_ctx") else "")


def export_state(state: dict, run_dir: Union[str, Path], out: Optional[Union[str, Path]] = None) -> dict:
    """Write the init file (and the CoOp ctx file when there is text context); returns their paths."""
    learner, cfg = learner_from_state(state)
    dims = ClipDims(**state["dims"])
    init_path, coop_path = export_paths(
        Path(run_dir), cfg.META.EXPORT_NAME, cfg.META.COOP_CTX_NAME, str(out) if out else None
    )
    theta = learner.prompt_module
    prov = provenance(state, cfg)
    record = _computed_by_of_run(Path(run_dir))
    if record:
        prov["computed_by"] = record
    export_gram_init(
        init_path,
        theta,
        learner.regulators(),
        dims,
        provenance=prov,
        weights=cfg.MODEL.PRETRAINED,
        prototypes=state.get("prototypes"),
    )
    paths = {"init": init_path, "coop_ctx": None}
    ctx = getattr(theta, "ctx", None)  # CoOp's context file: the built-in learner's text context
    if ctx is not None:
        n_ctx = int(ctx.shape[0])
        coop_path = _with_n_ctx(coop_path, n_ctx)
        paths["coop_ctx"] = export_coop_context(coop_path, ctx, epoch=0)
        paths["coop_usage"] = coop_context_usage(paths["coop_ctx"], n_ctx)
    paths["cocoop"] = None
    if theta.learner == cocoop.KEY:  # ctx and the meta-net for stock CoCoOp (its usage printed after CoOp's)
        folder = cocoop_dir(init_path, int(theta.ctx.shape[0]), out is not None)
        export_cocoop_checkpoint(folder, cocoop_state(theta), epoch=COCOOP_EPOCH)
        paths["cocoop"] = folder
        paths["coop_usage"] += "\n" + cocoop_checkpoint_usage(folder, int(theta.ctx.shape[0]), COCOOP_EPOCH)
    return paths


def _computed_by_of_run(run_dir: Path) -> dict:
    """The run's ``run.json`` ``computed_by`` record (``{}`` when absent, unreadable, or ``META.FINGERPRINT`` False)."""
    import json

    try:
        record = json.loads((run_dir / "run.json").read_text()).get("computed_by")
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def _with_n_ctx(coop_path: Path, n_ctx: int) -> Path:
    """Fill META.COOP_CTX_NAME's ``{n_ctx}`` placeholder."""
    return coop_path.with_name(coop_path.name.format(n_ctx=n_ctx))


def verify_exports(state: dict, run_dir: Union[str, Path]) -> list[str]:
    """Problems with a run's exports for checkpoint ``state`` (empty list = both files are good).

    The init file must load (:func:`meta.finetune.init_io.load_gram_init`) and record the checkpoint's
    step and config hash; the CoOp ctx file (text prompts only) must load with
    ``weights_only=True`` and hold the same context tensor as the checkpoint.
    """
    cfg = saved_cfg(state)
    init_path, coop_path = export_paths(Path(run_dir), cfg.META.EXPORT_NAME, cfg.META.COOP_CTX_NAME)
    problems = []
    try:
        init = load_gram_init(init_path, config_key="export")
        prov = init.metadata.get("provenance", {})
        if prov.get("step") != int(state["step"]) or prov.get("config_hash") != state["config_hash"]:
            problems.append(f"{init_path.name} is from step {prov.get('step')}, the checkpoint is at {state['step']}")
    except (FileNotFoundError, ValueError) as err:
        problems.append(f"{init_path.name} missing or unreadable ({' '.join(str(err).split())[:160]})")
    ctx = state["learner"]["gbml"].get("module.ctx")
    if ctx is not None:
        coop_path = _with_n_ctx(coop_path, int(ctx.shape[0]))
        try:
            saved = torch.load(str(coop_path), map_location="cpu", weights_only=True)["state_dict"]["ctx"]
            if not torch.equal(saved, ctx.detach().float().cpu()):
                problems.append(f"{coop_path.name} does not hold the checkpoint's context")
        except Exception as err:  # noqa: BLE001 - any failure to read it means: rewrite it
            problems.append(f"{coop_path.name} missing or unreadable ({type(err).__name__})")
    if settings.prompt_spec(cfg).learner == cocoop.KEY and ctx is not None:
        folder = cocoop_dir(init_path, int(ctx.shape[0]), out=False)
        file = folder / COCOOP_CHECKPOINT.format(epoch=COCOOP_EPOCH)
        want = {cocoop.STOCK_NAMES[n]: state["learner"]["gbml"][f"module.{n}"] for n in cocoop.TENSORS}
        try:
            saved = torch.load(str(file), map_location="cpu", weights_only=True)["state_dict"]
            if sorted(saved) != sorted(want) or any(not torch.equal(saved[k], want[k].float().cpu()) for k in want):
                problems.append(f"{folder.name}/{COCOOP_CHECKPOINT.format(epoch=COCOOP_EPOCH)} does not hold θ*")
        except Exception as err:  # noqa: BLE001 - any failure to read it means: rewrite it
            problems.append(f"{folder.name} missing or unreadable ({type(err).__name__})")
    return problems


def export_run(run_dir: Union[str, Path], out: Optional[Union[str, Path]] = None) -> dict:
    """``python -m meta export``: export from ``run_dir/checkpoint.pt``."""
    run_dir = Path(run_dir)
    ckpt = run_dir / CHECKPOINT_NAME
    if not ckpt.is_file():
        raise FileNotFoundError(
            f"--run-dir: no {CHECKPOINT_NAME} in {run_dir} (not a `python -m meta train` run "
            f"dir, or killed before its first checkpoint)"
        )
    if out is not None and Path(out).is_dir():
        raise UserError(
            "--out", f"{out} is a folder; expected the init file's path, e.g. {Path(out) / 'gram_init.safetensors'}"
        )
    state = load_checkpoint(ckpt)
    if out is not None:
        clean_stale_temps(Path(out).parent)  # temp files of killed exports (their writers are gone)
        return export_state(state, run_dir, out)
    with RunLock(run_dir, key="--run-dir"):  # writing into the run folder: not while a run owns it
        clean_stale_temps(run_dir, all_pids=True)
        return export_state(state, run_dir, out)
