"""CoOp's evaluation protocols without Dassl: base-to-new, and cross-dataset / cross-domain transfer.

Base-to-new (CoCoOp, ``scripts/cocoop/base2new_{train,test}.sh`` in KaiyangZhou/CoOp;
``dassl/data/datasets/base_dataset.py`` in KaiyangZhou/Dassl.pytorch): draw K shots per class from train with the run's
seed, keep the base classes (first ceil(n/2) sorted labels, relabelled 0..m-1), fine-tune on them, then test on the base
classes' test images and on the new classes' test images with the text side rebuilt for the new class names.  H =
2BN/(B+N) of the two accuracies.

Transfer (CoOp's cross-dataset / cross-domain runs): fine-tune on all classes of a source
dataset (K shots), test on its test split and on the full test split of every target.

Accuracies are in percent.  Every result is a JSON-able dict holding all hyper-parameters, the shots each train class
really holds (``shots_per_class``: a class with fewer images than ``shots`` keeps them all) and the number of images
left out as over the size caps (``skipped_oversized``); both are also one stderr line per evaluation run.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Callable, Optional, Sequence

import open_clip
import torch
from torch import nn

from meta import __version__ as gram_version
from meta.data.coop_data import Record, harmonic_mean, warn_inputs
from meta.evaluation.datasets import DatasetRef
from meta.evaluation.images import FeatureCache, ImageLoader, eval_transform_key, train_transform_key, view_key
from meta.evaluation.spec import MethodSpec, TrainSpec
from meta.evaluation.training import LabelledSet, PromptTuner, StartPoint, build_prompts
from meta.finetune.engine import prompt_digest
from meta.finetune.regulated import LaunchStep
from meta.finetune.testtime import TestTimeSpec, check_optimizer, check_prototypes
from meta.method.prompts import PromptedCLIP, PromptParams
from meta.model.backbone import ClipDims


class EvaluationSession:
    """What many runs on one frozen CLIP share: the feature cache, image loaders, text caches.

    Args:
        cache_dir: optional folder for frozen image features on disk (keyed by the CLIP weights' fingerprint, image
            path and transform); "" / None keeps them in memory only.
        clip_info: extra JSON-able facts for result records (e.g. ``{"pretrained": path}``).
        log, progress: where messages go; tqdm bars while encoding images and fine-tuning.
        encode_batch_size: images per forward when pre-computing frozen features.
        exif_upright: turn every image upright by its EXIF orientation first (:mod:`meta.evaluation.images`); records
            of such runs hold ``"exif_upright": true``.
    """

    def __init__(
        self,
        clip: nn.Module,
        dims: ClipDims,
        cache_dir: Optional[str] = None,
        clip_info: Optional[dict] = None,
        log: Callable[[str], None] = print,
        progress: bool = False,
        encode_batch_size: int = 64,
        exif_upright: bool = False,
    ):
        self.clip = clip
        self.exif_upright = bool(exif_upright)
        self.dims = dims
        self.cache = FeatureCache(clip, cache_dir, batch_size=encode_batch_size)
        self.clip_info = {
            "model_name": dims.model_name,
            "weights_fingerprint": self.cache.fingerprint,
            "dims": dims.as_dict(),
            **(clip_info or {}),
        }
        self.log = log
        self.progress = progress
        self._loaders: dict[tuple, ImageLoader] = {}
        self._pclips: dict[tuple, PromptedCLIP] = {}
        self.warned: set[str] = set()  # input warnings already printed (coop_data.warn_inputs)

    def loader(self, scale: tuple[float, float]) -> ImageLoader:
        key = tuple(scale)
        if key not in self._loaders:
            self._loaders[key] = ImageLoader(self.dims.image_size, key, exif_upright=self.exif_upright)
        return self._loaders[key]

    def prompted_clip(self, n_ctx_text: int, template: str) -> PromptedCLIP:
        key = (n_ctx_text, template)
        if key not in self._pclips:
            self._pclips[key] = PromptedCLIP(self.clip, self.dims, n_ctx_text, template=template)
        return self._pclips[key]

    def _encode(self, items: list[tuple[str, str]], make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        if not self.progress:
            return self.cache.features(items, make)
        from tqdm import tqdm

        with tqdm(desc="encode images", unit="img", leave=False) as bar:
            return self.cache.features(items, make, progress=bar.update)

    def labelled_set(
        self,
        records: Sequence[Record],
        classnames: Sequence[str],
        method: MethodSpec,
        spec: TrainSpec,
        seed: int,
        train: bool,
        root: str,
    ) -> LabelledSet:
        """Records -> :class:`LabelledSet`, with frozen features when the tower has no prompts; augmented views are
        keyed by the path relative to the dataset root ``root`` (:func:`meta.evaluation.images.view_key`)."""
        impaths = [r.impath for r in records]
        labels = torch.tensor([r.label for r in records], dtype=torch.long)
        data = LabelledSet(impaths=impaths, labels=labels, classnames=list(classnames))
        if method.visual_prompts or not records:
            return data
        loader = self.loader(spec.rrcrop_scale)
        size, exif = self.dims.image_size, self.exif_upright
        if train and spec.augment == "coop":
            views = spec.aug_views
            items = [
                (p, train_transform_key(size, spec.rrcrop_scale, seed, v, exif)) for p in impaths for v in range(views)
            ]
            keys = [view_key(p, root) for p in impaths]
            feats = self._encode(
                items, lambda i: loader.train_view(impaths[i // views], seed, i % views, keys[i // views])
            )
            data.features = feats.view(len(impaths), views, -1)
        else:
            key = eval_transform_key(size, exif)
            feats = self._encode([(p, key) for p in impaths], lambda i: loader.test_view(impaths[i]))
            data.features = feats.unsqueeze(1) if train else feats
        return data

    def tuner(
        self, method: MethodSpec, spec: TrainSpec, seed: int, root: str, start: Optional[StartPoint] = None
    ) -> tuple[PromptTuner, dict]:
        """A :class:`PromptTuner` holding the method's initial θ (and R_φ), plus the init description; ``root``: the
        train images' dataset root (online augmented views are keyed relative to it)."""
        prompts, regulation, init_info = build_prompts(method, self.clip, self.dims, seed, start)
        n_ctx = prompts.n_ctx_text if prompts is not None else 0
        pclip = self.prompted_clip(n_ctx, method.template)
        loader = self.loader(spec.rrcrop_scale)

        def train_images(impath: str, epoch: int) -> torch.Tensor:
            if spec.augment == "coop":
                return loader.train_view(impath, seed, epoch, view_key(impath, root))
            return loader.test_view(impath)

        launch = LaunchStep(**init_info["launch"]) if "launch" in init_info else None
        window = init_info.get("reg_window", 1) if regulation is not None else 1
        begin = dict(reg_window=window, launch_step=launch, consistency=method.consistency())
        tuner = PromptTuner(pclip, prompts, regulation, spec, seed, train_images, loader.test_view, **begin)
        return tuner, init_info


