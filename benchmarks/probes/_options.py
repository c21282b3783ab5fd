"""Options the decode probes (``decode_probe.py``, ``decode_floor.py``) share. Not a probe; imports nothing heavy,
so a probe can build its parser from it before torch loads."""

from __future__ import annotations

import argparse


def decode_parser(doc: str, heads_help: str) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` with the decode shape: ``--tokens`` and ``--heads``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64", help="comma-separated token counts (one per sequence)")
    parser.add_argument("--heads", default="32:8", help=heads_help)
    return parser
