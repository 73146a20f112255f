"""Dassl trainers ``GRAM_CoOp``, ``GRAM_VPT``, ``UNIGRAM``, ``GRAM_IVLP`` and ``GRAM_MaPLe``: one per learner of the
method table (:data:`GRAM_TRAINERS`, registered in ``TRAINER_REGISTRY`` on import).

They follow the CoOp trainer pattern (CoOp ``trainers/coop.py`` L222-325, on KaiyangZhou/Dassl.pytorch
``dassl/engine/trainer.py``) over the Dassl-free GRAM core in ``meta``:

* ``build_model``: a frozen open_clip CLIP (``meta.model.backbone.load_clip``; OpenAI's TorchScript
  ``~/.cache/clip/ViT-B-16.pt`` by default), θ from the GRAM init file (``TRAINER.GRAM.INIT``,
  validated against the model) or fresh (baselines), R_φ from the same file when
  ``TRAINER.GRAM.REGULATE``; only θ is registered (``"prompt_learner"``), optimised and saved.
* θ, R_φ, the window and the launch step come from :func:`meta.finetune.engine.build_start`, and every batch is
  stepped by :class:`meta.finetune.engine.RegulatedStepper`: the standalone evaluator (``meta.evaluation``) uses
  the same two, so ``train.py`` runs what the evaluator measured (tests/test_engine_agreement.py).
* ``forward_backward``: cross-entropy, backward, R_φ applied to the prompt gradients
  (``meta.finetune.regulated.GradientRegulation``, paper Eq. 7), optimiser step; the LR steps at the last
  batch of every epoch, as CoOp does (coop.py L281-282).  With ``TRAINER.GRAM.REG_WINDOW_IMAGES`` W the
  gradients of W images (``meta.finetune.engine.window_batches``: W / batch size batches, rounded, >= 1) are summed
  and regulated as their mean before one step (``meta.finetune.regulated.UpdateWindow``); ``TRAINER.GRAM.LAUNCH``
  takes the meta-trained inner step once on the train set (test transform) before the first epoch of a
  fresh run (``meta.finetune.regulated.launch_``).
  ``TRAINER.GRAM.INIT_PROMPTS False`` starts θ from scratch and takes only R_φ from the file.
* Stock Dassl HEAD on torch >= 2.7: schedulers from torch's own classes
  (:mod:`trainers.gram.dassl_schedule`), checkpoints that load with ``weights_only=True``
  (:mod:`trainers.gram.dassl_checkpoint`), ``load_model``/resume overridden (Dassl's crash on
  ``val_result`` None), no ``.cuda()``/``.half()``: the device is Dassl's ``self.device``.
* Images are read as Dassl reads them (``dassl.utils.read_image``: as stored, EXIF orientation ignored);
  ``TRAINER.GRAM.EXIF_UPRIGHT True`` gives every loader (train, val, test, launch) the
  :class:`UprightDatasetWrapper`, which turns them upright with the evaluator's reader
  (``meta.data.image_decode.open_upright``, ``python -m meta.evaluation --exif-upright``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from dassl.data.data_manager import DataManager, DatasetWrapper
from dassl.engine import TRAINER_REGISTRY, TrainerX
from dassl.metrics import compute_accuracy
from dassl.optim import build_optimizer

from meta.data.image_decode import open_upright
from meta.finetune.engine import RegulatedStepper, build_start, window_batches
from meta.finetune.regulated import check_gate_regulariser, launch_, weighted_sum
from meta.finetune.testtime import check_optimizer, check_prototypes, check_regulation, image_generator, tune_one
from meta.method import methods
from meta.method.learners import get_learner
from meta.model.backbone import check_visual_prompts, load_clip
from meta.model.clip_weights import check_weights_file
from meta.model.precision import resolve_precision

from .config import (
    GramSettings,
    available_cpus,
    effective_num_workers,
    effective_settings_line,
    gram_settings,
)
from .dassl_checkpoint import checkpoint_file, load_checkpoint, prompt_state, save_checkpoint
from .dassl_schedule import build_lr_scheduler
from .log_tee import log_stderr
from .model import GramCLIP
from .run_trace import environment_summary, file_sha256, sample_digest
from .stop_line import as_one_line

MODEL_NAME = "prompt_learner"  # the one registered module (same name as CoOp's, so its scripts' paths fit)


def _dassl_rgb(img):
    return img.convert("RGB")  # the conversion of dassl.utils.read_image


def read_upright(path: str):
    """The RGB image at ``path`` as Dassl's ``read_image`` converts it, turned upright by its EXIF orientation."""
    return open_upright(path, True, convert=_dassl_rgb)


