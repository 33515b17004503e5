"""``python -m packcache``: the same as the ``packcache`` command."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
