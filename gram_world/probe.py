"""How far can few-shot tuning go on a world dataset?  The ceiling of the frozen image features.

For each base-to-new world dataset and its *base* classes (CoOp's split: the first half of the
sorted labels), on the frozen, L2-normalised image features of a (pretrained) world CLIP:

* ``zeroshot``: accuracy of the hand-made prompt ``"a photo of a {}."`` (what CoOp starts from);
* ``probe_all``: a linear probe (scikit-learn ``LogisticRegression``) fitted on every train
  image of the base classes;
* ``probe_16``: the same on the protocol's 16-shot sample (``meta.data.coop_data``, seeds as given,
  mean over seeds);
* ``coop_fit`` (optional): CoOp's 4 context vectors fitted with Adam on every train image
  (no augmentation) - the reach of a text prompt through this text tower.
* ``vpt_fit`` (optional): VPT's 4 shallow visual tokens fitted the same way, the text prompt fixed -
  the reach of a visual prompt through this image tower.

The probe's inverse regularisation C is picked on the base classes' *val* split (never the test
split) from ``C_GRID``.  If ``probe_*`` is near ``zeroshot``, no prompt can gain on base: the image
features are the limit.  All accuracies are top-1 percent on the base classes' test split.
Run with ``python -m gram_world probe [--coop] [--vpt] [--quick] [--seed N] [--weights FILE]``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import open_clip
import torch

from meta.data.coop_data import Record
from meta.method.prompts import DEFAULT_TEMPLATE
from meta.model.backbone import load_clip

from .build import WorldPaths
from .clip_io import WORLD_MODEL, class_text_features, image_features, load_images

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
TEMPLATE = DEFAULT_TEMPLATE


def _features(clip, records: Sequence[Record], cache: dict) -> tuple[np.ndarray, np.ndarray]:
    """``([N, E] float32 features, [N] labels)`` of records (features memoised per path)."""
    todo = [r.impath for r in records if r.impath not in cache]
    if todo:
        feats = image_features(clip, load_images([Path(p) for p in todo])).numpy()
        cache.update(zip(todo, feats))
    return (
        np.stack([cache[r.impath] for r in records]).astype(np.float32),
        np.array([r.label for r in records], dtype=np.int64),
    )


def linear_probe(
    train: tuple[np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    grid: Sequence[float] = C_GRID,
) -> dict:
    """Fit ``LogisticRegression`` for every C in ``grid``, keep the best on ``val``; test accuracy (%).

    Each split is ``(features [N, E], labels [N])``.  Returns ``{"accuracy", "C", "val_accuracy"}``.
    """
    from sklearn.linear_model import LogisticRegression

    best = None
    for c in grid:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = LogisticRegression(C=c, max_iter=2000).fit(*train)
        val_acc = 100.0 * float((model.predict(val[0]) == val[1]).mean())
        if best is None or val_acc > best[0]:
            best = (val_acc, c, model)
    val_acc, c, model = best
    return {"accuracy": 100.0 * float((model.predict(test[0]) == test[1]).mean()), "C": c, "val_accuracy": val_acc}


def _adam_fit(
    prompts,
    loss_fn,
    classnames: Sequence[str],
    input_key: str,
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int,
    gen: torch.Generator,
    after_epoch: Optional[Callable[[], None]] = None,
) -> None:
    """Fit the trainable tensors of ``prompts`` with Adam: ``epochs`` shuffled passes over ``x``
    (``[N, ...]`` cached ``features`` or model-input ``images``, as ``input_key`` says) in batches."""
    opt = torch.optim.Adam([p for p in prompts.parameters() if p.requires_grad], lr=lr)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            loss, _ = loss_fn(prompts, {"classnames": list(classnames), "label": y[idx], input_key: x[idx]})
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if after_epoch is not None:
            after_epoch()


def coop_fit(
    clip,
    dims,
    classnames: Sequence[str],
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    epochs: int = 50,
    lr: float = 0.01,
    batch_size: int = 32,
    seed: int = 1,
) -> dict:
    """CoOp's 4 context vectors fitted with Adam on cached features; train and test accuracy (%)."""
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

    gen = torch.Generator().manual_seed(seed)
    prompts = PromptParams.from_spec(PromptSpec(n_ctx_text=4), clip, dims, generator=gen)
    pclip = PromptedCLIP(clip, dims, 4)
    loss_fn = classification_loss(pclip)
    _adam_fit(
        prompts,
        loss_fn,
        classnames,
        "features",
        torch.from_numpy(train[0]),
        torch.from_numpy(train[1]),
        epochs,
        lr,
        batch_size,
        gen,
    )
    with torch.no_grad():
        text = pclip.text_features(prompts, list(classnames))
        acc = {
            name: 100.0 * float(((torch.from_numpy(f) @ text.T).argmax(1).numpy() == lab).mean())
            for name, (f, lab) in (("train", train), ("test", test))
        }
    return {"accuracy": acc["test"], "train_accuracy": acc["train"], "epochs": epochs, "lr": lr}


