"""The model's output transformed by weights on its way to the loss (a head outside the model).

``SecondOrderOptimizer(model.backbone)`` with a closure running ``head(backbone(x))``: the curvature
is taken as if the backbone's output were the one the likelihood (``loss=``) is of, which it is not
(the blocks are off by 30–100% on a tiny MLP), and ``VIOptimizer.predict`` would average the
backbone's outputs. Under ``loss="cross_entropy"`` the softmax check of :mod:`.misuse` usually sees
it; under ``"mse"`` and ``"binary_cross_entropy"`` nothing else can. At the first watched closure call
the loss's autograd graph is walked back to the model's output (:func:`weights_after`): an
``nn.Parameter`` of two or more dimensions that multiplies the output on that path (a matmul or a
convolution, :data:`MATMULS`; an elementwise product by a weight with two dimensions of more than one
entry, :data:`PRODUCTS`; reached through views, casts and the weight's own reparametrisation) is the
sign, whoever owns it (a tied head ``F.linear(h, model.wte.weight)`` applied outside the model's
forward too). Not flagged: what is added to or subtracted from the path (a regulariser on other
weights, a distillation target ``out - teacher(x)``, a PINN's ``u - f(x)``), scales (a learned
temperature, a per-output noise scale, ``W.norm(dim=1)``), operands computed from inputs or other
layers (a gate ``out * gate(x)``, attention keys), inputs that require grad, losses that take derivatives of
the output (a gradient penalty, a PINN's ``du/dx``), and frozen weights (no ``AccumulateGrad`` node: a
frozen head goes unseen).
"""
from __future__ import annotations

import warnings
from typing import AbstractSet, Any, Dict, List, Optional

from torch import Tensor, nn

from curvature.stacklevel import caller_stacklevel

#: graph nodes walked at most; a larger graph between the loss and the output is not checked
MAX_NODES = 20000
#: the nodes through which a weight operand transforms the path (their other operands are examined)
MATMULS = frozenset({"AddmmBackward0", "MmBackward0", "BmmBackward0", "BaddbmmBackward0", "MvBackward0",
                     "DotBackward0", "LinearBackward0", "ConvolutionBackward0", "TrilinearBackward0"})
