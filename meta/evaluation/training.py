"""Few-shot prompt tuning with (optionally regulated) gradients, and accuracy on labelled sets.

The start (θ, R_φ, window, launch step) and the update are the Dassl trainers' own, from :mod:`meta.finetune.engine`
(paper Eq. 7 at test time): per batch of the few-shot train set the cross-entropy of prompted-CLIP logits goes
through ``RegulatedStepper.backward`` (the window's gradients summed, then ``p.grad <- n R_φ(mean)`` and one SGD
step), and after the epoch's last batch ``scheduler.step()`` (Dassl's per-epoch ``update_lr``).  The evaluator's own:
cached image features, seeded batch order and augmented views.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.optim import lr_scheduler as sched

from meta.evaluation.spec import MethodSpec, TrainSpec
from meta.finetune.cache import cache_and_predict
from meta.finetune.engine import RegulatedStepper, StartPoint, build_start, window_batches
from meta.finetune.regulated import (
    GradientRegulation,
    LaunchStep,
    check_gate_regulariser,
    launch_,
    step_on_batch,
    weighted_sum,
)
from meta.finetune.schedule import epoch_scheduler
from meta.finetune.testtime import NO_PROMPTS, TestTimeSpec, calibration_error, tune_and_predict
from meta.method.consistency import ConsistencySpec
from meta.method.learners import feature_logits, learner_of
from meta.method.metrics import count_correct
from meta.method.prompts import PromptedCLIP, PromptParams, classification_loss
from meta.model.backbone import ClipDims


@dataclass
class LabelledSet:
    """One split ready for the model: N ``impaths``, ``labels`` ``[N]`` (int64, 0..C-1), C ``classnames`` (index =
    label) and, when the image side has no prompts, frozen-tower ``features`` (``[N, E]`` for a test set,
    ``[N, V, E]`` with V augmented views for a train set; ``None`` with visual prompts)."""

    impaths: list[str]
    labels: torch.Tensor
    classnames: list[str]
    features: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.impaths)


def build_prompts(
    method: MethodSpec, clip: nn.Module, dims: ClipDims, seed: int, start: Optional[StartPoint] = None
) -> tuple[Optional[PromptParams], Optional[GradientRegulation], dict]:
    """θ (and R_φ) at the start of fine-tuning, plus a JSON-able description of where they came from:
    :func:`meta.finetune.engine.build_start` of :meth:`MethodSpec.start_spec` (the Dassl trainers build theirs from
    ``GramSettings.start_spec``), scratch prompts drawn from ``torch.Generator().manual_seed(seed)``.

    With a launch step the description holds ``"launch"`` (:class:`meta.finetune.regulated.LaunchStep` fields); with a
    regulator, ``"reg_window"``: images per regulated step (``method.reg_window``, 0 resolved to the meta-training
    support size of the file / start point).  ``(None, None, info)`` for zero-shot CLIP.
    """
    if method.zero_shot:
        return None, None, {"source": "none"}
    built = build_start(method.start_spec(), clip, dims, generator=torch.Generator().manual_seed(seed), point=start)
    return built.prompts, built.regulation, built.info


def make_optimizer(params: Sequence[torch.Tensor], spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimiser of Dassl's ``build_optimizer`` for ``spec.optimizer`` (torch classes)."""
    params = list(params)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay)
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


def make_scheduler(optimizer: torch.optim.Optimizer, spec: TrainSpec) -> sched.LRScheduler:
    """Per-epoch schedule: ``warmup_epochs`` at ``warmup_lr``, then cosine over ``epochs`` (or constant), the Dassl
    trainers' :func:`meta.finetune.schedule.epoch_scheduler`; CoCoOp's epoch lrs are 1e-5, 0.002, 0.00195, ..., 0.00019.
    """
    return epoch_scheduler(
        optimizer,
        schedule=spec.scheduler,
        max_epoch=max(spec.epochs, 1),
        warmup_epochs=spec.warmup_epochs,
        warmup_type="constant",
        warmup_cons_lr=spec.warmup_lr,
    )