def _images(records: Sequence[Record]) -> tuple[torch.Tensor, np.ndarray]:
    """``(uint8 images [N, S, S, 3], labels [N])`` of records, read from their files."""
    return load_images([Path(r.impath) for r in records]), np.array([r.label for r in records], dtype=np.int64)


def vpt_fit(
    clip,
    dims,
    classnames: Sequence[str],
    train: tuple[torch.Tensor, np.ndarray],
    test: tuple[torch.Tensor, np.ndarray],
    n_tokens: int = 4,
    vpt_init: str = "patch_mean",
    epochs: int = 30,
    lr: float = 0.01,
    batch_size: int = 32,
    seed: int = 1,
) -> dict:
    """VPT's shallow visual tokens fitted with Adam on every train image (no augmentation), the text
    side fixed to :data:`TEMPLATE`: the reach of a visual prompt through this image tower.

    ``train`` / ``test`` are ``(uint8 images [N, S, S, 3], labels [N])``.  Returns train and test
    accuracy (%) at the end and the best train accuracy over epochs (an optimisation check).
    """
    from meta.method.prompts import PromptedCLIP, PromptParams, PromptSpec, classification_loss

    from .clip_io import to_model_input

    gen = torch.Generator().manual_seed(seed)
    spec = PromptSpec(n_ctx_text=0, n_ctx_vision=n_tokens, vpt_init=vpt_init, template=TEMPLATE)
    prompts = PromptParams.from_spec(spec, clip, dims, generator=gen)
    pclip = PromptedCLIP(clip, dims, 0, template=TEMPLATE)
    loss_fn = classification_loss(pclip)

    def accuracy(images: torch.Tensor, labels: np.ndarray) -> float:
        with torch.no_grad():
            logits = pclip.logits(prompts, list(classnames), images=to_model_input(images))
        return 100.0 * float((logits.argmax(1).numpy() == labels).mean())

    train_curve = [accuracy(*train)]
    _adam_fit(
        prompts,
        loss_fn,
        classnames,
        "images",
        to_model_input(train[0]),
        torch.from_numpy(train[1]),
        epochs,
        lr,
        batch_size,
        gen,
        after_epoch=lambda: train_curve.append(accuracy(*train)),
    )
    best_train = max(train_curve)
    return {
        "accuracy": accuracy(*test),
        "train_accuracy": accuracy(*train),
        "best_train_accuracy": best_train,
        "epochs": epochs,
        "lr": lr,
        "n_tokens": n_tokens,
        "vpt_init": vpt_init,
    }


