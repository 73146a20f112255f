"""Meta-training of GRAM prompts from a task hierarchy, and the export the trainers load.

Command line (through ``python -m meta``)::

    python -m meta train --config-file configs/meta/train_coop.yaml [--resume] [--output-dir D] [KEY VALUE ...]
    python -m meta export --run-dir D [--out F]

Modules: :mod:`.settings` (``META`` config node, specs), :mod:`.data` (hierarchy -> tensors,
feature check, task streams), :mod:`.trainer` (the loop, validation, resume),
:mod:`.checkpoint` (atomic, ``weights_only``-loadable state), :mod:`.runlog` (JSON lines,
tensorboard, tqdm), :mod:`.export` (``gram_init.safetensors`` + ``coop_ctx_nctx<M>.pth``),
:mod:`.cli` (argument parsing).
"""

from meta.config import add_metatrain_cfg

__all__ = ["main", "build_cfg", "add_metatrain_cfg", "train", "export_run"]


def main(argv=None) -> int:
    """See :func:`meta.metatrain.cli.main`.

    The submodules are imported when called: the trainer and the export import learn2learn (through
    :mod:`meta.method.gram`), which config-only users of this package do not need."""
    from meta.metatrain.cli import main as _main

    return _main(argv)


def build_cfg(config_file: str = "", opts=(), output_dir=None):
    """See :func:`meta.metatrain.cli.build_cfg`."""
    from meta.metatrain.cli import build_cfg as _build

    return _build(config_file, opts, output_dir)


def train(cfg, resume: bool = False, hierarchy=None, on_step=None, echo=print) -> dict:
    """See :func:`meta.metatrain.trainer.train`."""
    from meta.metatrain.trainer import train as _train

    return _train(cfg, resume=resume, hierarchy=hierarchy, on_step=on_step, echo=echo)


def export_run(run_dir, out=None) -> dict:
    """See :func:`meta.metatrain.export.export_run`."""
    from meta.metatrain.export import export_run as _export

    return _export(run_dir, out)
