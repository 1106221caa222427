"""The optimizer faces: natural-gradient training and variational inference."""
from .base import CurvatureOptimizer, NonFiniteError
from .second_order import SecondOrderOptimizer
from .vi import VIOptimizer

__all__ = ["CurvatureOptimizer", "NonFiniteError", "SecondOrderOptimizer", "VIOptimizer"]