class UprightDatasetWrapper(DatasetWrapper):
    """Dassl's ``DatasetWrapper`` reading each image with :func:`read_upright` (``TRAINER.GRAM.EXIF_UPRIGHT True``).

    Dassl's ``__getitem__`` reads with a module-level ``read_image`` that no argument replaces, so this one
    builds the same item from Dassl's own helpers (``_transform_image``, ``to_tensor``): ``label``, ``domain``,
    ``impath``, ``index``; ``img`` (the image itself without a transform; ``img``, ``img2``, ... for a list of
    transforms, each applied ``DATALOADER.K_TRANSFORMS`` times in training); ``img0`` with
    ``DATALOADER.RETURN_IMG0``.  tests/test_exif_upright.py checks it against Dassl's wrapper item for item.
    """

    def __getitem__(self, idx):
        item = self.data_source[idx]
        img0 = read_upright(item.impath)
        output = {"label": item.label, "domain": item.domain, "impath": item.impath, "index": idx}
        if self.transform is None:
            output["img"] = img0
        else:
            transforms = self.transform if isinstance(self.transform, (list, tuple)) else [self.transform]
            for i, tfm in enumerate(transforms):
                output["img" if i == 0 else f"img{i + 1}"] = self._transform_image(tfm, img0)
        if self.return_img0:
            output["img0"] = self.to_tensor(img0)
        return output


