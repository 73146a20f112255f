"""Few-shot prompt tuning with (optionally regulated) gradients, and accuracy on labelled sets.

The update is the Dassl trainers' (and paper Eq. 7 at test time)::

    loss = CE(prompted-CLIP logits, labels)          # over a batch of the few-shot train set
    loss.backward()
    p.grad <- R_φ(p.grad)                            # only with MethodSpec.regulate
    optimizer.step()                                 # SGD + momentum + weight decay (Dassl OPTIM)
    ... after the epoch's last batch: scheduler.step()   (Dassl: update_lr per epoch)
"""
from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from ..backbone import ClipDims
from ..finetune import GradientRegulation, LaunchStep, UpdateWindow, launch_, launch_step_of, resolve_window
from ..init_io import load_gram_init
from ..prompts import PromptedCLIP, PromptParams, classification_loss
from ..regulator import GradientRegulator
from ..schedule import epoch_scheduler
from .spec import MethodSpec, TrainSpec


@dataclass
class LabelledSet:
    """One split ready for the model.

    Attributes:
        impaths: N image paths.
        labels: ``[N]`` int64 labels in ``0..C-1``.
        classnames: C names, index = label.
        features: frozen-tower features when the image side has no prompts: ``[N, E]`` for a
            test set, ``[N, V, E]`` (V augmented views) for a train set; ``None`` with visual prompts.
    """

    impaths: list[str]
    labels: torch.Tensor
    classnames: list[str]
    features: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.impaths)


def prompt_digest(prompts: Optional[nn.Module]) -> str:
    """SHA-256 (hex) of the prompt tensors' fp32 bytes, in parameter-name order ("" for no prompts)."""
    if prompts is None:
        return ""
    h = hashlib.sha256()
    for name, p in sorted(prompts.named_parameters()):
        t = p.detach().float().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).numpy().tobytes())
    return h.hexdigest()


@dataclass
class StartPoint:
    """An in-memory θ (and φ) to fine-tune from, e.g. the live meta-parameters during meta-validation.

    ``prompts`` and ``regulators`` are deep-copied before use, so the caller's tensors are never
    modified nor frozen.  ``regulators``: ``{"ctx"|"vpt": R_φ}`` as ``GRAMMetaLearner.regulators()``.
    """

    prompts: PromptParams
    regulators: Mapping[str, GradientRegulator] = field(default_factory=dict)
    label: str = "in_memory"
    launch: Optional[LaunchStep] = None   # the meta-trained inner step (needed by MethodSpec.launch)
    support_size: int = 0                 # images per meta-training support set (for MethodSpec.reg_window 0)


def _check_start(method: MethodSpec, dims: ClipDims, prompts: PromptParams) -> None:
    method = replace(method, **_depths(method, dims))
    problems = []
    ctx, vpt = prompts.ctx, prompts.vpt
    want_text = method.n_ctx_text
    if (ctx is None) != (want_text == 0) or (ctx is not None and tuple(ctx.shape) != (want_text, dims.text_width)):
        problems.append(f"ctx is {None if ctx is None else tuple(ctx.shape)}, method expects "
                        f"{(want_text, dims.text_width) if want_text else None}")
    want_vis = (method.vision_depth, method.n_ctx_vision, dims.vision_width) if method.n_ctx_vision else None
    if (None if vpt is None else tuple(vpt.shape)) != want_vis:
        problems.append(f"vpt is {None if vpt is None else tuple(vpt.shape)}, method expects {want_vis}")
    have = (prompts.text_depth, prompts.coupling)
    want = (method.text_depth if want_text else 0, method.coupling)
    if have != want:
        problems.append(f"(text_depth, coupling) is {have}, method expects {want}")
    if problems:
        raise ValueError(f"method {method.name!r}: start point does not fit: " + "; ".join(problems))


def _depths(method: MethodSpec, dims: ClipDims) -> dict:
    """``text_depth`` / ``vision_depth`` of ``method`` on this CLIP (0 = all layers resolved)."""
    if method.zero_shot:
        return {}
    spec = method.prompt_spec().resolved(dims)
    return {"text_depth": spec.text_depth, "vision_depth": spec.vision_depth}
def _scratch_prompts(method: MethodSpec, clip: nn.Module, dims: ClipDims, seed: int) -> PromptParams:
    """Scratch / word-initialised θ drawn from ``torch.Generator().manual_seed(seed)``."""
    generator = torch.Generator().manual_seed(seed)
    return PromptParams.from_spec(method.prompt_spec(), clip, dims, generator=generator)


