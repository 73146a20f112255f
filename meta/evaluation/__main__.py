"""``python -m meta.evaluation {base2new,transfer} ...`` (:mod:`meta.evaluation.cli`)."""

import sys

from meta.evaluation.cli import main

if __name__ == "__main__":
    sys.exit(main())