def _record_head(
    protocol: str,
    session: EvaluationSession,
    method: MethodSpec,
    spec: TrainSpec,
    seed: int,
    shots: int,
    init_info: dict,
) -> dict:
    head = {
        "protocol": protocol,
        "method": method.name,
        "method_spec": method.as_dict(),
        "seed": seed,
        "shots": shots,
        "train_spec": spec.as_dict(),
        "trained": not method.zero_shot and spec.epochs > 0,
        "clip": session.clip_info,
        "init": init_info,
        "accuracy_unit": "percent",
        "versions": {"gram": gram_version, "torch": torch.__version__, "open_clip": open_clip.__version__},
    }
    if session.exif_upright:  # only then: records of runs reading images as stored stay as they were
        head["exif_upright"] = True
    if "test_time" in init_info:  # what _run measured at test time, a key of the record's own
        head["test_time"] = init_info.pop("test_time")
    return head


def _run(
    session: EvaluationSession,
    method: MethodSpec,
    spec: TrainSpec,
    seed: int,
    root: str,
    train_records: Sequence[Record],
    train_classnames: Sequence[str],
    tests: dict[str, tuple[Sequence[Record], Sequence[str]]],
    summarise: Callable[[dict], dict],
    start: Optional[StartPoint] = None,
    test_time: Optional[TestTimeSpec] = None,
) -> tuple[list[dict], dict, dict, PromptTuner]:
    """Fine-tune on the train records and test on every named test set.

    Returns ``(history, final accuracies, init info, tuner)``; ``summarise(accs)`` adds derived
    numbers (H, target mean) to every accuracy row.  With ``test_time``, the final accuracies are those of TPT from
    the fine-tuned θ on each test image (:meth:`PromptTuner.test_time`), and ``init info`` gains ``test_time`` (the
    record's own key, :func:`_record_head`): the spec, the plain final accuracies, and per test set what
    :meth:`PromptTuner.test_time` measured.
    """
    tuner, init_info = session.tuner(method, spec, seed, root, start)
    if test_time is not None:  # before any fine-tuning: a refusal loses no work
        check_optimizer(test_time, tuner.launch_step)
        check_prototypes(test_time, tuner.regulation, "--test-time-prototypes")
    test_sets = {
        name: session.labelled_set(recs, names, method, spec, seed, train=False, root=root)
        for name, (recs, names) in tests.items()
    }

    plain: dict = {}  # with test_time: per set, the last plain pass's scaled logits (its ECE before tuning)

    def score(name: str, data) -> float:
        kept = [] if test_time is not None else None
        accuracy = tuner.accuracy(data, kept)
        if kept is not None:
            plain[name] = torch.cat(kept)
        return accuracy

    def measure(epoch: int) -> dict:
        accs = {name: score(name, data) for name, data in test_sets.items()}
        return {**accs, **summarise(accs)}

    history: list[dict] = []
    trains = tuner.prompts is not None and spec.epochs > 0
    if trains:
        train_set = session.labelled_set(train_records, train_classnames, method, spec, seed, train=True, root=root)
        if tuner.launch_step is not None:  # the meta-trained inner step on the unaugmented train images
            launch_set = session.labelled_set(
                train_records, train_classnames, method, spec, seed, train=False, root=root
            )
            init_info["launch"]["train_loss_before"] = tuner.launch(launch_set)
        if spec.eval_every_epoch:
            history.append({"epoch": 0, **measure(0)})
        history += tuner.fit(train_set, on_epoch=measure, progress=session.progress)
    final_row = history[-1] if history and all(k in history[-1] for k in test_sets) else None
    final = {k: final_row[k] for k in test_sets} if final_row else {}
    if not final:
        final = {name: score(name, data) for name, data in test_sets.items()}
    final.update(summarise(final))
    if test_time is not None:  # the plain pass that gave ``final`` gave the logits of ``ece_before`` too
        sets = {
            name: tuner.test_time(data, test_time, session.progress, plain[name]) for name, data in test_sets.items()
        }
        init_info["test_time"] = {"spec": asdict(test_time), "before": final, "regulated": tuner.regulation is not None}
        init_info["test_time"]["sets"] = sets
        final = {name: row["accuracy"] for name, row in sets.items()}
        final.update(summarise(final))
    return history, final, init_info, tuner


