"""``python -m expertcache.cli``: the command line."""

import sys

from expertcache.cli import main

sys.exit(main())
