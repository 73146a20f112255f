"""Cross-modal Hierarchical Clustering (CHC, paper section 3.2): image-text pairs -> topics -> domains.

Run it with ``python -m meta cluster --config-file configs/meta/chc_cc3m.yaml`` (see
:mod:`meta.chc.pipeline` for the stages and :mod:`meta.config` for every setting).

Output contract (what the meta-trainer relies on)
-------------------------------------------------
``meta.chc.load_hierarchy(out_dir) -> Hierarchy`` with

* ``topic_names: list[str]`` [L] - one distinct class name per topic (clusters sharing a top word merged);
* ``item_topic: np.ndarray[int64]`` [N] - topic id of each pair, ``-1`` = excluded (the reason in
  ``item_status.npy``, codes in ``meta['status_codes']``);
* ``item_domain: np.ndarray[int64]`` [N] - visual domain id inside the item's topic (``0 .. U_t - 1``, 0 = largest),
  ``-1`` where ``item_topic`` is ``-1``;
* ``image_features: np.ndarray[float32]`` [N, D] - L2-normalised features of the frozen CLIP of ``meta['backbone']``
  (memory-mapped; zero rows for unreadable images);
* ``meta: dict`` - ``backbone``, ``pretrained``, ``weights_sha256``, ``image_size``, ``mean``/``std``, ``settings``,
  ``counts``;
* ``images(indices) -> np.ndarray[uint8]`` [n, H, W, 3] at the CLIP input size, decoded lazily or read from the
  ``image_features/images_u8.npy`` cache (normalise with :func:`meta.chc.imaging.normalize_uint8`);
* helpers ``domain_members(t) -> {u: item indices}``, ``topic_members(t)``, ``topic_sizes()``.

N counts every indexed pair (image present, caption non-empty); pairs skipped while reading are only counted.
"""

from meta.chc.hierarchy import STATUS, Hierarchy, load_hierarchy
from meta.chc.pipeline import run_chc

__all__ = ["Hierarchy", "load_hierarchy", "run_chc", "STATUS"]
