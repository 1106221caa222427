"""Detect uses of covered parameters outside the module calls a :class:`~curvature.capture.Capture` records.

Fisher-type blocks are built from what the covered modules' calls record (their inputs and the
gradients at their outputs). A covered parameter that the forward also uses elsewhere, e.g. a
tied output head written functionally (``F.linear(h, emb.weight)``), contributes to the loss
through a path no record sees, so its block would silently miss that contribution. This module
finds such uses and raises a ``ValueError`` naming the parameter and the fix.

How: every covered module call is a *window* of autograd sequence numbers (the thread's next
sequence number is read when the call starts and when its hooks have run; autograd numbers the
nodes it creates in one thread in increasing order). After the forward, the graph of the model's output is walked
once; every node that consumes a covered parameter directly (an edge to its ``AccumulateGrad``)
must have been created inside a call of a module holding that parameter. A dtype cast of the
parameter (autocast's cached low-precision copy, which may have been made elsewhere first) is
looked through: its consumers are the uses. Uses that do not reach
the output (a module's discarded result, a regularizer added to the loss outside the model) are
not in that graph and are not the likelihood's, so they are not reported.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .hook_marks import LocalHook, capture_hook, in_func_transform

__all__ = ["UseWindows", "reaches"]


def reaches(output: Tensor, params: Iterable[Tensor], stop: Optional[Any] = None) -> bool:
    """Whether ``output``'s autograd graph reaches the gradient accumulator of one of ``params``
    (a walk of the graph from ``output.grad_fn``; ``stop``: a node not walked past)."""
    return nodes_reach([output.grad_fn], params, stop)


def nodes_reach(nodes: Iterable[Any], params: Iterable[Tensor], stop: Optional[Any] = None) -> bool:
    """Whether the autograd graph above ``nodes`` reaches the gradient accumulator of one of ``params``."""
    ids = {id(p) for p in params}
    seen = {stop} if stop is not None else set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in ids:
            return True
        todo.extend(nxt for nxt, _ in node.next_functions)
    return False

#: autograd nodes of a dtype cast (autocast's cached copies of the parameters)
_CASTS = frozenset({"ToCopyBackward0"})
#: the thread's next autograd sequence number, without creating a node (None: older torch)
_next_sequence_nr = getattr(torch.autograd, "_get_sequence_nr", None)


class UseWindows:
    """Sequence-number windows of the calls of ``modules`` (name -> module) in one forward.

    ``attach()`` registers a pre-hook (after the user's pre-hooks) and a forward hook (first; call it
    before the capture's own hooks are prepended, so the window also covers what those compute, and
    ends before the user's forward hooks) on every module; ``check(output)`` raises for a covered
    parameter used outside its modules' calls. A window is the layer's own forward: a parameter used
    in a user's (pre-)hook of its layer (a fake-quantized weight recomputing the output, ``x * W.sum()``)
    reaches the output past what the capture records, so it is a use outside.
    """

    def __init__(self, modules: Dict[str, nn.Module], root: Optional[nn.Module] = None) -> None:
        #: id(param) -> (qualified name, names of the covered modules holding it)
        self.params: Dict[int, Tuple[str, Set[str]]] = {}
        for name, module in modules.items():
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                entry = self.params.setdefault(id(p), (f"{name}.{pname}" if name else pname, set()))
                entry[1].add(name)
        self.modules = modules
        #: the model, whose modules holding a covered parameter without being covered the error names
        self.root = root
        self.windows: Dict[str, List[Tuple[int, int]]] = {}
        self._open: Dict[str, List[int]] = {}
        self._probe = torch.zeros((), requires_grad=True)
        #: the nodes the checks so far walked: a later forward's walk does not walk them again (a rollout closure
        #: feeds an output back into the model); the windows are kept for the capture's life (one closure call),
        #: so what a walk reaches that no earlier one did is judged by every window (a parameter used before the
        #: first forward for the second, state one forward leaves to the next)
        self._walked: Set[Any] = set()

    def _seq(self, opening: bool) -> int:
        """A window bound: a number below every autograd sequence number of a node created after
        this call (``opening``), or above every one created before it (closing); autograd numbers
        the nodes of one thread in increasing order. Read from the thread's counter without creating
        a node (``torch.autograd._get_sequence_nr``: 0.5 µs; a throw-away probe node, the fall-back
        where torch lacks that function, costs 7 µs and an allocation per bound)."""
        if _next_sequence_nr is not None:
            nxt = int(_next_sequence_nr())  # the number the next node will get
            return nxt - 1 if opening else nxt
        node = (self._probe * 1.0).grad_fn
        assert node is not None
        return int(node._sequence_nr())

    def attach(self) -> List[RemovableHandle]:
        """Register the window hooks; returns their handles."""
        handles: List[RemovableHandle] = []
        for name, module in self.modules.items():
            if not any(name in holders for _, holders in self.params.values()):
                continue
            handles.append(module.register_forward_pre_hook(LocalHook(self._opener(name))))
            handles.append(module.register_forward_hook(LocalHook(self._closer(name)), prepend=True))
        return handles

    def _opener(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: Tuple[object, ...]) -> None:
            if torch.is_grad_enabled() and not in_func_transform():
                self._open.setdefault(name, []).append(self._seq(True))
        return capture_hook(hook)

    def _closer(self, name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: Tuple[object, ...], output: object) -> None:
            starts = self._open.get(name)
            if torch.is_grad_enabled() and starts and not in_func_transform():
                self.windows.setdefault(name, []).append((starts.pop(), self._seq(False)))
        return capture_hook(hook)

    def _use(self, node: object, var: Tensor, outside: Dict[str, Optional[str]]) -> None:
        """Record ``var`` in ``outside`` when it is a covered parameter and ``node`` (a node using it)
        was created outside every call of the modules holding it."""
        entry = self.params.get(id(var))
        # a holder never called is the engine's error ("covered modules ... not called")
        if entry is not None and any(h in self.windows for h in entry[1]) \
                and not self._inside(int(node._sequence_nr()), entry[1]):  # type: ignore[attr-defined]
            outside.setdefault(entry[0], type(node).__name__)

    def _uncovered_holders(self, names: Dict[int, str]) -> Dict[str, List[str]]:
        """``{qualified name: [modules]}``: the modules of the model that hold the parameters ``names`` (id ->
        name) without being covered (a tied head left out with ``skip_modules``); looked up for the error only."""
        found: Dict[str, List[str]] = {}
        if self.root is None:
            return found
        covered = {id(m) for m in self.modules.values()}
        for name, module in self.root.named_modules(remove_duplicate=False):
            if id(module) in covered:
                continue
            for p in module.parameters(recurse=False):
                if id(p) in names and name not in found.get(names[id(p)], []):
                    found.setdefault(names[id(p)], []).append(name)
        return found

    def _inside(self, seq: int, holders: Set[str]) -> bool:
        return any(a < seq < b for name in holders for a, b in self.windows.get(name, ()))

    def check(self, output: Tensor) -> None:
        """ValueError naming the covered parameters that ``output``'s graph uses outside a call
        of a module holding them. A later check (the next forward of the closure: gradient accumulation,
        a rollout feeding this output back into the model) walks only the nodes no check walked; the
        windows are disjoint spans of time, so those of earlier forwards never cover a later node."""
        self._check(output)

    def _check(self, output: Tensor) -> None:
        root = output.grad_fn
        if root is None or not self.params:
            return
        outside: Dict[str, Optional[str]] = {}
        # the nodes themselves, not their ids: holding a node's Python object keeps it (torch returns the same one
        # while it lives); the id of a freed temporary one can be reused by another node, which was then skipped
        # (seen on torch 2.3 and 2.5)
        seen = self._walked
        if root in seen:
            return
        seen.add(root)
        stack = [root]
        while stack:
            node = stack.pop()
            cast = type(node).__name__ in _CASTS
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)
                if var is not None:  # AccumulateGrad of a leaf
                    if cast:  # checked at the cast's consumers (below)
                        continue
                    self._use(node, var, outside)
                    continue
                if type(nxt).__name__ in _CASTS:
                    # autocast casts a parameter once and caches the copy (the first cast may be made
                    # elsewhere, e.g. in nn.MultiheadAttention's own forward): the use is the consumer's
                    for leaf, _ in nxt.next_functions:
                        if leaf is not None and getattr(leaf, "variable", None) is not None:
                            self._use(node, leaf.variable, outside)
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if outside:
            names = sorted(outside)
            holders = {n: sorted(e[1]) for e in self.params.values() for n in [e[0]] if n in outside}
            uncovered = self._uncovered_holders({i: e[0] for i, e in self.params.items() if e[0] in outside})
            where = (f"covered parameter(s) {names} are used in the forward outside the module(s) holding them "
                     f"({', '.join(f'{n}: {holders[n]}' for n in names)}; first use seen in autograd node "
                     f"{', '.join(str(outside[n]) for n in names)})")
            if uncovered:  # a module sharing the parameter that the curvature does not cover (skip_modules)
                covered = sorted({h for n in uncovered for h in holders[n]})
                every = covered + sorted({m for ms in uncovered.values() for m in ms})
                raise ValueError(
                    f"{where}: {', '.join(f'{n} is also held by {m}' for n, m in uncovered.items())}, which the "
                    "curvature does not cover (left out with skip_modules, or of a type it does not cover): a call "
                    "of it is a use outside the covered modules, whose contribution the blocks would miss. Cover "
                    f"the modules sharing a parameter alike: skip all of them (skip_modules={every!r}), "
                    f"or none (a tied K-FAC block too large to decompose can be diagonal: approx={{{covered[0]!r}: "
                    "'diag'}). If it is not called, the use is another one: a functional use such as "
                    "F.linear(h, emb.weight), or a forward (pre-)hook computing with the parameter")
            raise ValueError(
                f"{where}, e.g. a functional tied head F.linear(h, emb.weight), or a forward (pre-)hook of the layer "
                "computing with its parameters (a fake-quantized weight). "
                "The curvature records module calls only, so its blocks would miss that use's contribution. "
                "Make the use a module call sharing the parameter (head = nn.Linear(d, V, bias=False); "
                "head.weight = emb.weight), or leave the holding module(s) out with skip_modules=[...]")