#: elementwise products: a weight operand counts where it is a parameter itself (through :data:`VIEWS`) with two
#: dimensions of more than one entry (a [1, 1] temperature, a [1, C] per-class scale or a scale derived from a
#: weight, ``W.norm(dim=1)``, is a scale, not a layer)
PRODUCTS = frozenset({"MulBackward0", "DivBackward0"})
#: views and casts between an operand and its parameter (``Linear``: ``addmm`` -> ``TBackward0`` -> the weight;
#: under autocast a ``ToCopyBackward0``; an einsum's permutes and reshapes)
VIEWS = frozenset({"TBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "PermuteBackward0",
                   "TransposeBackward0", "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                   "SqueezeBackward1", "ToCopyBackward0", "CloneBackward0"})
#: what a matmul's weight operand may be made of besides: a weight's own reparametrisation (cosine ``W / ‖W‖``,
#: scaled ``W·α``, low-rank-adapted ``W + A B``: the ``W`` branch, weight norm), not another layer's output
REPARAMETRISATIONS = VIEWS | frozenset({"MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0",
                                        "NormBackward1", "LinalgVectorNormBackward0", "ClampMinBackward0",
                                        "WeightNormInterfaceBackward0", "SumBackward1", "PowBackward0",
                                        "SqrtBackward0"})
#: nodes followed at most from an operand to its parameter
MAX_DEPTH = 8
#: the way out where the loss is no likelihood of the model's output (a rollout, a contrastive loss)
FROM_YOUR_BACKWARD = ("use curvature='empirical_fisher' without targets= and without an adaptive learning rate or "
                      "momentum (the loss as written, from your backward) or VIOptimizer's default diagonal")


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


def _weight_of(node: Any, through: AbstractSet[str], depth: int = MAX_DEPTH) -> Optional[Tensor]:
    """The ``nn.Parameter`` (2+ dims) an operand node is made of: an ``AccumulateGrad`` node reached through at
    most ``depth`` nodes of ``through`` (the first found, depth first)."""
    variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
    if variable is not None:
        return variable if isinstance(variable, nn.Parameter) and variable.dim() >= 2 else None
    if depth == 0 or type(node).__name__ not in through:
        return None
    for child in _children(node):
        found = _weight_of(child, through, depth - 1)
        if found is not None:
            return found
    return None


def _layer_like(weight: Tensor) -> bool:
    return sum(d > 1 for d in weight.shape) >= 2


def weights_after(loss: Tensor, output: Tensor) -> List[Tensor]:
    """The parameters (2+ dims) that transform ``output`` on its way to ``loss`` (module docstring); none
    where the loss takes derivatives of the output (a gradient penalty, a PINN's ``du/dx``: its double-backward
    nodes multiply by the model's own weights, and the loss is no likelihood of the output alone)."""
    root, start = output.grad_fn, loss.grad_fn
    if root is None or start is None or start is root:
        return []
    memo = _reaching(start, root)
    if memo is None:
        return []
    on_path = [node for node, reaches in memo.items() if reaches and node is not root]
    if any("BackwardBackward" in type(node).__name__ for node in on_path):
        return []
    found: Dict[int, Tensor] = {}
    for node in on_path:
        name = type(node).__name__
        if name not in MATMULS and name not in PRODUCTS:
            continue
        for child in _children(node):
            if not memo.get(child, False):
                weight = _weight_of(child, REPARAMETRISATIONS) if name in MATMULS else _weight_of(child, VIEWS)
                if weight is not None and (name in MATMULS or _layer_like(weight)):
                    found[id(weight)] = weight
    return list(found.values())


def warn_if_output_meets_foreign_weights(opt: Any, loss: Any, output: Optional[Tensor], from_backward: bool) -> bool:
    """UserWarning (True when it warned) when weights transform the output of ``opt.model`` on its way to
    ``loss`` (module docstring). ``from_backward``: the curvature comes from the user's backward alone
    (right whatever the output is): only ``predict`` is spoilt."""
    if not isinstance(loss, Tensor) or not isinstance(output, Tensor):
        return False
    weights = weights_after(loss, output)
    if not weights:
        return False
    name = type(opt).__name__
    shapes = ", ".join(str(list(w.shape)) for w in weights[:3]) + (" ..." if len(weights) > 3 else "")
    own = {id(p) for p in opt.model.parameters()}
    fed_back = all(id(w) in own for w in weights)  # the model run again on its own output: a rollout
    what = ("its curvature is right (it comes from your backward), but predict() averages this output, not the "
            "whole network's" if from_backward else
            f"the curvature is taken as if this output were the one the likelihood (loss={opt.engine.loss.value!r}) "
            "is of, which it is not")
    if fed_back:
        how = f"the model's own weights (parameters of shape {shapes})"
        fix = ("The model is run on its own output (an unrolled or rollout closure, a tied head applied outside its "
               "forward). Make what the loss takes the output of one forward of the model (a tied head a module of "
               "it), or, for a rollout, " + ("ignore this if you do not call predict()" if from_backward
                                             else FROM_YOUR_BACKWARD))
    else:
        how = f"weights applied after it (parameters of shape {shapes})"
        fix = (f"Build the optimizer on the model whose forward computes what the loss takes (the head a module of "
               f"it), and pass the parameters to train: {name}(model, params=backbone.parameters(), ...). " + (
                   "If you do not call predict(), ignore this" if from_backward else
                   "If the weights belong to the loss on purpose (a contrastive loss's embeddings, a GAN's "
                   "discriminator), the loss is no likelihood of this output: " + FROM_YOUR_BACKWARD))
    warnings.warn(f"{name}: the output of the model it was built on ({type(opt.model).__name__}, shape "
                  f"{list(output.shape)}) reaches the closure's loss through {how}: {what}. {fix}",
                  UserWarning, stacklevel=caller_stacklevel())
    return True
