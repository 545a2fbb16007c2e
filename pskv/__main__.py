"""``python -m pskv ...`` is the ``pskv`` command."""

import sys

from .cli import main

sys.exit(main())
