"""Meta-training of GRAM prompts from a task hierarchy, and the export the trainers load.

The command line (``python -m meta train|export``): :mod:`meta.metatrain.cli`; the modules, one line each:
docs/layout.md, ``meta/metatrain/``.
"""

from meta.config import add_metatrain_cfg

__all__ = ["main", "build_cfg", "add_metatrain_cfg", "train", "export_run"]


# name -> the submodule defining it, imported when the name is first used: the trainer and the export import
# learn2learn (through meta.method.gram), which config-only users of this package do not need
_LAZY = {"main": "cli", "build_cfg": "cli", "train": "trainer", "export_run": "export"}


def __getattr__(name: str):
    """:func:`meta.metatrain.cli.main`, :func:`~meta.metatrain.cli.build_cfg`, :func:`meta.metatrain.trainer.train`
    and :func:`meta.metatrain.export.export_run`, from their submodules."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
