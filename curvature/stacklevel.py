"""The ``stacklevel`` that attributes a library warning to the user's line (no other imports of the package)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

#: the library's package directories (``curvature`` and ``torchsso2`` sit side by side): frames in
#: them are not the user's (:func:`caller_stacklevel`)
_LIBRARY_DIRS = tuple(str(Path(__file__).resolve().parents[1] / d) + os.sep for d in ("curvature", "torchsso2"))
#: ... and torch's: its frames between the user and the library (``torch.optim.Optimizer.__init__``
#: calling ``add_param_group``, the ``torch.compiler.disable`` wrapper of ``step``) are not the user's either
_NOT_USER_DIRS = _LIBRARY_DIRS + (str(Path(torch.__file__).resolve().parent) + os.sep,)


def caller_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in this module's caller) of the first frame outside
    this library and torch: the user's line that built the optimizer, called ``step`` or
    ``curvature.compute``."""
    frame, level = sys._getframe(2), 2  # the frame of the function that calls warnings.warn
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(_NOT_USER_DIRS):
        frame, level = frame.f_back, level + 1
    return level