def probe_world(
    world: WorldPaths,
    weights: Optional[Path],
    model_name: str = WORLD_MODEL,
    seeds: Sequence[int] = (1, 2, 3),
    shots: int = 16,
    with_coop: bool = False,
    datasets: Sequence[str] = (),
    log: Callable[[str], None] = print,
    with_vpt: bool = False,
) -> dict:
    """``{dataset: {"zeroshot", "probe_all", "probe_16", ["coop_fit"], ["vpt_fit"], "n_base", ...}}``.

    ``weights=None`` probes random weights.  Accuracies in percent on the base test split.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clip, dims = load_clip(model_name, pretrained=str(weights) if weights is not None else None)
    clip.eval()
    return probe_model(
        world, clip, dims, open_clip.get_tokenizer(model_name), seeds, shots, with_coop, datasets, log, with_vpt
    )


def probe_model(
    world: WorldPaths,
    clip,
    dims,
    tokenizer,
    seeds: Sequence[int] = (1, 2, 3),
    shots: int = 16,
    with_coop: bool = False,
    datasets: Sequence[str] = (),
    log: Callable[[str], None] = print,
    with_vpt: bool = False,
) -> dict:
    """:func:`probe_world` for an in-memory CLIP in eval mode (e.g. during pretraining trials)."""
    from meta.evaluation import DatasetRef

    names = list(datasets) or [d.name for d in world.with_role("base2new")]
    out: dict = {}
    for name in names:
        ref = DatasetRef.from_dir(world.dataset(name).dataset_dir)
        full = ref.load(-1, seeds[0], "base", use_cache=False, log=lambda m: None)
        cache: dict = {}
        train, val, test = (_features(clip, recs, cache) for recs in (full.train, full.val, full.test))
        text = class_text_features(clip, tokenizer, full.classnames, TEMPLATE).numpy()
        row = {
            "n_base": len(full.classnames),
            "n_train": len(full.train),
            "n_val": len(full.val),
            "n_test": len(full.test),
            "zeroshot": 100.0 * float(((test[0] @ text.T).argmax(1) == test[1]).mean()),
            "zeroshot_val": 100.0 * float(((val[0] @ text.T).argmax(1) == val[1]).mean()),
            "probe_all": linear_probe(train, val, test),
        }
        few = []
        for seed in seeds:
            sample = ref.load(shots, seed, "base", use_cache=False, log=lambda m: None)
            few.append(linear_probe(_features(clip, sample.train, cache), val, test))
        row["probe_16"] = {
            "accuracy": float(np.mean([f["accuracy"] for f in few])),
            "per_seed": [f["accuracy"] for f in few],
            "C": [f["C"] for f in few],
        }
        if with_coop:
            row["coop_fit"] = coop_fit(clip, dims, full.classnames, train, test)
        if with_vpt:
            row["vpt_fit"] = vpt_fit(clip, dims, full.classnames, _images(full.train), _images(full.test))
        out[name] = row
        log(
            f"{name:14s} zero-shot {row['zeroshot']:5.1f}  probe all {row['probe_all']['accuracy']:5.1f}  "
            f"probe {shots}-shot {row['probe_16']['accuracy']:5.1f}"
            + (
                f"  CoOp fit {row['coop_fit']['accuracy']:5.1f} (train {row['coop_fit']['train_accuracy']:5.1f})"
                if with_coop
                else ""
            )
            + (
                f"  VPT fit {row['vpt_fit']['accuracy']:5.1f} (train {row['vpt_fit']['train_accuracy']:5.1f})"
                if with_vpt
                else ""
            )
        )
    return out


def probe_table(result: dict, shots: int = 16) -> str:
    """Markdown table of :func:`probe_world`'s result, with the dataset average."""
    fits = [
        (key, label)
        for key, label in (("coop_fit", "CoOp fit, all train"), ("vpt_fit", "VPT fit, all train"))
        if all(key in r for r in result.values())
    ]
    cols = ["zero-shot", "probe, all train", f"probe, {shots} shots"] + [label for _, label in fits]
    rows = []
    for name, r in result.items():
        vals = [r["zeroshot"], r["probe_all"]["accuracy"], r["probe_16"]["accuracy"]]
        rows.append((name, vals + [r[key]["accuracy"] for key, _ in fits]))
    mean = [float(np.mean([v[i] for _, v in rows])) for i in range(len(cols))]
    lines = ["| dataset (base classes) | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    lines += [f"| {n} | " + " | ".join(f"{v:.1f}" for v in vals) + " |" for n, vals in rows + [("average", mean)]]
    return "\n".join(lines)
