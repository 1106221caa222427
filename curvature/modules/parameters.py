"""Any module's own parameters, for curvature that needs no layer structure.

:class:`ParameterFamily` covers the direct parameters of a module no layer family knows (an
``nn.GRU``, an ``nn.Bilinear``, ``nn.PReLU``, a custom module computing with its own ``nn.Parameter``,
a container's ``cls_token``) as one diagonal block. Only an estimator that reads nothing but the
parameters' gradients can fill such a block: :class:`torchsso2.VIOptimizer`'s default
``curvature="reparam"`` (``ĥ = g ⊙ ε / σ²`` per coordinate, as IVON, which runs on any model).
The capture-based kinds (Fisher, Monte-Carlo Fisher, empirical Fisher, the Hessian's fast path)
need a layer's inputs and output gradients in a known form: here every such method raises
``NotImplementedError``, and :meth:`curvature.engine.CurvatureEngine.capture` refuses a model with
such blocks before any hook runs.
"""
from __future__ import annotations

from .base import LayerFamily

__all__ = ["ParameterFamily"]


class ParameterFamily(LayerFamily):
    """The direct trainable parameters of any module, diagonal blocks only, from gradients alone
    (no ``normal_input`` / per-example gradients / K-FAC factors: ``NotImplementedError``)."""

    module_types = ()
    supports_kfac = False
    reads_output_values = False
