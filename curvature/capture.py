"""Capture: forward hooks that record what the curvature needs while the model runs.

For every covered module the hook records its inputs (detached) and its output tensor
(kept in the graph, so gradients w.r.t. it can be taken). The module's output is replaced
by a clone so that an in-place op right after the layer (``nn.ReLU(inplace=True)``) cannot
overwrite the recorded tensor (except for the ``shape_only`` modules of a ``record_backward``
capture, whose output values nothing reads). Optionally, tensor hooks also record the gradient w.r.t.
the output during the user's own ``backward()`` (empirical-Fisher / kfac_pytorch style).

Models are ordinary ``nn.Module``s: functional activations, residual additions, pooling,
flatten and so on need nothing special.

With ``freeze_batch_stats`` every BatchNorm under ``root`` that normalizes with batch statistics
gets a routing node after its output (:mod:`curvature.frozen_norm`): backward passes run inside
``capture.frozen.on()`` see the Jacobian with the batch statistics frozen; every other backward
(the user's) is unchanged.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from .eager import eager

from .frozen_norm import FrozenMode, route_output, uses_batch_statistics
from .hook_marks import LocalHook, capture_hook, in_func_transform, is_marked, is_owned
from .modules.attention import attention_hook, passthrough_hook, recomputes_out_proj
from .stacklevel import caller_stacklevel
from .uses import UseWindows
from .root_calls import NestedCalls
from .uses_static import global_forward_hooks, uses_stay_inside


@dataclass
class ModuleRecord:
    """What one forward recorded for one module."""

    inputs: Tuple[Tensor, ...]
    output: Tensor
    backward_grads: List[Tensor] = field(default_factory=list)
    #: the autograd nodes of the (undetached) inputs: whether the inputs depend on the module's own
    #: parameters (a tied or functional use upstream) is a walk from them (the Hessian's fast path)
    input_nodes: Tuple[Any, ...] = ()
    #: the tensors the call ran with as the module's parameters (torch.func.functional_call swaps in
    #: others: the Hessian's fast diagonal path then does not apply)
    parameters: Tuple[Any, ...] = ()
    #: the module's own parameters when the capture began (before the closure could swap others in)
    own_parameters: Tuple[Any, ...] = ()


class Capture:
    """Context manager recording ``ModuleRecord``s for ``modules`` during one forward.

    Args:
        modules: module name -> module to record.
        root: the model; when ``on_output`` is given it is called with the model's output
            right after the model's forward returns (before any user ``backward``).
        on_output: callback ``f(output)``.
        record_backward: also record ``∂loss/∂output`` of each module during the user's backward.
        on_reuse: a module called more than once in one forward: ``"raise"`` (ValueError: the
            curvature of shared layers is not supported) or ``"count"`` (keep the first record and
            count the calls in :attr:`calls`, for users that only need to detect it).
        select: optional ``f(name, module, inputs) -> bool``; a call it rejects is counted in
            :attr:`calls` but not recorded (no clone of the output, no gradient hook).
        freeze_batch_stats: route the outputs of BatchNorms that use batch statistics (needs
            ``root``); backward passes inside ``frozen.on()`` treat those statistics as constants.
        batch_norms: the BatchNorm modules under ``root`` (found there when not given; the engine
            passes the list it made once).
        check_uses: with ``root``: after each forward, ``ValueError`` when the output depends on a
            parameter of ``modules`` through a use outside their calls (a functional
            ``F.linear(h, emb.weight)``), whose contribution no record would see
            (:mod:`curvature.uses`); not run where such a use cannot occur (a plain ``nn.Sequential``
            of torch layers, :mod:`curvature.uses_static`).
        shape_only: with ``record_backward``, names of modules whose recorded output nothing reads
            but its shape (and the gradient hook): their output is returned as is, without the
            clone. An in-place op after such a layer (``nn.ReLU(inplace=True)``) then changes the
            recorded tensor's values, but the gradient hook, registered before it, still receives
            the gradient with respect to the value before the in-place op (PyTorch's rule for
            tensor hooks). Ignored without ``record_backward`` (a capture whose owner runs its
            own backward passes through the recorded outputs needs them unchanged).
    """

    def __init__(self, modules: Dict[str, nn.Module], root: Optional[nn.Module] = None,
                 on_output: Optional[Callable[[Tensor], None]] = None,
                 record_backward: bool = False, on_reuse: str = "raise",
                 select: Optional[Callable[[str, nn.Module, Tuple[object, ...]], bool]] = None,
                 freeze_batch_stats: bool = False,
                 select_output: Optional[Callable[[Any], Tensor]] = None,
                 batch_norms: Optional[Sequence[nn.Module]] = None, check_uses: bool = False,
                 shape_only: Collection[str] = ()) -> None:
        if on_reuse not in ("raise", "count"):
            raise ValueError(f"on_reuse={on_reuse!r}; expected 'raise' or 'count'")
        self.modules = modules
        self.root = root
        self.on_output = on_output
        self.record_backward = record_backward
        self.on_reuse = on_reuse
        self.select = select
        self.records: Dict[str, ModuleRecord] = {}
        #: forward calls per module while recording (grad mode on)
        self.calls: Dict[str, int] = {}
        #: modules called with gradients disabled while recording (not recorded)
        self.called_without_grad: set = set()
        #: covered modules called on no rows (a mixture-of-experts expert nothing was routed to): not recorded
        self.called_on_no_rows: set = set()
        self.outputs: List[Tensor] = []
        #: the model's outputs as it returned them (before ``select_output``), one per recorded forward
        self.raw_outputs: List[Any] = []
        self._handles: List[RemovableHandle] = []
        self.freeze_batch_stats = freeze_batch_stats
        self.batch_norms = batch_norms
        self.select_output = select_output
        #: with ``record_backward``: modules whose recorded output is read for its shape only (no clone)
        self.shape_only = frozenset(shape_only) if record_backward else frozenset()
        #: the routing mode of this capture's BatchNorm nodes (see :mod:`curvature.frozen_norm`)
        self.frozen = FrozenMode()
        # left out where it provably passes (a plain nn.Sequential of torch layers: curvature/uses_static.py)
        self._uses: Optional[UseWindows] = UseWindows(modules, root) if check_uses and root is not None \
            and not uses_stay_inside(root, modules) else None
        self._own: Dict[str, Tuple[Any, ...]] = {}

    def __enter__(self) -> "Capture":
        # each module's parameters before the forward: a torch.func.functional_call in the closure swaps others
        # in for the call, and an estimate during the forward (the root hook) would see those as the module's
        self._own = {name: tuple(module._parameters.values()) for name, module in self.modules.items()}
        if self.modules and global_forward_hooks():
            warnings.warn(
                "a global forward hook (torch.nn.modules.module.register_module_forward_hook) is registered: torch "
                "runs it before every module's own hooks, so the curvature records a covered layer's output after "
                "it; one that changes outputs (o -> 2·o) makes the curvature miss that change (and an "
                "nn.MultiheadAttention's recorded forward drops it from the output). Register such a hook on the "
                "modules (module.register_forward_hook), whose changes the curvature includes",
                UserWarning, stacklevel=caller_stacklevel())
        if self._uses is not None:  # closing first, then the recording hooks prepended before it: a call's window
            # covers what they compute and ends before the user's forward hooks run
            self._handles.extend(self._uses.attach())
        # prepended: they see the layer's own output, before any forward hook of the user's changes it
        # (o -> 2·o); the gradient reaching the recorded output then carries the user's hook too
        for name, module in self.modules.items():
            if isinstance(module, nn.MultiheadAttention):  # recomputed to expose its projections
                self._handles.append(module.register_forward_hook(LocalHook(attention_hook(self, name)), with_kwargs=True,
                                                                  prepend=True))
                continue
            self._handles.append(module.register_forward_hook(LocalHook(self._make_hook(name)), with_kwargs=True,
                                                              prepend=True))
        for name, module in self._attentions_calling_out_proj():
            self._handles.append(module.register_forward_hook(LocalHook(passthrough_hook(self, name)), with_kwargs=True,
                                                              prepend=True))
        if self.freeze_batch_stats and self.root is not None:
            # prepended after the recording hooks, so they run before them: a covered BatchNorm records the
            # routed output
            norms = self.batch_norms if self.batch_norms is not None else batch_norm_modules(self.root)
            for module in norms:
                self._handles.append(module.register_forward_hook(LocalHook(self._route_hook), prepend=True))
        if self.root is not None and (self.on_output is not None or self._uses is not None):
            # a call of the root inside another (a wrapper's redirect, curvature/root_calls.py): the outer
            # call's output is not the model's
            self._handles.extend(NestedCalls().register(self.root, self._root_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        # the callback is usually a closure over this capture (capture -> callback -> capture): drop
        # it so the capture, its records and the batch's activations are freed by reference counting
        # at the end of the step, not later by the cyclic garbage collector
        self.on_output = None

    def _attentions_calling_out_proj(self) -> List[Tuple[str, nn.Module]]:
        """The ``nn.MultiheadAttention`` modules not covered whose ``out_proj`` is (a frozen in-projection):
        their forward never calls ``out_proj``, so it is recomputed to (:func:`passthrough_hook`)."""
        if self.root is None or not any(name == "out_proj" or name.endswith(".out_proj") for name in self.modules):
            return []  # (the walk below runs only for a model with a covered out_proj)
        covered = {id(m) for m in self.modules.values()}
        return [(name, m) for name, m in self.root.named_modules()
                if recomputes_out_proj(m) and id(m) not in covered and id(m.out_proj) in covered]

    @staticmethod
    def foreign_hooks(module: nn.Module) -> bool:
        """Whether ``module`` has forward or backward hooks of the user's: other than a capture's (this one's, or
        another capture's active at the same time, e.g. the low-rank solver's recorder) and a
        ``KFACPreconditioner``'s (marked; :func:`curvature.hook_marks.hidden_from` hides a call from it)."""
        return any(not is_capture_hook(fn) and not is_owned(fn)
                   for hooks in (module._forward_hooks, module._forward_pre_hooks,
                                 module._backward_hooks, module._backward_pre_hooks)
                   for fn in hooks.values())

    def recomputing(self, name: str) -> bool:
        """Whether this call of ``name`` is its forward recomputed during the backward pass
        (non-reentrant activation checkpointing), not a call of the model's forward: the module was
        called already and autograd is running a backward node now."""
        return name in self.calls and torch._C._current_autograd_node() is not None

    def _make_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, inputs: Tuple[Tensor, ...], kwargs: Dict[str, Any],
                 output: Tensor) -> Optional[Tensor]:
            if in_func_transform():
                return None
            if not inputs and kwargs:  # called with its input as a keyword: lin(input=x)
                inputs = tuple(kwargs.values())
            if not torch.is_grad_enabled():  # not recorded (reentrant activation checkpointing runs so)
                self.called_without_grad.add(name)
                return None
            if self.recomputing(name):  # the record of the original call stands
                return None
            if isinstance(output, Tensor) and output.numel() == 0 and self.on_reuse != "count":
                self.called_on_no_rows.add(name)  # no rows: nothing to record (engine: an error; the Hessian sees it)
                return None
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.select is not None and not self.select(name, module, inputs):
                return None
            if name in self.records:
                if self.on_reuse == "count":
                    return None
                raise ValueError(reused_module(name, module))
            if not isinstance(output, Tensor):
                raise TypeError(f"module {name!r} returned {type(output).__name__}, expected a Tensor")
            rec = ModuleRecord(inputs=tuple(i.detach() if isinstance(i, Tensor) else i for i in inputs),
                               output=output,
                               input_nodes=tuple(i.grad_fn for i in inputs
                                                 if isinstance(i, Tensor) and i.grad_fn is not None),
                               parameters=tuple(module._parameters.values()),
                               own_parameters=self._own.get(name, ()))
            self.records[name] = rec
            if self.record_backward and output.requires_grad:
                on_gradient(output, grad_appender(rec.backward_grads))
            # a view output (Linear on [N, T, d]) is cloned too: an in-place op after the layer (ReLU(inplace=True),
            # h += x) would rebase the view's autograd node, and the hook on it would never run
            return output.clone() if output.requires_grad and (name not in self.shape_only or output._is_view()) \
                else None
        return capture_hook(hook)

    def _route_hook(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Optional[Tensor]:
        if not torch.is_grad_enabled() or in_func_transform() or not isinstance(output, Tensor) or not output.requires_grad \
                or not uses_batch_statistics(module):
            return None
        return route_output(module, inputs[0], output, self.frozen)

    @eager  # torch.compiler.disable, lazily (curvature/eager.py): traced, the estimate it starts (the Hessian's) broke dynamo
    def _root_hook(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> None:
        if not torch.is_grad_enabled() or in_func_transform():
            return
        raw = output
        if self.select_output is not None:
            output = self.select_output(output)
        if self._uses is not None:
            self._uses.check(output)
        if self.on_output is None:  # registered for the check alone
            return
        self.outputs.append(output)
        self.raw_outputs.append(raw)
        self.on_output(output)


def reused_module(name: str, module: nn.Module) -> str:
    """The error for a covered module called more than once in one recorded forward."""
    return (f"module {name!r} ({type(module).__name__}) was called more than once in one forward (a shared layer, "
            "an unrolled recurrent cell): Fisher-type curvature of a module reused within a forward is not "
            f"supported. Leave it to the plain update with skip_modules=[{'^' + name + '$'!r}], or use "
            "kind='hessian', which sees every call")


def is_capture_hook(fn: Any) -> bool:
    """Whether ``fn`` is a capture's hook: a marked function or a bound method of a :class:`Capture`."""
    return is_marked(fn) or isinstance(getattr(fn, "__self__", None), Capture)


def on_gradient(tensor: Tensor, fn: Callable[[Tensor], None]) -> None:
    """Call ``fn(∂loss/∂tensor)`` in the backward pass, after every hook registered on ``tensor``
    (a user's ``out.register_hook(lambda g: 2 * g)`` included, whenever it was registered): a
    pre-hook of the node that produced ``tensor``, which autograd runs after the tensor's own
    hooks. A tensor hook registered here would run before the hooks registered after it."""
    node = tensor.grad_fn
    if node is None:  # a leaf: no node to hook
        tensor.register_hook(fn)
        return
    index = tensor.output_nr

    def pre(grad_outputs: Tuple[Optional[Tensor], ...]) -> None:
        grad = grad_outputs[index]
        if grad is not None:
            fn(grad)
    node.register_prehook(pre)


def grad_appender(grads: List[Tensor]) -> Callable[[Tensor], None]:
    """The tensor hook recording ``∂loss/∂output`` into ``grads``.

    It must not reference the record (nor anything else holding the output tensor): a hook is
    owned by the output's autograd node, so ``output → node → hook → record → output`` would be
    a reference cycle through C++ that Python's garbage collector cannot see, and every step's
    outputs, inputs and gradients would stay alive for good.
    """
    def hook(g: Tensor) -> None:
        grads.append(g.detach())
    return hook


def batch_norm_modules(root: nn.Module) -> List[nn.Module]:
    """The BatchNorm modules under ``root`` (the ones :class:`Capture` may route)."""
    return [m for m in root.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
