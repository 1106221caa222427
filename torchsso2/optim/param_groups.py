"""The param groups of the native optimizers: how ``params`` is read (torch.optim's forms, named
parameters) and which group values and keys are accepted — at construction, at every step, in a
checkpoint — so that a value the optimizer would ignore or could not use is refused with its name."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import Tensor, nn

from .validation import MAX_LR, check_number

__all__ = ["GroupChecks", "listed_groups", "refuse_sparse_gradients"]


def listed_groups(params: Iterable[Any]) -> List[Any]:
    """torch.optim's ``params`` (tensors, or dicts of groups) as a list whose groups hold lists, so that
    it can be read before ``torch.optim.Optimizer`` reads it (generators are consumed once)."""
    if isinstance(params, (Tensor, str)) or not isinstance(params, Iterable):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        f"but got {torch.typename(params)}")
    out: List[Any] = []
    for g in params:
        if isinstance(g, dict) and "params" in g:
            g = named_group(g, _param_list(g["params"]))
        out.append(g)
    if out and not isinstance(out[0], dict) and any(_is_named(g) for g in out):  # model.named_parameters()
        out = [named_group({}, out)]
    for g in out:
        if isinstance(g, dict) and "params" not in g:
            raise ValueError(f"parameter group didn't specify a value of required optimization parameter params "
                             f"(got the keys {sorted(map(str, g))})")
        entries = g["params"] if isinstance(g, dict) else [g]
        for p in entries:
            if not isinstance(p, Tensor):
                raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts "
                                f"(or (name, Tensor) pairs), but it holds {type(p).__name__} {p!r}"[:300])
    return out


def refuse_sparse_gradients(model: nn.Module, groups: List[Dict[str, Any]]) -> None:
    """ValueError for a parameter of the optimizer that gets sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): every update here (curvature and plain) needs dense gradients."""
    own = {id(p) for g in groups for p in g["params"] if p.requires_grad}  # a frozen one gets no gradient
    sparse = [f"{name}.weight" if name else "weight" for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) in own]
    if sparse:
        raise ValueError(f"parameters {sparse} get sparse gradients ({'/'.join(['nn.Embedding', 'nn.EmbeddingBag'])}"
                         "(sparse=True)); this optimizer needs dense gradients for every parameter it updates, the "
                         "plain update of a skipped module included: build the module with sparse=False, or leave "
                         "the parameter out of this optimizer (params=[...] without it) and update it with "
                         "torch.optim.SparseAdam")


def _param_list(params: Any) -> List[Any]:
    """A param group's ``params`` as torch.optim takes them — a tensor, or an ordered iterable of tensors
    or ``(name, tensor)`` pairs — as a list; a set is refused, as torch.optim refuses it (converting it to a
    list first would skip that check)."""
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering "
                        "of tensors in sets will change between runs. Please use a list instead.")
    return list(params)


#: per-group options of other torch.optim optimizers, and constructor options of these optimizers that hold for
#: every group (damping, the curvature schedule, ...): refused in a param group rather than silently ignored
_TORCH_ONLY_GROUP_KEYS = frozenset({"maximize", "nesterov", "dampening", "foreach", "fused", "capturable",
                                    "differentiable", "betas", "eps", "amsgrad", "damping", "ema_decay", "kl_clip",
                                    "curv_update_interval", "inv_update_interval", "approx", "curvature",
                                    "mc_samples", "kl_weighting", "num_mc_samples", "dataset_size"})


def _is_named(item: Any) -> bool:
    """Whether ``item`` is a ``(name, parameter)`` pair (``model.named_parameters()``)."""
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)


def named_group(group: Dict[str, Any], entries: List[Any]) -> Dict[str, Any]:
    """``group`` with ``params`` the parameters of ``entries``; where those are ``(name, parameter)``
    pairs, their names go to ``param_names``, as torch.optim keeps them (torch >= 2.6: in
    ``state_dict()`` too, for matching state to a changed model). ValueError, torch.optim's, for a
    group naming only some of its parameters."""
    named = [_is_named(e) for e in entries]
    if not any(named):
        return {**group, "params": entries}
    if not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    return {**group, "params": [e[1] for e in entries], "param_names": [e[0] for e in entries]}



class GroupChecks:
    """Mixin of :class:`~torchsso2.optim.base.CurvatureOptimizer` (before ``torch.optim.Optimizer`` in its
    bases): the checks of its param groups' values and keys."""

    #: the param group hyperparameters checked in every group: (key, upper bound, bound excluded)
    _GROUP_RANGES = (("lr", MAX_LR, False), ("momentum", 1.0, True), ("weight_decay", math.inf, False))
    #: param group keys refused (at construction, at each step, in a checkpoint) rather than ignored
    _REFUSED_GROUP_KEYS = _TORCH_ONLY_GROUP_KEYS
    #: optimizer attributes a user may set between steps (``opt.kl_clip = 1e-4``), checked at every step as
    #: the constructor checks them: (name, low, low excluded, high, high excluded, None allowed)
    _STEP_ATTRS: Tuple[Tuple[str, float, bool, float, bool, bool], ...] = (
        ("kl_clip", 0.0, True, math.inf, False, True), ("ema_decay", 0.0, False, 1.0, True, False))

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """``torch.optim.Optimizer.add_param_group`` with the group's ``lr``, ``momentum`` and
        ``weight_decay`` checked as the constructor checks its arguments (ValueError/TypeError naming
        the value); the constructor's groups pass here too."""
        if isinstance(param_group, dict):
            for key, high, high_open in self._GROUP_RANGES:
                if key in param_group:
                    check_number(f"param group {key!r}", param_group[key], low=0.0, high=high, high_open=high_open)
            if not self._REFUSED_GROUP_KEYS.isdisjoint(param_group):
                raise ValueError(self._refused_keys_message("param group", param_group))
            params = param_group.get("params")
            param_group = named_group(param_group, _param_list(params) if params is not None else [])
            listed = param_group["params"]
            if len({id(p) for p in listed}) != len(listed):
                raise ValueError("a param group lists a parameter more than once (torch.optim only warns; here it "
                                 "would take a plain update besides its curvature step); list each parameter once")
        super().add_param_group(param_group)

    def _check_step_call(self, closure: Any) -> None:
        """TypeError without a callable closure, RuntimeError under ``torch.inference_mode``;
        :meth:`_check_group_values`."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError("step() cannot run under torch.inference_mode(): its closure's backward and the "
                               "curvature need autograd; call step() outside it (under torch.no_grad() it works: "
                               "the step enables gradients for the closure)")
        if closure is None or not callable(closure):
            dcp = (" (torch.distributed.checkpoint's get_optimizer_state_dict calls step() without one to create "
                   "the state, and its dict would lack this optimizer's curvature entry: save opt.state_dict() "
                   "with torch.save and restore it with load_state_dict)") if closure is None else ""
            loop = (" A training loop that calls loss.backward() and then step() with no closure (Hugging Face "
                    "Trainer, accelerate, Lightning's manual optimization without a closure) can take K-FAC "
                    "natural-gradient steps with KFACPreconditioner: precond.step() after the backward, before a "
                    "torch.optim optimizer's step() (under accelerate's gradient accumulation only `if "
                    "accelerator.sync_gradients:`; in the Trainer from a TrainerCallback's on_pre_optimizer_step; "
                    "both with accumulation_steps= the gradient accumulation steps; docs/guide.md, 'Hugging Face "
                    "accelerate and Trainer'). PyTorch Lightning's automatic optimization passes a closure, "
                    "except with precision='16-mixed' on a GPU, whose GradScaler runs the closure itself and then "
                    "calls step() without it: use precision='bf16-mixed' or '32-true' there."
                    ) if closure is None else ""
            raise TypeError("step() needs a closure that zero-grads, runs the model's forward, calls backward() and "
                            "returns the loss (or (loss, output)): the curvature is captured while it runs; see the "
                            f"class docstring{dcp}.{loop}")
        self._check_group_values()

    def _check_group_values(self) -> None:
        """Every group's ``lr``, ``momentum`` and ``weight_decay`` as :meth:`add_param_group` accepts
        them, at every step: a scheduler or a hand-set value (``LambdaLR`` returning NaN) raises a
        ValueError naming the group before it reaches the parameters."""
        for i, group in enumerate(self.param_groups):
            for key, high, high_open in self._GROUP_RANGES:
                v = group.get(key, 0.0)
                if type(v) is float and 0.0 <= v < math.inf and v <= high and not (high_open and v == high):
                    continue  # the common case, without the call
                if key in group:
                    checked = check_number(f"param_groups[{i}][{key!r}]", v, low=0.0, high=high, high_open=high_open)
                    if type(v) is not int:  # np.float32 from a scheduler's schedule: the optimizer's math takes floats
                        group[key] = checked
            if not self._REFUSED_GROUP_KEYS.isdisjoint(group):  # set on a live group: refused as add_param_group does
                raise ValueError(self._refused_keys_message(f"param_groups[{i}]", group))
        self._check_attrs()

    def _step_settings(self) -> Dict[str, Any]:
        """The :attr:`_STEP_ATTRS`' current values: compared between the ranks at every step (a value set on
        one rank only would drift the replicas apart silently)."""
        return {name: getattr(self, name) for name, *_ in self._STEP_ATTRS}

    def _check_attrs(self) -> None:
        """The :attr:`_STEP_ATTRS` a user may have set since the last step (``opt.kl_clip = nan``), as the
        constructor checks them (ValueError/TypeError naming the attribute); at every step and ``state_dict``."""
        for name, low, low_open, high, high_open, optional in self._STEP_ATTRS:
            v = getattr(self, name)
            if (v is None and optional) or (type(v) is float and (low < v if low_open else low <= v)
                                            and (v < high if high_open else v <= high) and v != math.inf):
                continue  # the common case (a NaN fails the comparisons)
            setattr(self, name, check_number(f"{type(self).__name__}.{name}", v, low=low, low_open=low_open,
                                             high=high, high_open=high_open))

    def _refused_keys_message(self, where: str, group: Dict[str, Any]) -> str:
        keys = sorted(k for k in group if k in self._REFUSED_GROUP_KEYS)
        return (f"{where} keys {keys} are options {type(self).__name__} does not have per group (options of other "
                "torch.optim optimizers, or of its constructor, which hold for every group), which it would "
                "ignore; remove them")

    def _check_group_value(self, entry: str, key: str, value: Any) -> None:
        """A param group hyperparameter of a checkpoint: a finite number in the argument's range."""
        high, high_open = next(((h, o) for k, h, o in self._GROUP_RANGES if k == key), (math.inf, False))
        try:  # the argument's own check, with the checkpoint's message
            check_number(entry, value, low=0.0, high=high, high_open=high_open)
        except (TypeError, ValueError):
            raise ValueError(f"checkpoint entry {entry} is {value!r}, expected a finite number in "
                             f"[0, {high}{')' if high_open else ']'}; the optimizer is unchanged") from None