class _LazyImages:
    """The test-transformed images of ``impaths`` (``[3, S, S]`` each on ``device``), read when indexed."""

    def __init__(self, impaths: Sequence[str], read: Callable[[str], torch.Tensor], device: torch.device):
        self.impaths, self.read, self.device = list(impaths), read, device

    def __len__(self) -> int:
        return len(self.impaths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.read(self.impaths[i]).to(self.device)


class PromptTuner:
    """Fine-tunes θ of one method on a :class:`LabelledSet` and measures accuracy.

    Args:
        pclip: the frozen CLIP wrapper matching the prompts' text context length.
        prompts, regulation: θ (``None`` for zero-shot CLIP) and R_φ (``None``: raw gradients).
        spec, seed: schedule and batch settings; the seed of batch order and view offsets (no global state).
        train_images, test_images: ``(impath, epoch)`` / ``impath -> [3, S, S]`` augmented / test-transformed
            images, used with visual prompts.
        reg_window: regulation window in images (resolved, >= 1; turned into batches by ``window_batches``).
        launch_step: the meta-trained inner step applied by :meth:`launch` (``None`` = no launch).
        consistency: the zero-shot consistency weights of the fine-tuning loss.
    """

    def __init__(
        self,
        pclip: PromptedCLIP,
        prompts: Optional[PromptParams],
        regulation: Optional[GradientRegulation],
        spec: TrainSpec,
        seed: int,
        train_images: Callable[[str, int], torch.Tensor],
        test_images: Callable[[str], torch.Tensor],
        reg_window: int = 1,
        launch_step: Optional[LaunchStep] = None,
        consistency: Optional[ConsistencySpec] = None,
    ):
        self.pclip = pclip
        self.prompts = prompts
        self.regulation = regulation
        self.spec = spec
        self.seed = seed
        self.train_images = train_images
        self.test_images = test_images
        self.loss_fn = classification_loss(pclip, consistency)  # the fine-tuning loss
        check_gate_regulariser(regulation, self.loss_fn.parts is not None)
        self.launch_loss_fn = classification_loss(pclip)  # the launch step replays the meta-trained (task) loss
        self.device = pclip.clip.token_embedding.weight.device
        self.reg_window = int(reg_window)
        self.launch_step = launch_step

    # ---------------------------------------------------------------- launch
    def _test_batches(self, data: LabelledSet) -> list[dict]:
        """``data`` in test-time batches of ``spec.test_batch_size`` as loss-function inputs (no augmentation)."""
        out = []
        step = self.spec.test_batch_size
        for start in range(0, len(data), step):
            batch = {"classnames": data.classnames, "label": data.labels[start : start + step].to(self.device)}
            if data.features is not None:
                feats = data.features[start : start + step]
                batch["features"] = (feats[:, 0] if feats.dim() == 3 else feats).to(self.device)
            else:
                images = [self.test_images(p) for p in data.impaths[start : start + step]]
                batch["images"] = torch.stack(images).to(self.device)
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

        gated = self.regulation is not None and self.regulation.gated and self.loss_fn.parts is not None

        def mean_loss(prompts: nn.Module):
            if gated:  # the gate was meta-trained on the regularised support loss: the launch replays it in parts
                return weighted_sum((self.loss_fn.parts(prompts, b)[:2], len(b["label"]) / n) for b in batches)
            return weighted_sum((self.launch_loss_fn(prompts, b)[0], len(b["label"]) / n) for b in batches)

        return launch_(self.prompts, self.regulation, mean_loss, self.launch_step)

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def _batch_logits(self, data: LabelledSet, *scales: float):
        """``(start, [logits [b, C]] per scale)`` per test batch of ``data`` with the current prompts: one encoding,
        cosines times each of ``scales``."""
        learner = learner_of(self.prompts) if self.prompts is not None else None
        per_image = learner is not None and learner.per_image_text  # text features [b, C, E], one set per image
        text = None if per_image else self.pclip.text_features(self.prompts, data.classnames)  # [C, E], once
        step = self.spec.test_batch_size
        for start in range(0, len(data), step):
            x, image = None, None
            if data.features is not None:
                image = data.features[start : start + step].to(self.device)
            else:
                x = torch.stack([self.test_images(p) for p in data.impaths[start : start + step]]).to(self.device)
            if per_image:
                image, batch_text = learner.features(self.pclip, self.prompts, data.classnames, x, image)
            else:
                image = self.pclip.image_features(self.prompts, x) if image is None else image
            yield start, [feature_logits(scale, image, batch_text if per_image else text) for scale in scales]

    def accuracy(self, data: LabelledSet, scaled: Optional[list] = None) -> float:
        """Top-1 accuracy in percent on ``data`` with the current prompts; ``scaled`` (a list) gains the same pass's
        logits at CLIP's scale, per batch (the confidences ECE reads: :meth:`test_time`'s ``plain``)."""
        if len(data) == 0:
            raise ValueError("cannot measure accuracy on an empty split")
        step, correct = self.spec.test_batch_size, 0
        scales = (1.0,) if scaled is None else (1.0, self.pclip.logit_scale)
        for start, logits in self._batch_logits(data, *scales):
            correct += count_correct(logits[0], data.labels[start : start + step])
            if scaled is not None:
                scaled.append(logits[1])
        return 100.0 * correct / len(data)

    def test_time(
        self, data: LabelledSet, spec: TestTimeSpec, progress: bool = False, plain: Optional[torch.Tensor] = None
    ) -> dict:
        """TPT (:mod:`meta.finetune.testtime`) on every image of ``data`` from the current θ, with R_φ on the entropy
        gradient when the method regulates, or with ``spec.adapt`` cache TDA's caches over the stream
        (:mod:`meta.finetune.cache`; zero-shot CLIP too): ``{accuracy, ece, loss_before, loss_after,
        seconds_per_image, peak_mib_per_image}`` (percent, nats, seconds, MiB:
        :class:`meta.finetune.testtime.TestTimeResult`) beside the plain predictions' ``accuracy_before`` and
        ``ece_before`` (from ``plain``, their ``[n, C]`` scaled logits, when the caller kept them from
        :meth:`accuracy`; else one more pass)."""
        cache = spec.adapt == "cache"
        if self.prompts is None and not cache:
            raise ValueError(f"test-time tuning: {NO_PROMPTS}")
        if cache and self.prompts is not None and learner_of(self.prompts).per_image_text:
            raise ValueError(
                "test-time adapt cache: needs one text embedding per class (this learner's differs per image)"
            )
        if plain is None:
            kept: list = []
            self.accuracy(data, kept)
            plain = torch.cat(kept)
        images = _LazyImages(data.impaths, self.test_images, self.device)
        seed = self.seed
        if cache:
            tuned = cache_and_predict(self.pclip, self.prompts, images, data.classnames, spec, seed, progress)
        else:
            tuned = tune_and_predict(
                self.pclip,
                self.prompts,
                images,
                data.classnames,
                spec,
                self.regulation,
                seed,
                progress,
                self.launch_step,
            )
        labels = data.labels
        return {
            "accuracy": 100.0 * count_correct(tuned.logits, labels) / len(data),
            "ece": calibration_error(tuned.logits, labels),
            "accuracy_before": 100.0 * count_correct(plain, labels) / len(data),
            "ece_before": calibration_error(plain, labels),
            "loss_before": tuned.loss_before,
            "loss_after": tuned.loss_after,
            "seconds_per_image": tuned.seconds_per_image,
            "peak_mib_per_image": tuned.peak_mib_per_image,
        }

    # ---------------------------------------------------------------- training
    def _batches(self, n: int, generator: torch.Generator) -> list[torch.Tensor]:
        """One epoch's batches of indices: a seeded permutation (``spec.order`` random) or ``0..n-1`` (sequential,
        Dassl's ``SequentialSampler``: replays a Dassl run's order)."""
        order = torch.randperm(n, generator=generator) if self.spec.order == "random" else torch.arange(n)
        size = self.spec.batch_size
        batches = list(order.split(size))
        if n >= size and len(batches[-1]) < size:  # Dassl: drop_last = is_train and len(data) >= batch_size
            batches.pop()
        return batches

    def fit(
        self, data: LabelledSet, on_epoch: Optional[Callable[[int], dict]] = None, progress: bool = False
    ) -> list[dict]:
        """Train for ``spec.epochs``; one row per epoch: ``epoch`` (1-based), ``lr`` used, ``train_loss`` (mean),
        ``train_acc`` (%), ``seconds`` (training), plus what ``on_epoch(epoch)`` returns and ``eval_seconds`` (after
        every epoch with ``spec.eval_every_epoch``, else after the last one)."""
        if self.prompts is None or self.spec.epochs == 0:
            return []
        if len(data) == 0:
            raise ValueError("the few-shot train split is empty")
        optimizer = make_optimizer([p for p in self.prompts.parameters() if p.requires_grad], self.spec)
        scheduler = make_scheduler(optimizer, self.spec)
        stepper = RegulatedStepper(
            self.prompts, optimizer, self.regulation, window_batches(self.reg_window, self.spec.batch_size)
        )
        optimizer.zero_grad(set_to_none=True)
        generator = torch.Generator().manual_seed(self.seed)
        views = data.features.shape[1] if data.features is not None else 0
        offsets = torch.randint(views, (len(data),), generator=generator) if views else None
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.spec.epochs, desc="fine-tune", unit="ep", leave=False, disable=not progress)
        for epoch in range(self.spec.epochs):
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
                    images = [self.train_images(data.impaths[i], epoch) for i in idx.tolist()]
                    batch["images"] = torch.stack(images).to(self.device)
                # regulates and steps when the window closes
                loss, logits = step_on_batch(stepper, self.loss_fn, self.prompts, batch, last=b + 1 == len(batches))
                loss_sum += float(loss.detach()) * len(idx)
                correct += count_correct(logits, labels)
                seen += len(idx)
            scheduler.step()
            row = {
                "epoch": epoch + 1,
                "lr": lr,
                "train_loss": loss_sum / max(seen, 1),
                "train_acc": 100.0 * correct / max(seen, 1),
                "seconds": time.perf_counter() - start,
            }
            if on_epoch is not None and (self.spec.eval_every_epoch or epoch + 1 == self.spec.epochs):
                t_eval = time.perf_counter()
                row.update(on_epoch(epoch + 1))
                row["eval_seconds"] = time.perf_counter() - t_eval
            history.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", acc=f"{row['train_acc']:.1f}")
            if not torch.isfinite(torch.tensor(row["train_loss"])):
                raise FloatingPointError(
                    f"training loss became {row['train_loss']} at epoch {epoch + 1}; "
                    f"lower TrainSpec.lr ({self.spec.lr})"
                )
        bar.close()
        return history