def build_prompts(method: MethodSpec, clip: nn.Module, dims: ClipDims, seed: int,
                  start: Optional[StartPoint] = None
                  ) -> tuple[Optional[PromptParams], Optional[GradientRegulation], dict]:
    """θ (and R_φ) at the start of fine-tuning, plus a JSON-able description of where they came from.

    Scratch prompts are drawn from ``torch.Generator().manual_seed(seed)``; word init embeds
    ``method.ctx_init``; a GRAM file is validated against the method's token counts and widths
    (``meta.init_io.load_gram_init``); an in-memory ``start`` is copied and shape-checked.  With
    ``method.init_prompts`` False, θ is the scratch start and only R_φ comes from the file / start.
    With ``method.launch`` the description holds ``"launch"`` (:class:`meta.finetune.LaunchStep` fields);
    with a regulator, ``"reg_window"``: images per regulated step, ``method.reg_window`` or, for 0, the
    meta-training support size of the file / start point (:func:`meta.finetune.resolve_window`).
    Returns ``(None, None, info)`` for zero-shot CLIP.
    """
    if method.zero_shot:
        return None, None, {"source": "none"}
    device = clip.token_embedding.weight.device
    regulation = None
    launch: Optional[LaunchStep] = None
    window = 1
    if start is not None:
        if method.init_path or method.ctx_init:
            raise ValueError(f"method {method.name!r}: a start point replaces init_path/ctx_init; give one of them")
        if method.init_prompts:
            prompts = copy.deepcopy(start.prompts).to(device)
            for p in prompts.parameters():
                p.requires_grad_(True)
        else:
            prompts = _scratch_prompts(method, clip, dims, seed).to(device)
        _check_start(method, dims, prompts)
        if method.regulate:
            if not start.regulators:
                raise ValueError(f"method {method.name!r}: regulate=True but the start point has no regulators")
            regulation = GradientRegulation(dict(start.regulators), norm_preserve=method.norm_preserve).to(device)
            if method.reg_window == 0 and start.support_size < 1:
                raise ValueError(f"method {method.name!r}: reg_window 0 (the meta-training support size) needs "
                                 f"StartPoint.support_size")
            window = method.reg_window or start.support_size
        if method.launch is True or (method.launch_on(True) and start.launch is not None):
            if start.launch is None:
                raise ValueError(f"method {method.name!r}: launch=True but the start point has no LaunchStep")
            launch = start.launch
        info = {"source": "in_memory" if method.init_prompts else "scratch", "label": start.label}
    elif method.init_path:
        method = replace(method, **_depths(method, dims))
        expect = {"text_width": dims.text_width, "vision_width": dims.vision_width,
                  "n_ctx_text": method.n_ctx_text, "n_ctx_vision": method.n_ctx_vision,
                  "vision_depth": method.vision_depth if method.n_ctx_vision else 0,
                  "text_depth": method.text_depth if method.n_ctx_text else 0, "coupling": method.coupling,
                  "model_name": dims.model_name}
        init = load_gram_init(method.init_path, expect=expect, config_key=f"method {method.name!r} init_path")
        prompts = (init.prompt_module() if method.init_prompts
                   else _scratch_prompts(method, clip, dims, seed)).to(device)
        if method.regulate:
            regulators = init.regulator_modules()
            if not regulators:
                raise ValueError(f"method {method.name!r}: regulate=True but {method.init_path} holds no regulator φ")
            regulation = GradientRegulation(regulators, norm_preserve=method.norm_preserve).to(device)
            window = resolve_window(method.reg_window, init.metadata,
                                    source=f"method {method.name!r} init_path {method.init_path}")
        if method.launch_on(True):
            launch = launch_step_of(init.metadata, source=f"method {method.name!r} init_path {method.init_path}",
                                    explicit=method.launch is True)
        info = {"source": "gram_file" if method.init_prompts else "scratch", "path": str(method.init_path),
                "provenance": init.metadata.get("provenance", {}), "regulator": init.metadata.get("regulator")}
        if not method.init_prompts:
            info.update(ctx_init=method.ctx_init, init_std=method.init_std,
                        vpt_init=method.vpt_init if method.n_ctx_vision else "")
    else:
        if method.regulate or method.launch is True:
            what = "regulate=True needs φ" if method.regulate else "launch=True needs α"
            raise ValueError(f"method {method.name!r}: {what}: set init_path (a GRAM init file) or pass a StartPoint")
        prompts = _scratch_prompts(method, clip, dims, seed)
        info = {"source": "words" if method.ctx_init else "scratch", "ctx_init": method.ctx_init,
                "init_std": method.init_std, "vpt_init": method.vpt_init if method.n_ctx_vision else ""}
    if launch is not None:
        info["launch"] = {"alpha": launch.alpha, "steps": launch.steps, "momentum": launch.momentum}
    if regulation is not None:
        info["reg_window"] = window   # images per regulated step, resolved
    info["prompt_sha256"] = prompt_digest(prompts)
    return prompts, regulation, info


