"""GRAM for Dassl/CoOp forks: one package to copy or import.

``import trainers.gram`` (or wherever the package sits) registers the Dassl trainers, one per learner of the method
table ``meta/method/methods.yaml`` (``GRAM_CoOp``, ``GRAM_VPT``, ``UNIGRAM``, ``GRAM_IVLP``, ``GRAM_MaPLe``), when
Dassl is importable; ``extend_cfg(cfg)`` adds their config keys.
The config, schedule, checkpoint and export helpers need no Dassl.  Recipe: ``docs/dassl_plugin.md``.
"""

from importlib.util import find_spec

from .config import TRAINER_PROMPTS, GramSettings, extend_cfg, gram_settings
from .dassl_schedule import build_lr_scheduler

TRAINER_NAMES = tuple(TRAINER_PROMPTS)

__all__ = ["extend_cfg", "gram_settings", "GramSettings", "build_lr_scheduler", "TRAINER_NAMES"]

if find_spec("dassl") is not None:  # a broken Dassl install raises here, on purpose
    from .dassl_trainers import GRAM_TRAINERS, register_trainers  # importing registers them

    # one attribute per learner of the method table (``from trainers.gram import GRAM_CoOp``)
    globals().update({cls.__name__: cls for cls in GRAM_TRAINERS})
    __all__ += [cls.__name__ for cls in GRAM_TRAINERS] + ["register_trainers"]
else:

    def __getattr__(name: str):
        if name in TRAINER_NAMES or name == "register_trainers":
            raise ImportError(
                f"trainers.gram.{name} needs Dassl: install Dassl.pytorch "
                "(docs/dassl_plugin.md), then import this package again"
            )
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
