"""``python -m qkmonitor.cli``: the ``qkmonitor`` command."""

import sys

from qkmonitor.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