class _GramTrainer(TrainerX):
    """Shared implementation; subclasses differ only by name: what each learns is its row in the learner
    table of ``meta/method/methods.yaml`` (``config.TRAINER_PROMPTS`` / ``TRAINER_COUPLING``)."""

    gram_trainer = True  # marks our classes in the registry (re-registration check)

    # ------------------------------------------------------------------------------ building
    def check_cfg(self, cfg) -> None:
        """Every TRAINER.GRAM key, the CLIP weights file and the backbone, before data loading; a failure is one
        line (:mod:`trainers.gram.stop_line`), also in a fork's ``train.py`` that catches nothing.  From here on
        stderr (warnings, ``warning:`` and ``error:`` lines) is also written into the run's ``log.txt``
        (:mod:`trainers.gram.log_tee`)."""
        log_stderr()
        try:
            s = gram_settings(cfg, type(self).__name__)
            check_weights_file(s.weights, "TRAINER.GRAM.WEIGHTS", unset=not str(cfg.TRAINER.GRAM.WEIGHTS).strip())
            if get_learner(s.learner).spec_prompts_vision(s.start.prompt):  # visual prompts need a ViT tower
                key = "TRAINER.GRAM.MODEL_NAME" if cfg.TRAINER.GRAM.MODEL_NAME else "MODEL.BACKBONE.NAME"
                text_only = [t for t, row in methods.learners().items() if not row.prompts_image]
                check_visual_prompts(s.model_name, key, s.trainer, text_only)
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise as_one_line(err)

    def build_data_loader(self) -> None:
        """Dassl's loaders, with ``DATALOADER.NUM_WORKERS`` capped to this machine (logged with the precision);
        with ``TRAINER.GRAM.EXIF_UPRIGHT`` their datasets are :class:`UprightDatasetWrapper`."""
        cfg = self.cfg
        exif = gram_settings(cfg, type(self).__name__).exif_upright
        self.gram_dataset_wrapper = UprightDatasetWrapper if exif else None  # None: Dassl's DatasetWrapper
        cpus = available_cpus()
        wanted = int(cfg.DATALOADER.NUM_WORKERS)
        workers = effective_num_workers(wanted, self.device.type, cpus)
        if workers != wanted:
            cfg.defrost()
            cfg.DATALOADER.NUM_WORKERS = workers
            cfg.freeze()
        asked = cfg.TRAINER.GRAM.PREC
        print(
            effective_settings_line(
                self.device.type, (asked, resolve_precision(asked, self.device.type)), (wanted, workers), cpus
            )
        )
        if not exif:
            super().build_data_loader()
            return
        # Dassl's SimpleTrainer.build_data_loader with the wrapper passed on: the attributes it documents
        dm = DataManager(cfg, dataset_wrapper=UprightDatasetWrapper)
        self.train_loader_x, self.train_loader_u = dm.train_loader_x, dm.train_loader_u
        self.val_loader, self.test_loader = dm.val_loader, dm.test_loader
        self.num_classes, self.num_source_domains, self.lab2cname = dm.num_classes, dm.num_source_domains, dm.lab2cname
        self.dm = dm

    def build_model(self) -> None:
        cfg = self.cfg
        settings = gram_settings(cfg, type(self).__name__)
        self.gram = settings
        self.precision = resolve_precision(settings.precision, self.device.type)
        clip, dims = load_clip(
            settings.model_name,
            settings.weights,
            device=self.device,
            precision="fp16" if self.precision == "fp16" else "fp32",
            quick_gelu=settings.quick_gelu,
            config_key="TRAINER.GRAM.WEIGHTS",
        )
        size = tuple(cfg.INPUT.SIZE)
        if size != (dims.image_size, dims.image_size):
            raise ValueError(
                f"INPUT.SIZE: {settings.model_name} takes {dims.image_size}x{dims.image_size} "
                f"images, config says {size[0]}x{size[1]}"
            )
        self.clip_dims = dims
        # θ from the GRAM init file (and φ when regulating), or fresh θ for the baselines: the engine's build_start,
        # the evaluator's own start factory, with Dassl's key names.  Scratch θ comes from the global RNG (seeded by
        # Dassl) before anything else touches it, so that an "R_φ only" run starts where its baseline does.
        start = build_start(settings.start, clip, dims, generator=None, device=self.device)
        if settings.ctx_init and start.prompts.n_ctx_text != settings.n_ctx_text:
            raise ValueError(
                f"TRAINER.GRAM.CTX_INIT {settings.ctx_init!r} is {start.prompts.n_ctx_text} tokens but "
                f"TRAINER.GRAM.N_CTX_TEXT is {settings.n_ctx_text}; make them agree"
            )
        self.gram_init_metadata = start.metadata
        classnames = self.dm.dataset.classnames
        self.model = GramCLIP(
            clip, dims, start.prompts, classnames, template=settings.template, consistency=settings.consistency
        )
        if cfg.MODEL.INIT_WEIGHTS:
            self._load_init_weights(cfg.MODEL.INIT_WEIGHTS)
        self.optim = build_optimizer(self.model.prompt_learner, cfg.OPTIM)
        self.sched = build_lr_scheduler(self.optim, cfg.OPTIM)
        self.register_model(MODEL_NAME, self.model.prompt_learner, self.optim, self.sched)
        self.regulation = start.regulation
        check_gate_regulariser(self.regulation, self.model.consistency is not None)
        if settings.test_time is not None:
            check_regulation(self.regulation)
            check_optimizer(settings.test_time, start.launch)
            check_prototypes(settings.test_time, self.regulation, "TRAINER.GRAM.TEST_TIME.PROTOTYPES")
        self.window_images = start.window
        self.launch_step = start.launch  # None for a prompt pre-training file
        self.stepper = RegulatedStepper(
            self.model.prompt_learner,
            self.optim,
            self.regulation,
            window_batches(start.window, int(cfg.DATALOADER.TRAIN_X.BATCH_SIZE)),
            scaler=torch.amp.GradScaler(self.device.type) if self.precision == "amp" else None,
        )
        self._log_setup(settings, dims, classnames)

    @property
    def window(self):
        """The regulation window in backward passes (:class:`meta.finetune.regulated.UpdateWindow`)."""
        return self.stepper.window

    @property
    def scaler(self):
        """The GradScaler of ``PREC amp`` (None otherwise); replacing it replaces the stepper's."""
        return self.stepper.scaler

    @scaler.setter
    def scaler(self, value) -> None:
        self.stepper.scaler = value

    def _load_init_weights(self, path: str) -> None:
        """``MODEL.INIT_WEIGHTS`` as CoOp honours it: θ tensors from a checkpoint, matched by name and shape."""
        state = prompt_state(
            load_checkpoint(path)["state_dict"], self.model.prompt_learner, source=f"MODEL.INIT_WEIGHTS {path}"
        )
        self.model.prompt_learner.load_state_dict(state)
        print(f"Loaded prompt weights from MODEL.INIT_WEIGHTS {path}: {sorted(state)}")

    def _log_setup(self, s: GramSettings, dims, classnames) -> None:
        cfg = self.cfg
        print(
            f"GRAM trainer {s.trainer}: GRAM {'on' if s.enabled else 'off (baseline)'}, "
            f"text ctx {s.n_ctx_text} x depth {self.model.prompt_learner.text_depth}, "
            f"visual prompts {s.n_ctx_vision} x depth {s.vision_depth(dims.vision_layers)}, "
            f"coupling {s.coupling}, "
            f"regulated tensors {sorted(self.regulation.regulators) if self.regulation else []}, "
            f"regulation window {self.window.size}, launch step {'on' if self.launch_step else 'off'}, "
            f"zero-shot consistency text {s.consistency.text_weight:g} image {s.consistency.image_weight:g}"
        )
        if self.regulation is not None:  # the one place the window's unit changes (meta.finetune.engine.window_batches)
            print(
                f"GRAM regulation window: TRAINER.GRAM.REG_WINDOW_IMAGES {s.reg_window_images} -> "
                f"{self.window_images} images -> {self.window.size} batches of {cfg.DATALOADER.TRAIN_X.BATCH_SIZE}"
            )
        quick_gelu = "auto" if s.quick_gelu is None else s.quick_gelu
        print(
            f"GRAM backbone: {dims.model_name} weights={s.weights or 'RANDOM'} quick_gelu={quick_gelu} "
            f"precision={self.precision} (asked {s.precision}) device={self.device} widths text={dims.text_width} "
            f"vision={dims.vision_width} image={dims.image_size}px"
        )
        if s.enabled:
            meta = self.gram_init_metadata
            print(
                f"GRAM init: {s.init_path} sha256={file_sha256(s.init_path)} regulator={meta.get('regulator')} "
                f"provenance={meta.get('provenance')}"
            )
        root = cfg.DATASET.ROOT
        n, digest = sample_digest(self.dm.dataset.train_x, root)
        print(
            f"GRAM data: {cfg.DATASET.NAME} subsample={cfg.DATASET.SUBSAMPLE_CLASSES} shots={cfg.DATASET.NUM_SHOTS} "
            f"seed={cfg.SEED} classes={len(classnames)} train_x={n} sha256={digest}"
            + (" images=exif-upright" if s.exif_upright else "")
        )
        print(f"GRAM environment: {environment_summary()}")

    # ------------------------------------------------------------------------------ training
    def _autocast(self):
        if self.precision == "amp":
            return torch.autocast(device_type=self.device.type, dtype=torch.float16)
        return contextlib.nullcontext()

    def parse_batch_train(self, batch):
        return batch["img"].to(self.device), batch["label"].to(self.device)

    def before_train(self) -> None:
        super().before_train()  # resumes (sets start_epoch) first
        if self.launch_step is not None and self.start_epoch == 0:
            loss = self._launch()
            rule = "R_φ(mean train gradient)" if self.regulation is not None else "mean train gradient (R_φ off)"
            print(
                f"GRAM launch: θ <- θ − α {rule}, α={self.launch_step.alpha} "
                f"steps={self.launch_step.steps} weight decay={self.launch_step.weight_decay} "
                f"(train loss before {loss:.4f})"
            )

    def _launch(self) -> float:
        """The meta-trained inner step on the whole train set, test transform (as meta-training's supports)."""
        from dassl.data.data_manager import build_data_loader
        from dassl.data.transforms import build_transform

        cfg = self.cfg
        loader = build_data_loader(
            cfg,
            sampler_type="SequentialSampler",
            data_source=self.dm.dataset.train_x,
            batch_size=cfg.DATALOADER.TEST.BATCH_SIZE,
            tfm=build_transform(cfg, is_train=False),
            is_train=False,
            dataset_wrapper=self.gram_dataset_wrapper,
        )
        batches = [(b["img"].to(self.device), b["label"].to(self.device)) for b in loader]
        total = sum(len(y) for _, y in batches)
        learner = self.model.prompt_learner
        self.model.train()

        gated = self.stepper.wants_parts and self.model.consistency is not None

        def batch_loss(images, labels):
            with self._autocast():
                if gated:  # the gate was meta-trained on the regularised support loss: the launch replays it in parts
                    return self.model.training_loss_parts(images, labels)[:2]
                logits = self.model(images).float()
            return F.cross_entropy(logits, labels)

        def mean_loss(_prompts):
            return weighted_sum((batch_loss(images, labels), len(labels) / total) for images, labels in batches)

        loss = launch_(learner, self.regulation, mean_loss, self.launch_step)
        self.model.reset_cache()
        return loss

    def forward_backward(self, batch) -> dict:
        images, labels = self.parse_batch_train(batch)
        last = (self.batch_idx + 1) == self.num_batches
        if self.stepper.wants_parts:  # R_φ is a gate: the regulariser's gradient is kept apart
            with self._autocast():
                task, penalty, logits = self.model.training_loss_parts(images, labels)
            loss = task if penalty is None else task + penalty
            self.detect_anomaly(loss)
            self.stepper.backward(task, last=last, penalty=penalty)
        else:
            with self._autocast():
                loss, logits = self.model.training_loss(images, labels)
            self.detect_anomaly(loss)
            self.stepper.backward(loss, last=last)  # sums until the window closes, then R_φ and one step
        if last:
            self.update_lr()
        return {"loss": loss.item(), "acc": compute_accuracy(logits, labels)[0].item()}

    def set_model_mode(self, mode: str = "train", names=None) -> None:
        super().set_model_mode(mode, names)
        self.model.train(mode == "train")  # the wrapper too; GramCLIP keeps its CLIP in eval

    # ------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def test(self, split: Optional[str] = None):
        self.model.reset_cache()
        self.test_images_seen = 0  # image i of the split draws its test-time views from image_generator(SEED, i)
        return super().test(split)

    def model_inference(self, input):
        if self.gram.test_time is not None:
            return self._test_time_inference(input)
        with self._autocast():
            return self.model.predict(input).float()

    def _test_time_inference(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C]`` logits of each image after TPT from the current θ (``TRAINER.GRAM.TEST_TIME``; R_φ on the
        entropy gradient when GRAM regulates), θ reset per image: the evaluator's ``--test-time`` step by step, its
        views drawn from the generator of the image's place in the split under ``SEED`` (a negative SEED reads as 0)."""
        seed, out = max(int(self.cfg.SEED), 0), []
        with torch.enable_grad(), self._autocast():
            for image in images.to(self.model.dtype):
                generator = image_generator(seed, self.test_images_seen)
                model = self.model
                spec = self.gram.test_time
                logits, _, _ = tune_one(
                    model.pclip,
                    model.prompt_learner,
                    image,
                    model.classnames,
                    spec,
                    generator,
                    self.regulation,
                    self.launch_step,
                )
                out.append(logits.detach().float())
                self.test_images_seen += 1
        return torch.stack(out)

    # ------------------------------------------------------------------------------ checkpoints
    def _checkpoint_meta(self) -> dict:
        s, d = self.gram, self.clip_dims
        return {
            "trainer": s.trainer,
            "enabled": s.enabled,
            "regulate": s.regulate,
            "model_name": d.model_name,
            "text_width": d.text_width,
            "vision_width": d.vision_width,
            "n_ctx_text": s.n_ctx_text,
            "n_ctx_vision": s.n_ctx_vision,
            "vision_depth": s.vision_depth(d.vision_layers),
            "text_depth": self.model.prompt_learner.text_depth,
            "coupling": s.coupling,
        }

    def save_model(self, epoch, directory, is_best=False, val_result=None, model_name="") -> None:
        best = "model-best.pth.tar"
        filenames = [model_name] + ([best] if is_best and model_name != best else [])  # "": model.pth.tar-<epoch>
        for name in self.get_model_names():
            for filename in filenames:
                path = save_checkpoint(
                    directory,
                    name,
                    epoch + 1,
                    self._models[name],
                    self._optims[name],
                    self._scheds[name],
                    val_result=val_result,
                    extra=self._checkpoint_meta(),
                    filename=filename,
                )
                print(f"Checkpoint saved to {path}")

    def load_model(self, directory, epoch=None) -> None:
        """Load θ for evaluation (weights_only; works for other classes than the ones trained on)."""
        if not directory:
            print(
                "Note that load_model() is skipped as no pretrained model is given "
                "(ignore this if it's done on purpose)"
            )
            return
        for name in self.get_model_names():
            if epoch is not None:
                path = checkpoint_file(directory, name, epoch)
            else:
                path = Path(directory) / name / "model-best.pth.tar"
                if not path.is_file():
                    path = checkpoint_file(directory, name)
                    print(f"No model-best.pth.tar in {path.parent}: loading the last checkpoint {path.name}")
            ckpt = load_checkpoint(path)
            state = prompt_state(ckpt["state_dict"], self._models[name], source=str(path))
            self._models[name].load_state_dict(state)
            val = ckpt.get("val_result")
            print(
                f"Load {path} to {name} (epoch={ckpt.get('epoch')}, val_result={'-' if val is None else f'{val:.1f}'})"
            )
        self.model.reset_cache()

    def resume_model_if_exist(self, directory) -> int:
        names = self.get_model_names()
        if not all(os.path.isfile(os.path.join(directory, n, "checkpoint")) for n in names):
            print("No checkpoint found, train from scratch")
            return 0
        print(f"Found checkpoint at {directory} (will resume training)")
        start_epoch = 0
        for name in names:
            path = checkpoint_file(directory, name)
            ckpt = load_checkpoint(path)
            self._models[name].load_state_dict(prompt_state(ckpt["state_dict"], self._models[name], source=str(path)))
            start_epoch = int(ckpt["epoch"])
            optim, sched = self._optims[name], self._scheds[name]
            if optim is not None and ckpt.get("optimizer"):
                # optimiser state (momentum) from the file; its hyper-parameters (LR, ...) from the current config
                hyper = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
                optim.load_state_dict(ckpt["optimizer"])
                for group, values in zip(optim.param_groups, hyper):
                    group.update(values)
            if sched is not None:
                self._replay_schedule(sched, start_epoch, ckpt.get("scheduler"))
            print(f"Resumed {name} from {path} (epochs done: {start_epoch})")
        self.model.reset_cache()
        return start_epoch

    def _replay_schedule(self, sched, epochs_done: int, saved: Optional[dict]) -> None:
        """Bring the (freshly built) schedule to ``epochs_done`` under the *current* ``OPTIM`` settings.

        The saved schedule encodes the old settings (cosine ``T_max`` = the old ``MAX_EPOCH``), so a run
        resumed with a larger ``OPTIM.MAX_EPOCH`` would continue at the old schedule's end (LR 0).
        Replaying the per-epoch steps gives exactly the LRs of an uninterrupted run with the new settings.
        """
        for _ in range(epochs_done):
            sched.step()
        if saved is not None and saved != sched.state_dict():
            print(
                f"Note: the LR schedule follows the current OPTIM settings (OPTIM.MAX_EPOCH {self.max_epoch}, "
                f"LR {self.cfg.OPTIM.LR}), not the checkpoint's; LR at epoch {epochs_done + 1}: "
                f"{sched.get_last_lr()[0]:.4e}"
            )