def evaluate_base_to_new(
    dataset: DatasetRef,
    clip: nn.Module,
    dims: ClipDims,
    method: MethodSpec,
    seed: int,
    shots: int = 16,
    train: Optional[TrainSpec] = None,
    session: Optional[EvaluationSession] = None,
    cache_dir: Optional[str] = None,
    use_split_cache: bool = True,
    start: Optional[StartPoint] = None,
    log: Callable[[str], None] = print,
    eval_split: str = "test",
    on_trained: Optional[Callable[[Optional[PromptParams]], None]] = None,
    test_time: Optional[TestTimeSpec] = None,
) -> dict:
    """One (dataset, method, seed) run of CoCoOp's base-to-new protocol.

    Args:
        method: what to fine-tune on ``dataset`` with the frozen ``clip`` (zero-shot CLIP when it has no prompts).
        seed: few-shot sample, scratch prompts, batch order and augmentation all follow it.
        shots, train: K images per base class; the schedule (default: CoCoOp's, :class:`TrainSpec`).
        session, cache_dir: share feature caches across runs (a new session, caching in ``cache_dir``, if ``None``).
        use_split_cache: read/write the few-shot sample cache of ``meta.data.coop_data``.
        start: fine-tune from this in-memory θ (and φ) instead of the method's own init
            (meta-validation of the live meta-parameters; they are copied, never modified).
        eval_split: ``test`` (the protocol) or ``val``: score the few-shot validation split of the base
            and new classes instead (CoOp's min(K, 4) per class), for choosing settings without test data.
        on_trained: called once with the fine-tuned θ (None for zero-shot CLIP) before the record is made,
            e.g. to save it or to compare it with a Dassl run's (tests/test_engine_agreement.py).
        test_time: score every test image after TPT from the fine-tuned θ (:func:`_run`); the record's ``base``,
            ``new`` and ``H`` are then the tuned ones and ``test_time`` holds the rest.

    Returns:
        a JSON-able record: ``base``, ``new``, ``H`` (percent), class names and split sizes, ``history`` (one row per
        epoch with ``lr``, ``train_loss``, ``train_acc`` and - every epoch when ``train.eval_every_epoch``, including
        epoch 0 - ``base``, ``new``, ``H``), the initial and final prompt digests, and every hyper-parameter.
    """
    t_start = time.perf_counter()
    spec = train or TrainSpec()
    session = session or EvaluationSession(clip, dims, cache_dir, log=log)
    stats_before = dict(session.cache.stats)
    base = dataset.load(shots, seed, "base", use_split_cache, log)
    new = dataset.load(shots, seed, "new", use_split_cache, log)
    if eval_split not in ("test", "val"):
        raise ValueError(f"eval_split must be 'test' or 'val', got {eval_split!r}")
    if eval_split == "val" and (not base.val or not new.val):
        raise ValueError(f"{dataset.name}: eval_split='val' but the dataset has no validation split")
    pick = (lambda sp: sp.test) if eval_split == "test" else (lambda sp: sp.val)
    tests = {"base": (pick(base), base.classnames), "new": (pick(new), new.classnames)}
    counts = warn_inputs(f"{dataset.name} (base classes)", base, shots, "--shots", session.warned)
    warn_inputs(f"{dataset.name} (new classes)", new, 0, "--shots", session.warned)

    def summarise(accs: dict) -> dict:
        return {"H": harmonic_mean(accs["base"], accs["new"])}

    history, final, init_info, tuner = _run(
        session, method, spec, seed, dataset.root, base.train, base.classnames, tests, summarise, start, test_time
    )
    if on_trained is not None:
        on_trained(tuner.prompts)
    record = _record_head("base2new", session, method, spec, seed, shots, init_info)
    record.update(
        {
            "dataset": dataset.name,
            "dataset_ref": dataset.as_dict(),
            "base_classnames": base.classnames,
            "new_classnames": new.classnames,
            "n_train": len(base.train),
            "shots_per_class": counts,
            "skipped_oversized": len(base.oversized.keys() | new.oversized.keys()),
            "eval_split": eval_split,
            "n_test_base": len(pick(base)),
            "n_test_new": len(pick(new)),
            "base": final["base"],
            "new": final["new"],
            "H": final["H"],
            "history": history,
            "final_prompt_sha256": prompt_digest(tuner.prompts),
            "regulation": tuner.regulation.summary() if tuner.regulation is not None else {},
            "feature_cache": {k: session.cache.stats[k] - stats_before[k] for k in stats_before},
            "seconds": time.perf_counter() - t_start,
        }
    )
    return record


