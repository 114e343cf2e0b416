"""``python -m weightsync``: the command line. Guarded, so importing this module by name runs nothing (it used to
``sys.exit`` at import: a worker asked to import it would have exited)."""

import sys

from weightsync.cli import main

if __name__ == "__main__":
    sys.exit(main())