class GRAM_CoOp(_GramTrainer):
    """CoOp text context; with GRAM on: meta-learned init + regulated gradients (paper Table 1 "CoOp + GRAM")."""


class GRAM_VPT(_GramTrainer):
    """Visual prompt tokens (shallow or deep VPT), fixed text template; "VPT + GRAM" with GRAM on."""


class UNIGRAM(_GramTrainer):
    """Text context and visual prompts together (paper: 2 + 2 tokens); the joint baseline with GRAM off."""


class GRAM_IVLP(_GramTrainer):
    """Deep independent vision-language prompts (the IVLP baseline of muzairkhattak/multimodal-prompt-learning):
    text context in ``TEXT_DEPTH`` layers, visual tokens in ``VPT_DEPTH`` layers; "IVLP + GRAM" with GRAM on."""


class GRAM_MaPLe(_GramTrainer):
    """MaPLe: deep text prompts whose per-layer linear projections are the visual prompts (the projections
    are θ tensors too, meta-initialised and regulated like the prompts); "MaPLe + GRAM" with GRAM on."""


def trainer_classes(table: Mapping[str, methods.Learner], written: Mapping[str, type]) -> tuple[type, ...]:
    """One class per learner of ``table`` (``{trainer: Learner}``, the ``learners`` of ``meta/method/methods.yaml``),
    in table order: the class of ``written`` (``{name: class}``, the classes above, which add a docstring) or else a
    new :class:`_GramTrainer` subclass of that name.  The table says what each learns (``config.TRAINER_PROMPTS``);
    the class only names it."""
    out = []
    for name, row in table.items():
        cls = written.get(name)
        if cls is None:
            doc = (
                f"{name}, a prompt learner of the method table (meta/method/methods.yaml): text context "
                f"{'yes' if row.text else 'no'}, visual tokens {'yes' if row.vision else 'no'}, "
                f"coupling {row.coupling}."
            )
            cls = type(name, (_GramTrainer,), {"__doc__": doc, "__module__": __name__, "__qualname__": name})
        out.append(cls)
    return tuple(out)


GRAM_TRAINERS = trainer_classes(
    methods.learners(),
    {name: obj for name, obj in list(globals().items()) if isinstance(obj, type) and _GramTrainer in obj.__bases__},
)
globals().update({cls.__name__: cls for cls in GRAM_TRAINERS})  # a table learner without a class above


def register_trainers() -> None:
    """Put the GRAM trainers into Dassl's registry; re-registering GRAM's own classes is allowed."""
    for cls in GRAM_TRAINERS:
        name = cls.__name__
        if name in TRAINER_REGISTRY.registered_names():
            old = TRAINER_REGISTRY.get(name)
            if not getattr(old, "gram_trainer", False):
                raise KeyError(
                    f"Dassl TRAINER_REGISTRY already holds a different {name!r} "
                    f"(from {old.__module__}); GRAM will not replace it"
                )
        TRAINER_REGISTRY.register(cls, force=True)


register_trainers()
