"""Where in the user's code a node was recorded (file:line)."""
from __future__ import annotations

import os
import sys

import torch

from fastlazy import _core

# directories with their separator: a user's fastlazy_demo.py beside the
# package is not inside it
SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.dirname(torch.__file__) + os.sep)


def site_of_call() -> str:
    """The first frame outside fastlazy and torch, as 'file:line'."""
    return site_name(*where_called(2))


def where_called(depth: int = 1):
    """(code object, instruction offset) of the first frame outside
    fastlazy and torch above the caller `depth` frames up; (None, 0) if
    there is none; site_name makes it 'file:line'.  (The core finds each
    flush's site with the same walk: csrc/flush_sites.pxi, which skips
    SKIP once metrics has handed it over at boot.)"""
    return _core.first_user_site(sys._getframe(depth))


def site_name(code, offset) -> str:
    """'file:line' of a where_called() pair."""
    if code is None:
        return "<unknown>"
    line = next((line for start, end, line in code.co_lines() if start <= offset < end),
                None)
    return f"{code.co_filename}:{code.co_firstlineno if line is None else line}"
