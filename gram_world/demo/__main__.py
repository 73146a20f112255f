"""``python -m gram_world.demo [--quick] ...`` (see :mod:`gram_world.demo`)."""

import sys

from .cli import main

if __name__ == "__main__":
    from meta.infra.numerics import pin_process

    pin_process()  # torch started with the package: this starts the command again, pinned (meta.infra.numerics)
    sys.exit(main())
