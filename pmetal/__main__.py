"""``python -m pmetal``: the same command line as the ``pmetal`` script."""

import sys

from pmetal.cli import main

if __name__ == "__main__":
    sys.exit(main())
