"""Where in the user's code a node was recorded (file:line)."""
from __future__ import annotations

import os
import sys

import torch

# directories with their separator: a user's fastlazy_demo.py beside the
# package is not inside it
_SKIP = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
         os.path.dirname(torch.__file__) + os.sep)


def site_of_call() -> str:
    """The first frame outside fastlazy and torch, as 'file:line'."""
    return site_name(*where_called(2))


def where_called(depth: int = 1):
    """(file name, line) of the first frame outside fastlazy and torch
    above the caller `depth` frames up; (None, 0) if there is none.  Cheaper
    than site_of_call (no string is made, and a code object's file name
    keeps its hash): what a counter that is read rarely but bumped at every
    flush keys by."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return None, 0
    return frame.f_code.co_filename, frame.f_lineno


def site_name(file, line) -> str:
    """'file:line' of a where_called() pair."""
    return "<unknown>" if file is None else f"{file}:{line}"
