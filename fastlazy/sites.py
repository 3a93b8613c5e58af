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
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
