"""Curvature blocks, one file per shape, one interface (:class:`Block`)."""
from .base import Block
from .diag import DiagBlock
from .full import FullBlock
from .kfac import KFACBlock
from .layout import Layout

__all__ = ["Block", "DiagBlock", "FullBlock", "KFACBlock", "Layout"]
