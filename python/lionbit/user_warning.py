"""Warnings attributed to the user's line.

A warning raised inside ``opt.step()`` passes through lionbit's frames and
torch's (the optimizer's ``no_grad`` and profiling wrappers): a fixed
``stacklevel`` lands on one of them, ``torch/utils/_contextlib.py`` say, and a
user cannot tell which of their lines it is about. :func:`warn` walks past
every lionbit and torch frame to the first frame of the caller's code.
"""

import os
import sys
import warnings

import torch

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules[__package__]))


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` from the first frame outside lionbit and torch."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