def make_optimizer(params: Sequence[torch.Tensor], spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimiser of Dassl's ``build_optimizer`` for ``spec.optimizer`` (torch classes)."""
    params = list(params)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, spec: TrainSpec) -> sched.LRScheduler:
    """Per-epoch schedule: ``warmup_epochs`` at ``warmup_lr``, then cosine over ``epochs`` (or constant).

    The Dassl trainers' schedule (:func:`meta.schedule.epoch_scheduler`): Dassl's
    ``ConstantWarmupScheduler(CosineAnnealingLR(T_max=MAX_EPOCH))`` with WARMUP_RECOUNT; for
    CoCoOp's settings the epoch lrs are 1e-5, 0.002, 0.00195, ..., 0.00019.
    """
    return epoch_scheduler(optimizer, schedule=spec.scheduler, max_epoch=max(spec.epochs, 1),
                           warmup_epochs=spec.warmup_epochs, warmup_type="constant", warmup_cons_lr=spec.warmup_lr)


class PromptTuner:
    """Fine-tunes θ of one method on a :class:`LabelledSet` and measures accuracy.

    Args:
        pclip: the frozen CLIP wrapper matching the prompts' text context length.
        prompts: θ (``None`` for zero-shot CLIP).
        regulation: R_φ applied to every prompt gradient, or ``None`` for raw gradients.
        spec: schedule and batch settings.
        seed: seeds batch order and the view offsets (``torch.Generator``, no global state).
        train_images: ``(impath, epoch) -> [3, S, S]`` augmented image, used with visual prompts.
        test_images: ``impath -> [3, S, S]`` test-transformed image, used with visual prompts.
        reg_window: regulation window in batches (:class:`meta.finetune.UpdateWindow`; 1 = every batch).
        launch_step: the meta-trained inner step applied by :meth:`launch` (``None`` = no launch).
    """

    def __init__(self, pclip: PromptedCLIP, prompts: Optional[PromptParams],
                 regulation: Optional[GradientRegulation], spec: TrainSpec, seed: int,
                 train_images: Callable[[str, int], torch.Tensor],
                 test_images: Callable[[str], torch.Tensor], reg_window: int = 1,
                 launch_step: Optional[LaunchStep] = None):
        self.pclip = pclip
        self.prompts = prompts
        self.regulation = regulation
        self.spec = spec
        self.seed = seed
        self.train_images = train_images
        self.test_images = test_images
        self.loss_fn = classification_loss(pclip)
        self.device = pclip.clip.token_embedding.weight.device
        self.reg_window = int(reg_window)
        self.launch_step = launch_step

    # ---------------------------------------------------------------- launch
    def _test_batches(self, data: LabelledSet) -> list[dict]:
        """``data`` in test-time batches of ``spec.test_batch_size`` as loss-function inputs (no augmentation)."""
        out = []
        step = self.spec.test_batch_size
        for start in range(0, len(data), step):
            batch = {"classnames": data.classnames, "label": data.labels[start:start + step].to(self.device)}
            if data.features is not None:
                feats = data.features[start:start + step]
                batch["features"] = (feats[:, 0] if feats.dim() == 3 else feats).to(self.device)
            else:
                batch["images"] = torch.stack([self.test_images(p) for p in data.impaths[start:start + step]]
                                              ).to(self.device)
            out.append(batch)
        return out

    def launch(self, data: LabelledSet) -> Optional[float]:
        """Apply :attr:`launch_step` to θ with the mean gradient over ``data`` (test transform); returns the
        mean train loss before it, or ``None`` when there is no launch step (or no prompts)."""
        if self.launch_step is None or self.prompts is None:
            return None
        if len(data) == 0:
            raise ValueError("cannot launch on an empty train split")
        batches = self._test_batches(data)
        n = len(data)

        def mean_loss(prompts: nn.Module) -> torch.Tensor:
            total = None
            for batch in batches:
                loss, _ = self.loss_fn(prompts, batch)
                part = loss * (len(batch["label"]) / n)
                total = part if total is None else total + part
            return total

        return launch_(self.prompts, self.regulation, mean_loss, self.launch_step)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def accuracy(self, data: LabelledSet) -> float:
        """Top-1 accuracy in percent on ``data`` with the current prompts."""
        if len(data) == 0:
            raise ValueError("cannot measure accuracy on an empty split")
        text = self.pclip.text_features(self.prompts, data.classnames)          # [C, E]
        correct = 0
        step = self.spec.test_batch_size
        for start in range(0, len(data), step):
            if data.features is not None:
                image = data.features[start:start + step].to(self.device)
            else:
                x = torch.stack([self.test_images(p) for p in data.impaths[start:start + step]]).to(self.device)
                image = self.pclip.image_features(self.prompts, x)
            logits = image @ text.t()                                             # [b, C]
            correct += int((logits.argmax(dim=1).cpu() == data.labels[start:start + step]).sum())
        return 100.0 * correct / len(data)

    # ---------------------------------------------------------------- training
    def _batches(self, n: int, generator: torch.Generator) -> list[torch.Tensor]:
        order = torch.randperm(n, generator=generator)
        size = self.spec.batch_size
        batches = list(order.split(size))
        if n >= size and len(batches[-1]) < size:  # Dassl: drop_last = is_train and len(data) >= batch_size
            batches.pop()
        return batches

    def fit(self, data: LabelledSet, on_epoch: Optional[Callable[[int], dict]] = None,
            progress: bool = False) -> list[dict]:
        """Train for ``spec.epochs``; returns one row per epoch.

        Each row: ``epoch`` (1-based), ``lr`` used, ``train_loss`` (mean), ``train_acc`` (%),
        ``seconds`` (training), plus whatever ``on_epoch(epoch)`` returns and ``eval_seconds``
        (called after every epoch when ``spec.eval_every_epoch``, else after the last one only).
        """
        if self.prompts is None or self.spec.epochs == 0:
            return []
        if len(data) == 0:
            raise ValueError("the few-shot train split is empty")
        optimizer = make_optimizer([p for p in self.prompts.parameters() if p.requires_grad], self.spec)
        scheduler = make_scheduler(optimizer, self.spec)
        window = UpdateWindow(self.reg_window)
        optimizer.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(self.seed)
        views = data.features.shape[1] if data.features is not None else 0
        offsets = torch.randint(views, (len(data),), generator=generator) if views else None
        history = []
        epochs = range(self.spec.epochs)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=self.spec.epochs, desc="fine-tune", unit="ep", leave=False)
        for epoch in epochs:
            start = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            loss_sum, correct, seen = 0.0, 0, 0
            batches = self._batches(len(data), generator)
            for b, idx in enumerate(batches):
                labels = data.labels[idx].to(self.device)
                batch = {"classnames": data.classnames, "label": labels}
                if offsets is not None:
                    view = (offsets[idx] + epoch) % views
                    batch["features"] = data.features[idx, view].to(self.device)
                else:
                    batch["images"] = torch.stack([self.train_images(data.impaths[i], epoch)
                                                   for i in idx.tolist()]).to(self.device)
                loss, logits = self.loss_fn(self.prompts, batch)
                loss.backward()                      # sums into p.grad until the window closes
                count = window.push(last=b + 1 == len(batches))
                if count:
                    if self.regulation is not None:
                        self.regulation.apply_(self.prompts.named_parameters(), count=count)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                loss_sum += float(loss.detach()) * len(idx)
                correct += int((logits.detach().argmax(dim=1) == labels).sum())
                seen += len(idx)
            scheduler.step()
            row = {"epoch": epoch + 1, "lr": lr, "train_loss": loss_sum / max(seen, 1),
                   "train_acc": 100.0 * correct / max(seen, 1), "seconds": time.perf_counter() - start}
            if on_epoch is not None and (self.spec.eval_every_epoch or epoch + 1 == self.spec.epochs):
                t_eval = time.perf_counter()
                row.update(on_epoch(epoch + 1))
                row["eval_seconds"] = time.perf_counter() - t_eval
            history.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['train_loss']:.3f}", acc=f"{row['train_acc']:.1f}")
            if not torch.isfinite(torch.tensor(row["train_loss"])):
                raise FloatingPointError(f"training loss became {row['train_loss']} at epoch {epoch + 1}; "
                                         f"lower TrainSpec.lr ({self.spec.lr})")
        if bar is not None:
            bar.close()
        return history