def evaluate_transfer(
    source: DatasetRef,
    targets: Sequence[DatasetRef],
    clip: nn.Module,
    dims: ClipDims,
    method: MethodSpec,
    seed: int,
    shots: int = 16,
    train: Optional[TrainSpec] = None,
    session: Optional[EvaluationSession] = None,
    cache_dir: Optional[str] = None,
    use_split_cache: bool = True,
    protocol: str = "transfer",
    start: Optional[StartPoint] = None,
    log: Callable[[str], None] = print,
    test_time: Optional[TestTimeSpec] = None,
    eval_split: str = "test",
) -> dict:
    """Cross-dataset / cross-domain run: fine-tune on all classes of ``source``, test on ``targets``.

    The targets' full test splits are used (CoOp never few-shot samples test sets) with each target's own class names.
    ``protocol`` labels the record (``"cross_dataset"``, ``"cross_domain"``).  Returns a JSON-able record with
    ``source`` accuracy, ``targets`` ``{name: accuracy}``, ``target_mean`` (percent) and per-epoch ``history``.
    ``start``, ``test_time`` and ``eval_split`` (``val``: the source's few-shot val split, each target's full one) as
    in :func:`evaluate_base_to_new`.
    """
    t_start = time.perf_counter()
    spec = train or TrainSpec()
    session = session or EvaluationSession(clip, dims, cache_dir, log=log)
    stats_before = dict(session.cache.stats)
    src = source.load(shots, seed, "all", use_split_cache, log)
    if eval_split not in ("test", "val"):
        raise ValueError(f"eval_split must be 'test' or 'val', got {eval_split!r}")
    pick = (lambda sp: sp.test) if eval_split == "test" else (lambda sp: sp.val or [])
    counts = warn_inputs(source.name, src, shots, "--shots", session.warned)
    oversized = set(src.oversized)
    tests: dict[str, tuple[Sequence[Record], Sequence[str]]] = {"source": (pick(src), src.classnames)}
    target_names = []
    for ref in targets:
        splits = ref.load(-1, seed, "all", use_split_cache, log)
        warn_inputs(ref.name, splits, 0, "--shots", session.warned)
        oversized |= set(splits.oversized)
        name = ref.name if ref.name not in tests else f"{ref.name}#{len(tests)}"
        tests[name] = (pick(splits), splits.classnames)
        target_names.append(name)
    if eval_split == "val" and not all(recs for recs, _ in tests.values()):
        raise ValueError(
            f"eval_split='val' but {', '.join(n for n, (r, _) in tests.items() if not r)} has no val split"
        )

    def summarise(accs: dict) -> dict:
        vals = [accs[n] for n in target_names]
        return {"target_mean": sum(vals) / len(vals)} if vals else {}

    history, final, init_info, tuner = _run(
        session, method, spec, seed, source.root, src.train, src.classnames, tests, summarise, start, test_time
    )
    record = _record_head(protocol, session, method, spec, seed, shots, init_info)
    record.update(
        {
            "dataset": source.name,
            "dataset_ref": source.as_dict(),
            "target_refs": [t.as_dict() for t in targets],
            "classnames": src.classnames,
            "n_train": len(src.train),
            "shots_per_class": counts,
            "skipped_oversized": len(oversized),
            "n_test": {name: len(recs) for name, (recs, _) in tests.items()},
            **({"eval_split": eval_split} if eval_split != "test" else {}),  # records of test splits stay as they were
            "source": final["source"],
            "targets": {n: final[n] for n in target_names},
            "target_mean": final.get("target_mean"),
            "history": history,
            "final_prompt_sha256": prompt_digest(tuner.prompts),
            "feature_cache": {k: session.cache.stats[k] - stats_before[k] for k in stats_before},
            "seconds": time.perf_counter() - t_start,
        }
    )
    return record
