"""``python -m cli``: the ``conveyor`` command without its installed script."""

import sys

from cli.main import main

sys.exit(main())
