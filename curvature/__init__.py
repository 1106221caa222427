"""curvature: how curved is the loss here? Kinds × shapes × layer families, checked against brute force.

>>> import curvature
>>> c = curvature.compute(model, x, y, loss="cross_entropy", kind="fisher", approx="kfac")
>>> c.dense(), c.blocks["fc1"].A, c.blocks["fc1"].G
>>> c.diagonal(), c @ v, c.solve(v, damping=1e-3), c.to_scipy()   # no dense matrix needed
"""
from .blocks import Block, DiagBlock, FullBlock, KFACBlock, Layout
from .compute import compute
from .engine import CurvatureEngine
from .options import Approx, Kind, KFACApprox, LossType
from .result import Curvature
from .running import RunningCurvature

__all__ = ["compute", "Curvature", "CurvatureEngine", "RunningCurvature", "Block", "FullBlock", "DiagBlock",
           "KFACBlock", "Layout", "Approx", "Kind", "KFACApprox", "LossType"]
__version__ = "0.1.0"
