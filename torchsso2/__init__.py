"""torchsso2: natural-gradient training, Bayesian deep learning by VI, and KAISA K-FAC.

Faces over one curvature engine (:mod:`curvature`):

* :class:`SecondOrderOptimizer` — natural-gradient ``torch.optim.Optimizer``;
* :class:`VIOptimizer` — natural-gradient variational inference (VOGN, noisy K-FAC, full);
* :class:`torchsso2.kfac.KFACPreconditioner` — drop-in for kfac_pytorch (KAISA).
"""
from . import metrics
from .kfac import KFACPreconditioner
from .optim import NonFiniteError, SecondOrderOptimizer, VIOptimizer

__all__ = ["SecondOrderOptimizer", "VIOptimizer", "KFACPreconditioner", "NonFiniteError", "metrics"]
__version__ = "0.1.0"
