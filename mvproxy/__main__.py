"""``python -m mvproxy``: the same entry point as the ``mvproxy`` console script."""

import sys

from mvproxy.cli import main

sys.exit(main())
