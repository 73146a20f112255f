"""Images into the frozen CLIP: CoOp's transforms, seeded augmentation, and a frozen-feature cache.

Transforms (Dassl.pytorch ``dassl/data/transforms/transforms.py``, as configured by CoOp's
``INPUT`` nodes: bicubic, CLIP mean/std):

* test: resize the shorter side to S, centre-crop S x S, to tensor, normalise;
* train (``augment="coop"``): ``RandomResizedCrop(S, scale)`` + ``RandomHorizontalFlip`` (no
  resize first: Dassl adds a plain resize only when neither random crop is requested), to tensor, normalise.

Augmentation is deterministic: view ``v`` of image ``p`` under run seed ``s`` is drawn inside
``torch.random.fork_rng`` from a generator seeded by ``(s, k, v)``, ``k`` the path relative to ``DATASET.ROOT``, so a
view is the same wherever the data lives and whether computed online or cached.  :class:`FeatureCache` keeps
L2-normalised features ``[E]`` in memory and optionally under ``<cache_dir>/<CLIP weights fingerprint>/``, keyed by
image path, size, mtime and transform.  Images are read as stored (Dassl's ``read_image``); ``exif_upright=True``
turns them upright first, under transform keys of their own (:data:`EXIF_KEY`); a file over the size caps is refused
before decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torchvision import transforms as T

from meta.data.image_caps import size_problem
from meta.data.image_decode import open_upright, to_rgb8
from meta.model.visual_encoder import encode_image_with_prompts

_BICUBIC = T.InterpolationMode.BICUBIC
EXIF_KEY = "-exif_upright"  # transform-key suffix of images turned upright by their EXIF orientation
_TO_CLIP_INPUT = (T.ToTensor(), T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD))  # stateless: shared


def eval_transform(size: int) -> T.Compose:
    """Dassl's test transform: shorter side -> ``size`` (bicubic), centre crop, CLIP normalisation."""
    return T.Compose([T.Resize(size, interpolation=_BICUBIC), T.CenterCrop(size), *_TO_CLIP_INPUT])


def train_transform(size: int, scale: tuple[float, float] = (0.08, 1.0)) -> T.Compose:
    """CoOp's train transform: random resized crop (bicubic) + horizontal flip + CLIP normalisation."""
    crop = T.RandomResizedCrop(size, scale=scale, interpolation=_BICUBIC)
    return T.Compose([crop, T.RandomHorizontalFlip(), *_TO_CLIP_INPUT])


def eval_transform_key(size: int, exif_upright: bool = False) -> str:
    return f"test:resize{size}-bicubic-center{size}-openai_norm" + (EXIF_KEY if exif_upright else "")


def train_transform_key(size: int, scale: tuple[float, float], seed: int, view: int, exif_upright: bool = False) -> str:
    key = f"train:rrcrop{size}-scale{scale[0]:g},{scale[1]:g}-bicubic-hflip-openai_norm-seed{seed}-view{view}"
    return key + (EXIF_KEY if exif_upright else "")


def view_key(impath: str, root: str) -> str:
    """``impath`` relative to the dataset root ``root``, with "/" separators: the image's name in
    every random stream (never the absolute path, which depends on where the data lives).

    Raises ``ValueError`` naming both paths when ``impath`` is not under ``root``.
    """
    rel = os.path.relpath(os.path.abspath(impath), os.path.abspath(root))
    if rel == os.curdir or rel.split(os.sep, 1)[0] == os.pardir:
        raise ValueError(f"image {impath} is not under the dataset root {root}")
    return rel.replace(os.sep, "/")


