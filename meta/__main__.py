"""``python -m meta <command> --config-file F [KEY VALUE ...]``.

Commands:
  cluster   Cross-modal Hierarchical Clustering of image-text pairs (``meta.chc``).
  train     meta-training (``meta.metatrain.cli``).
  export    export the meta-learned initialisation (``meta.metatrain.cli``).

Each command imports only its own modules (``meta.chc.cli``, ``meta.metatrain.cli``).  Bad input ends
every command with one ``error: <file or KEY>: ...`` line and exit status 2 (``meta.infra.cli_errors``);
``--debug`` or ``GRAM_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = ("cluster", "train", "export")
USAGE = "usage: python -m meta {cluster,train,export} --config-file FILE [KEY VALUE ...]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from meta.infra.numerics import NumericsError, pin_process

    try:
        pin_process()  # before any command imports torch (meta.infra.numerics)
    except NumericsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = ["--debug"] if "--debug" in argv else []  # accepted anywhere; handed to the command after its name
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__.split("Commands:")[1].rstrip())
        return 0 if argv else 2
    command = argv[0]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if command == "cluster":
        from meta.chc.cli import main as cluster_main  # lazy: each command imports only what it runs

        return cluster_main(argv[1:] + debug)
    from meta.fingerprint.record import computed_by  # run.json records the numerics fingerprint (wired here)
    from meta.metatrain.cli import main as metatrain_main

    return int(metatrain_main(argv + debug, recorder=computed_by) or 0)


if __name__ == "__main__":
    sys.exit(main())
