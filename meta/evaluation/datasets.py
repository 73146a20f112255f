"""Which CoOp-layout dataset to read: a data root plus a :class:`meta.data.coop_data.CoopLayout`.

The benchmarks keep their CoOp names (``DatasetRef.named(root, "dtd")``); any other folder in
DTD's layout - ``<dataset_dir>/images/<class>/*`` plus one ``split_zhou_<Name>.json``, which is
how ``gram_world`` writes its downstream datasets - is read with ``DatasetRef.from_dir``.
All reading, few-shot sampling and base/new subsampling is ``meta.data.coop_data``'s.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Callable

from meta.data.coop_data import CoopLayout, CoopSplits, get_layout, load_coop_splits


@dataclass(frozen=True)
class DatasetRef:
    """``root`` (CoOp's ``DATASET.ROOT``) and the ``layout`` of one dataset under it."""

    root: str
    layout: CoopLayout

    @property
    def name(self) -> str:
        return self.layout.name

    @classmethod
    def named(cls, root: str, name: str) -> "DatasetRef":
        """A registered CoOp dataset by Dassl name or config key (``"DescribableTextures"``, ``"dtd"``)."""
        return cls(os.path.abspath(os.path.expanduser(root)), get_layout(name))

    @classmethod
    def from_dir(
        cls, dataset_dir: str, split_file: str = "", image_dir: str = "images", name: str = ""
    ) -> "DatasetRef":
        """A folder in DTD's layout.

        ``split_file`` defaults to the single ``split_zhou_*.json`` in the folder; ``name``
        defaults to the part of that file name after ``split_zhou_``.
        """
        dataset_dir = os.path.abspath(os.path.expanduser(str(dataset_dir)))
        if not os.path.isdir(dataset_dir):
            raise FileNotFoundError(f"dataset folder not found: expected the folder {dataset_dir}")
        if not split_file:
            found = sorted(glob.glob(os.path.join(dataset_dir, "split_zhou_*.json")))
            if len(found) != 1:
                raise FileNotFoundError(
                    f"{dataset_dir}: expected exactly one split_zhou_<Name>.json, found {len(found)}"
                    f"{' (' + ', '.join(os.path.basename(f) for f in found) + ')' if found else ''}"
                )
            split_file = found[0]
        split_file = os.path.basename(str(split_file))
        if not name:
            stem = os.path.splitext(split_file)[0]
            name = stem[len("split_zhou_") :] if stem.startswith("split_zhou_") else stem
        layout = CoopLayout(
            name=name,
            dataset_dir=os.path.basename(dataset_dir),
            image_dir=image_dir,
            reader="split",
            split_file=split_file,
        )
        return cls(os.path.dirname(dataset_dir), layout)

    @classmethod
    def parse(cls, spec: str, root: str = "") -> "DatasetRef":
        """A CLI argument: an existing folder (``from_dir``) or, with ``root``, a registered name."""
        if os.path.isdir(os.path.expanduser(spec)):
            return cls.from_dir(spec)
        if not root:
            raise ValueError(f"--dataset {spec!r} is not a folder; give --root to use a registered CoOp name")
        return cls.named(root, spec)

    def load(
        self,
        num_shots: int,
        seed: int,
        subsample: str = "all",
        use_cache: bool = True,
        log: Callable[[str], None] = print,
    ) -> CoopSplits:
        """``meta.data.coop_data.load_coop_splits`` for this dataset."""
        return load_coop_splits(
            self.root, self.layout, num_shots=num_shots, seed=seed, subsample=subsample, use_cache=use_cache, log=log
        )

    def as_dict(self) -> dict:
        layout = {k: getattr(self.layout, k) for k in ("dataset_dir", "image_dir", "split_file", "reader")}
        return {"name": self.name, "root": self.root, **layout}