def view_seed(seed: int, key: str, view: int) -> int:
    """A 63-bit torch seed for view ``view`` of the image named ``key`` (:func:`view_key`) under run seed ``seed``."""
    digest = hashlib.blake2b(f"{seed}|{key}|{view}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _capped_rgb8(img: Image.Image) -> Image.Image:
    """:func:`meta.data.image_decode.to_rgb8` of an opened image whose declared size is within the caps."""
    problem = size_problem(img.size)
    if problem:
        raise ValueError(problem)
    return to_rgb8(img)


class ImageLoader:
    """Decodes images (RGB PIL) and applies the test / seeded train transforms for one CLIP input size.

    Decoded train images and transformed test tensors are kept in memory up to
    ``max_cached_bytes`` (few-shot train sets are small; test tensors are re-used every epoch).
    ``exif_upright``: turn each image upright by its EXIF orientation (default: as stored, as Dassl reads it).
    """

    def __init__(
        self,
        size: int,
        rrcrop_scale: tuple[float, float] = (0.08, 1.0),
        max_cached_bytes: int = 2 << 30,
        exif_upright: bool = False,
    ):
        self.size = size
        self.exif_upright = bool(exif_upright)
        self.scale = tuple(rrcrop_scale)
        self.test_tf = eval_transform(size)
        self.train_tf = train_transform(size, self.scale)
        self.max_cached_bytes = max_cached_bytes
        self._cached_bytes = 0
        self._pil: dict[str, Image.Image] = {}
        self._test: dict[str, torch.Tensor] = {}

    def _room(self, nbytes: int) -> bool:
        if self._cached_bytes + nbytes > self.max_cached_bytes:
            return False
        self._cached_bytes += nbytes
        return True

    @staticmethod
    def decode(impath: str, exif_upright: bool = False) -> Image.Image:
        """Read ``impath`` as 8-bit RGB (turned upright by its EXIF orientation when ``exif_upright``);
        a missing, corrupt or over-cap file raises ``OSError`` naming it."""
        try:
            return open_upright(impath, exif_upright, convert=_capped_rgb8)
        except (OSError, ValueError) as err:
            raise OSError(f"cannot read image {impath}: {err}") from None

    def pil(self, impath: str) -> Image.Image:
        """The RGB image at ``impath`` (decoded once while the memory budget lasts)."""
        img = self._pil.get(impath)
        if img is None:
            img = self.decode(impath, self.exif_upright)
            if self._room(img.width * img.height * 3):
                self._pil[impath] = img
        return img

    def test_view(self, impath: str) -> torch.Tensor:
        """``[3, S, S]`` test-transformed image."""
        x = self._test.get(impath)
        if x is None:
            x = self.test_tf(self.decode(impath, self.exif_upright))
            if self._room(x.numel() * x.element_size()):
                self._test[impath] = x
        return x

    def train_view(self, impath: str, seed: int, view: int, key: str) -> torch.Tensor:
        """``[3, S, S]`` augmented view ``view`` of ``impath``, deterministic in ``seed`` and ``key``
        (the image's path relative to its dataset root, :func:`view_key`)."""
        img = self.pil(impath)
        with torch.random.fork_rng(devices=[]):
            # the CPU generator only: torch.manual_seed would also queue lazy CUDA/XPU/MTIA
            # seeding, which formats a stack trace per call (~1.5 ms each, measured)
            torch.default_generator.manual_seed(view_seed(seed, key, view))
            return self.train_tf(img)


def clip_fingerprint(clip: nn.Module) -> str:
    """32 hex digits of BLAKE2b over every CLIP tensor (names, dtypes, shapes, bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(clip.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _file_key(impath: str) -> str:
    try:
        st = os.stat(impath)
    except OSError:
        raise FileNotFoundError(f"image not found: {impath}") from None
    return f"{os.path.abspath(impath)}|{st.st_size}|{st.st_mtime_ns}"


class FeatureCache:
    """Frozen-tower image features ``[E]`` (L2-normalised, fp32, CPU) of ``clip`` keyed by image and transform, in
    memory and, with ``cache_dir``, on disk in a folder named by the weights' fingerprint (pass a known
    ``clip_fingerprint(clip)`` as ``fingerprint`` to skip hashing them), so features of other weights never mix."""

    def __init__(self, clip: nn.Module, cache_dir: Optional[str] = None, batch_size: int = 64, fingerprint: str = ""):
        self.clip = clip
        self.fingerprint = fingerprint or clip_fingerprint(clip)
        self.batch_size = batch_size
        self.dir = Path(cache_dir) / self.fingerprint if cache_dir else None
        self._memory: dict[str, torch.Tensor] = {}
        self._disk_loaded = False
        self.stats = {"computed": 0, "from_memory": 0, "from_disk": 0}
        self._loaded_from_disk: set[str] = set()  # keys read from shards (for stats)

    def _load_disk(self) -> None:
        self._disk_loaded = True
        if self.dir is None or not self.dir.is_dir():
            return
        for shard in sorted(self.dir.glob("shard-*.safetensors")):
            try:
                with safe_open(str(shard), framework="pt") as f:
                    keys = json.loads((f.metadata() or {})["keys"])
                    feats = f.get_tensor("features")
            except Exception as err:  # a torn or foreign file: skip it, recompute what it held
                print(f"Warning: skipping unreadable feature-cache shard {shard} ({err})")
                continue
            if feats.shape[0] != len(keys):
                print(f"Warning: skipping feature-cache shard {shard}: {len(keys)} keys, {feats.shape[0]} rows")
                continue
            for k, row in zip(keys, feats):
                self._memory.setdefault(k, row)
                self._loaded_from_disk.add(k)

    def _write_shard(self, keys: list[str], feats: torch.Tensor) -> None:
        if self.dir is None or not keys:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"shard-{uuid.uuid4().hex[:16]}.safetensors"
        tmp = self.dir / (name + ".tmp")
        save_file({"features": feats.contiguous()}, str(tmp), metadata={"keys": json.dumps(keys)})
        tmp.replace(self.dir / name)

    @torch.no_grad()
    def features(
        self,
        items: Sequence[tuple[str, str]],
        make_input: Callable[[int], torch.Tensor],
        progress: Optional[Callable[[int], None]] = None,
    ) -> torch.Tensor:
        """``[n, E]`` features of ``items`` = ``(impath, transform_key)`` pairs.

        Missing ones are built with ``make_input(index into items) -> [3, S, S]`` and
        encoded in batches; new features are added to memory and, with a cache folder, written
        as one new shard.  ``progress(k)`` is called after each encoded batch of k images.
        """
        if not self._disk_loaded:
            self._load_disk()
        keys = [hashlib.blake2b(f"{_file_key(p)}|{t}".encode(), digest_size=20).hexdigest() for p, t in items]
        seen: dict[str, int] = {}
        for i, k in enumerate(keys):
            if k not in self._memory and k not in seen:
                seen[k] = i
        missing = list(seen.values())
        hits = len(keys) - len(missing)
        disk_hits = sum(1 for k in keys if k in self._loaded_from_disk)
        self.stats["from_disk"] += disk_hits
        self.stats["from_memory"] += hits - disk_hits
        device = next(self.clip.parameters()).device
        new_keys, new_feats = [], []
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start : start + self.batch_size]
            x = torch.stack([make_input(i) for i in chunk]).to(device)
            f = F.normalize(encode_image_with_prompts(self.clip, x, None).float(), dim=-1).cpu()
            for i, row in zip(chunk, f):
                self._memory[keys[i]] = row
                new_keys.append(keys[i])
            new_feats.append(f)
            if progress is not None:
                progress(len(chunk))
        self.stats["computed"] += len(new_keys)
        if new_keys:
            self._write_shard(new_keys, torch.cat(new_feats))
        return torch.stack([self._memory[k] for k in keys])
