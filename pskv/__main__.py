"""``python -m pskv ...`` is the ``pskv`` command."""

from .cli import main

raise SystemExit(main())
