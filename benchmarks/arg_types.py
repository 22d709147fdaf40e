"""Argument types the benchmark scripts share: a number within bounds, so a
hostile value is an argparse error naming the range, never a run that
misbehaves."""

from __future__ import annotations

import argparse


def bounded(low: float, high: float, kind=int):
    """An argparse type: `kind(text)` within [low, high]."""
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}")
        return value
    return parse
