"""``python -m pmetal.node``: run a node daemon (see :mod:`pmetal.node.daemon`)."""

import sys

from pmetal.node.daemon import main

sys.exit(main())
