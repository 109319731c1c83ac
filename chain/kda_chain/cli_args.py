"""argparse pieces the command-line tools share (kda-witness, bench/ddp_train.py): one-line errors
for bad values, before any work starts."""

from __future__ import annotations

import argparse
import os


def at_least(lo: int):
    """argparse type: an integer >= lo."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {n}")
        return n

    parse.__name__ = f"integer >= {lo}"
    return parse


def check_output_file(p: argparse.ArgumentParser, flag: str, path: str) -> None:
    """`p.error` unless `path`'s directory exists and is writable (checked before the work)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        p.error(f"{flag} {path}: directory {parent} is not writable")
