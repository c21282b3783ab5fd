"""``python -m ropekit.bench``: the same as ``ropekit bench``."""

from .cli import main

raise SystemExit(main())
