"""``python -m gram_world.demo [--quick] ...`` (see :mod:`gram_world.demo`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
