"""kfac_pytorch's ``kfac.warnings``: the warning category of experimental features."""
from __future__ import annotations

__all__ = ["ExperimentalFeatureWarning"]


class ExperimentalFeatureWarning(Warning):
    """Warned when an experimental feature is used."""
