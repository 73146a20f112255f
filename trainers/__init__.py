"""Dassl trainers of this repository (CoOp style: imported from the repository root).

``import trainers`` registers every trainer of ``meta/method/methods.yaml``'s ``learners:`` (``TRAINER_NAMES``) in
Dassl's ``TRAINER_REGISTRY`` (when Dassl is installed) and re-exports ``extend_cfg``; see ``trainers.gram``.
"""

from .gram import TRAINER_NAMES, build_lr_scheduler, extend_cfg, gram_settings

__all__ = ["extend_cfg", "gram_settings", "build_lr_scheduler", "TRAINER_NAMES"]
