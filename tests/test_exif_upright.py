"""EXIF orientation downstream: the evaluator (``--exif-upright``, ``EvaluationSession(exif_upright=True)``) and the
Dassl trainers (``TRAINER.GRAM.EXIF_UPRIGHT True``) read a photo stored sideways as stored by default, as Dassl's
``read_image`` does, and upright, identically, when asked."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from meta.data.image_decode import open_upright, to_rgb8
from meta.evaluation.images import ImageLoader, eval_transform_key, train_transform_key

W, H = 16, 8  # the upright picture: landscape, red left half, blue right half
ROTATE_90 = 6  # EXIF orientation 6: the viewer turns the stored pixels 90 degrees clockwise


def _upright_picture() -> np.ndarray:
    arr = np.zeros((H, W, 3), dtype=np.uint8)
    arr[:, : W // 2] = (230, 20, 20)
    arr[:, W // 2 :] = (20, 20, 230)
    return arr


def write_sideways_jpeg(path: Path) -> Path:
    """The upright picture stored turned 90 degrees anticlockwise (8 wide, 16 high) with EXIF orientation 6."""
    exif = Image.Exif()
    exif[0x0112] = ROTATE_90
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = Image.fromarray(_upright_picture()).transpose(Image.Transpose.ROTATE_90)
    stored.save(path, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
    return path


def _is_upright(img: Image.Image) -> bool:
    diff = np.abs(np.asarray(img, dtype=np.int16) - _upright_picture()) if img.size == (W, H) else None
    return diff is not None and diff.max() <= 12  # JPEG noise; a wrong turn differs by ~200


@pytest.fixture
def sideways(tmp_path) -> Path:
    return write_sideways_jpeg(tmp_path / "photo.jpg")


def test_the_shared_reader_reads_as_stored_by_default_and_upright_when_asked(sideways):
    assert open_upright(sideways, False).size == (H, W)  # as stored: sideways
    assert _is_upright(open_upright(sideways, True))
    # the orientation is read before the conversion, whatever the conversion keeps of the file's EXIF block
    assert _is_upright(open_upright(sideways, True, convert=lambda img: img.convert("RGB")))
    assert _is_upright(open_upright(sideways, True, convert=to_rgb8))


def test_the_evaluators_reader_is_off_by_default(sideways, tiny_clip):
    from meta.evaluation import EvaluationSession

    assert ImageLoader.decode(str(sideways)).size == (H, W)
    assert ImageLoader(32).pil(str(sideways)).size == (H, W)
    assert _is_upright(ImageLoader.decode(str(sideways), exif_upright=True))
    assert _is_upright(ImageLoader(32, exif_upright=True).pil(str(sideways)))
    clip, dims = tiny_clip
    assert not EvaluationSession(clip, dims, log=lambda m: None).loader((0.08, 1.0)).exif_upright
    session = EvaluationSession(clip, dims, log=lambda m: None, exif_upright=True)
    assert _is_upright(session.loader((0.08, 1.0)).pil(str(sideways)))


def test_records_say_when_images_were_turned(tiny_clip):
    from meta.evaluation import EvaluationSession, MethodSpec, TrainSpec
    from meta.evaluation.protocol import _record_head

    clip, dims = tiny_clip
    zero_shot = MethodSpec("CLIP", n_ctx_text=0)
    for exif in (False, True):
        session = EvaluationSession(clip, dims, log=lambda m: None, exif_upright=exif)
        head = _record_head("base2new", session, zero_shot, TrainSpec(), 1, 4, {})
        assert head.get("exif_upright", False) is exif and ("exif_upright" in head) is exif  # absent when off


def test_cached_features_of_the_two_readings_never_mix():
    assert eval_transform_key(32) == "test:resize32-bicubic-center32-openai_norm"  # features cached so far still hit
    assert eval_transform_key(32, exif_upright=True) != eval_transform_key(32)
    assert train_transform_key(32, (0.5, 1.0), 1, 0, exif_upright=True) != train_transform_key(32, (0.5, 1.0), 1, 0)


def test_the_evaluator_cli_has_the_switch():
    from meta.evaluation.cli import _parser

    assert not _parser().parse_args(["base2new", "--dataset", "x"]).exif_upright
    assert _parser().parse_args(["base2new", "--dataset", "x", "--exif-upright"]).exif_upright


# ---------------------------------------------------------------- the Dassl side (needs Dassl)
def _dassl_cfg(**dataloader):
    from dassl.config import get_cfg_default

    cfg = get_cfg_default()
    cfg.INPUT.SIZE = (16, 16)
    for key, value in dataloader.items():
        cfg.DATALOADER[key] = value
    return cfg


def test_dassls_reader_and_the_upright_wrapper(sideways):
    pytest.importorskip("dassl", reason="Dassl not installed")
    from dassl.data.data_manager import DatasetWrapper
    from dassl.data.datasets import Datum

    from trainers.gram.dassl_trainers import UprightDatasetWrapper

    data = [Datum(impath=str(sideways), label=0, classname="photo")]
    assert DatasetWrapper(_dassl_cfg(), data)[0]["img"].size == (H, W)  # Dassl: as stored
    upright = UprightDatasetWrapper(_dassl_cfg(), data)[0]["img"]
    assert _is_upright(upright)
    # the evaluator's reader under --exif-upright gives the very same pixels
    assert np.array_equal(np.asarray(upright), np.asarray(ImageLoader(32, exif_upright=True).pil(str(sideways))))


@pytest.mark.parametrize(
    "transforms, is_train, dataloader",
    [
        ("none", False, {}),
        ("one", False, {"RETURN_IMG0": True}),
        ("two", True, {"K_TRANSFORMS": 2, "RETURN_IMG0": True}),
    ],
)
def test_the_upright_wrapper_gives_dassls_items_for_an_image_without_exif(tmp_path, transforms, is_train, dataloader):
    pytest.importorskip("dassl", reason="Dassl not installed")
    import torch
    import torchvision.transforms as T
    from dassl.data.data_manager import DatasetWrapper
    from dassl.data.datasets import Datum

    from trainers.gram.dassl_trainers import UprightDatasetWrapper

    path = tmp_path / "plain.png"
    Image.fromarray(_upright_picture()).save(path)
    tfm = {
        "none": None,
        "one": T.Compose([T.Resize(16), T.ToTensor()]),
        "two": [T.Compose([T.Resize(16), T.ToTensor()]), T.Compose([T.CenterCrop(8), T.ToTensor()])],
    }[transforms]
    data = [Datum(impath=str(path), label=3, domain=1, classname="plain")]
    cfg = _dassl_cfg(**dataloader)
    ours = UprightDatasetWrapper(cfg, data, transform=tfm, is_train=is_train)[0]
    theirs = DatasetWrapper(cfg, data, transform=tfm, is_train=is_train)[0]
    assert ours.keys() == theirs.keys()

    def same(a, b) -> bool:
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, Image.Image):
            return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))
        return a == b

    assert all(same(ours[k], theirs[k]) for k in theirs), sorted(k for k in theirs if not same(ours[k], theirs[k]))


def test_the_dassl_trainer_reads_upright_only_with_the_key(tmp_path):
    pytest.importorskip("dassl", reason="Dassl not installed")
    from dassl.data.data_manager import DatasetWrapper
    from dassl.engine import build_trainer
    from helpers import make_dtd

    import train
    from trainers.gram.dassl_trainers import UprightDatasetWrapper

    repo = Path(__file__).resolve().parents[1]
    make_dtd(tmp_path, n_classes=2, counts={"train": 2, "val": 1, "test": 1})
    for image in (tmp_path / "dtd" / "images").rglob("*.jpg"):
        write_sideways_jpeg(image)

    def build(*opts: str):
        args = train.build_parser().parse_args(
            ["--root", str(tmp_path), "--seed", "1", "--trainer", "GRAM_CoOp"]
            + ["--dataset-config-file", str(repo / "configs/datasets/dtd.yaml")]
            + ["--config-file", str(repo / "configs/trainers/coop.yaml")]
            + ["TRAINER.GRAM.MODEL_NAME", "GRAM-Test-Tiny", "TRAINER.GRAM.WEIGHTS", "none", "INPUT.SIZE", "(32, 32)"]
            + ["DATALOADER.NUM_WORKERS", "0", "DATASET.NUM_SHOTS", "1", *opts]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny test CLIP's RANDOM weights note
            return build_trainer(train.setup_cfg(args))

    def first_image(loader) -> Image.Image:
        dataset = loader.dataset  # the same wrapper class, without the transform: the image as read
        return type(dataset)(dataset.cfg, dataset.data_source, transform=None)[0]["img"]

    stock = build()
    assert not stock.cfg.TRAINER.GRAM.EXIF_UPRIGHT and stock.gram_dataset_wrapper is None
    assert all(type(loader.dataset) is DatasetWrapper for loader in (stock.train_loader_x, stock.test_loader))
    assert first_image(stock.train_loader_x).size == (H, W)  # as stored: Dassl's read_image, the published numbers

    turned = build("TRAINER.GRAM.EXIF_UPRIGHT", "True")
    loaders = (turned.train_loader_x, turned.val_loader, turned.test_loader)
    assert turned.gram_dataset_wrapper is UprightDatasetWrapper
    assert all(type(loader.dataset) is UprightDatasetWrapper for loader in loaders)
    assert all(_is_upright(first_image(loader)) for loader in loaders)
    assert (turned.num_classes, turned.lab2cname) == (stock.num_classes, stock.lab2cname)
