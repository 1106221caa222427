"""The model's output turned into the loss by weights outside the model the optimizer was built on.

``SecondOrderOptimizer(model.backbone)`` with a closure running ``head(backbone(x))``: the curvature
is taken as if the backbone's output were the one the likelihood (``loss=``) is of, which it is not
(the blocks are off by 30–100% on a tiny MLP), and ``VIOptimizer.predict`` would average the
backbone's outputs. Under ``loss="cross_entropy"`` the softmax check of :mod:`.misuse` usually sees
it; under ``"mse"`` and ``"binary_cross_entropy"`` nothing else can. At the first watched closure call
the loss's autograd graph is walked back to the model's output (:func:`foreign_weights`): a parameter
of two or more dimensions that is not the model's, hanging off that path (a layer's weight applied
to the output), is the sign. Parameters of one dimension (a learned temperature, a per-output noise
scale) and frozen weights (no ``AccumulateGrad`` node) are not flagged.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Set

from torch import Tensor

from curvature.stacklevel import caller_stacklevel

#: graph nodes walked at most; a larger graph between the loss and the output is not checked
MAX_NODES = 20000
#: how far off the path a weight may hang (``Linear``: ``addmm`` -> ``TBackward`` -> ``AccumulateGrad``)
MAX_DEPTH = 3


def _children(node: Any) -> List[Any]:
    return [c for c, _ in node.next_functions if c is not None]


def _reaching(start: Any, root: Any) -> Optional[Dict[Any, bool]]:
    """For each node of ``start``'s graph walked, whether ``root`` is among its inputs (``root``'s own
    inputs are not walked); None past :data:`MAX_NODES`."""
    memo: Dict[Any, bool] = {root: True}
    stack = [start]
    pushed = 1
    while stack:
        node = stack[-1]
        if node in memo:
            stack.pop()
            continue
        kids = _children(node)
        pending = [c for c in kids if c not in memo]
        if pending:
            pushed += len(pending)
            if pushed > MAX_NODES:
                return None
            stack.extend(pending)
            continue
        memo[node] = any(memo[c] for c in kids)
        stack.pop()
    return memo


def _weights_below(node: Any, own: Set[int], depth: int, found: Dict[int, Tensor]) -> None:
    variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
    if isinstance(variable, Tensor):
        if variable.dim() >= 2 and id(variable) not in own:
            found[id(variable)] = variable
        return
    if depth > 0:
        for child in _children(node):
            _weights_below(child, own, depth - 1, found)


def foreign_weights(loss: Tensor, output: Tensor, own: Set[int]) -> List[Tensor]:
    """The parameters (2+ dims, ``id`` not in ``own``) that the path from ``output`` to ``loss`` applies:
    each hangs at most :data:`MAX_DEPTH` nodes off a node of that path, on a branch that does not lead
    back to ``output``."""
    root, start = output.grad_fn, loss.grad_fn
    if root is None or start is None or start is root:
        return []
    memo = _reaching(start, root)
    if memo is None:
        return []
    found: Dict[int, Tensor] = {}
    for node, reaches in memo.items():
        if reaches and node is not root:
            for child in _children(node):
                if not memo.get(child, False):
                    _weights_below(child, own, MAX_DEPTH - 1, found)
    return list(found.values())


def warn_if_output_meets_foreign_weights(opt: Any, loss: Any, output: Optional[Tensor], from_backward: bool) -> bool:
    """UserWarning (True when it warned) when the output of ``opt.model`` reaches ``loss`` through weights
    outside it (module docstring). ``from_backward``: the curvature comes from the user's backward alone
    (right whatever the output is): only ``predict`` is spoilt."""
    if not isinstance(loss, Tensor) or not isinstance(output, Tensor):
        return False
    own = {id(p) for p in opt.model.parameters()}
    weights = foreign_weights(loss, output, own)
    if not weights:
        return False
    name = type(opt).__name__
    shapes = ", ".join(str(list(w.shape)) for w in weights[:3]) + (" ..." if len(weights) > 3 else "")
    what = ("its curvature is right (it comes from your backward), but predict() averages this output, not the "
            "whole network's" if from_backward else
            f"the curvature is taken as if this output were the one the likelihood (loss={opt.engine.loss.value!r}) "
            "is of, which it is not")
    warnings.warn(
        f"{name}: the output of the model it was built on ({type(opt.model).__name__}, shape "
        f"{list(output.shape)}) reaches the closure's loss through weights that are not that model's "
        f"(parameters of shape {shapes}): {what}. Build the optimizer on the whole model and pass the parameters "
        f"to train: {name}(model, params=backbone.parameters(), ...). " + (
            "If you do not call predict(), ignore this" if from_backward else
            "If the weights belong to the loss on purpose (a contrastive loss's embeddings, a GAN's "
            "discriminator), the loss is no likelihood of this output: use curvature='empirical_fisher' (the "
            "loss as written, from your backward) or VIOptimizer's default diagonal"),
        UserWarning, stacklevel=caller_stacklevel())
    return True
