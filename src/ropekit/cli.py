"""The ``ropekit`` command: ``check``, ``env``, ``bench`` and ``plot``.

``bench`` and ``plot`` own their arguments (``ropekit bench --help``); this module only routes to them so that
importing the CLI stays cheap.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, help). Each module exposes ``main(argv: list[str]) -> int``.
_SUBCOMMANDS = {
    "check": ("ropekit.check", "run every capability against the float64 reference on the best device"),
    "env": ("ropekit.check", "print versions and devices"),
    "bench": ("ropekit.bench", "time ropekit against a copy of the same bytes and against peers"),
    "plot": ("ropekit.plot", "draw frequency spectra and the relative-position property to a PNG"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="ropekit", description="Rotary position embeddings for PyTorch.")
    parser.add_argument("command", choices=sorted(_SUBCOMMANDS), help="; ".join(
        f"{name}: {help_}" for name, (_, help_) in sorted(_SUBCOMMANDS.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand (see COMMAND --help)")
    ns = parser.parse_args(argv[:1] if argv else argv)
    module = importlib.import_module(_SUBCOMMANDS[ns.command][0])
    entry = module.env_main if ns.command == "env" else module.main
    return int(entry(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
