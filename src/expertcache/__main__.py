"""``python -m expertcache``: the command line."""

import sys

from expertcache.cli import main

sys.exit(main())
