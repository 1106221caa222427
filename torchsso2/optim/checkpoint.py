"""Checking a SecondOrderOptimizer / VIOptimizer checkpoint against the model before loading it.

:func:`check_checkpoint` reads the whole ``state_dict`` and raises a ``ValueError`` (``TypeError``
for something that is not a state dict at all) naming the first bad entry; it changes nothing.
What it checks, against the optimizer and the model (never the checkpoint against itself):

* the kind of optimizer (a ``VIOptimizer`` checkpoint is refused by a ``SecondOrderOptimizer`` and
  vice versa; checkpoints without the tag are recognised by their face-specific entries);
* the covered modules and the parameter shapes; the param groups (count, sizes, hyperparameters
  present and finite);
* every per-parameter state tensor (momentum buffers): the parameter's shape, a floating dtype,
  finite values;
* every curvature statistic and decomposition: the shape a block of this model's layout has
  (K-FAC factors ``[r, r]`` or ``[r]`` and ``[c, c]`` or ``[c]`` for the layer's ``[r, c]``
  parameter matrix, diagonal ``[P]``, full ``[P, P]``), a floating dtype, finite values;
* the generator state, the counters and the face's own entries (damping);
* the likelihood (``loss=``): statistics of another loss are refused; statistics of another curvature
  kind (``fisher_mc`` saved, ``hessian`` loading) load with a warning, as they are related estimates
  (older checkpoints carry neither and load as before).

It returns the checkpoint's pieces converted for this model (statistics in the parameters'
compute dtype and device, decompositions on the parameters' device, state tensors cloned so the
optimizer never writes into the caller's checkpoint): :class:`CheckedCheckpoint`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock, Layout
from curvature.blocks.base import compute_dtype
from curvature.blocks.layout import kfac_dims
from curvature.selection import unwrapped_name
from curvature.stacklevel import caller_stacklevel

_BLOCK_TYPES = {"full": FullBlock, "diag": DiagBlock, "kfac": KFACBlock}


@dataclass
class CheckedCheckpoint:
    """A checkpoint that passed :func:`check_checkpoint`, ready to apply."""

    optimizer_state: Dict[str, Any]   # {"state", "param_groups"} for torch.optim.Optimizer.load_state_dict
    blocks: Dict[str, Block]          # the curvature EMA, built on this model's layouts
    num_updates: int
    generator: Tensor
    num_steps: int
    num_skipped: int
    consecutive_skips: int  # the skip streak max_consecutive_skips bounds (0 in older checkpoints)
    num_amp_skipped: int
    decomposed: bool
    seed: Optional[int]
    extra: Dict[str, Any]
    saved_on_rank: int = 0  # the rank whose label stream ``generator`` is (0 in older checkpoints)


def face_of(extra: Dict[str, Any]) -> Optional[str]:
    """``"SecondOrderOptimizer"`` / ``"VIOptimizer"`` for a checkpoint's ``torchsso2`` entry (older
    checkpoints carry no tag: their face-specific entries tell), None when unknown."""
    tag = extra.get("optimizer")
    if isinstance(tag, str):
        return tag
    own = extra.get("extra")
    if isinstance(own, dict):  # SecondOrderOptimizer always saved its damping; VIOptimizer nothing or "momentum"
        return "SecondOrderOptimizer" if "damping" in own or "lm" in own else "VIOptimizer"
    return None


def _fail(entry: str, problem: str) -> None:
    raise ValueError(f"checkpoint entry {entry} {problem}; the optimizer is unchanged")


def _tensor(entry: str, value: Any, shapes: Sequence[Tuple[int, ...]]) -> Tensor:
    """A finite floating tensor of one of ``shapes``."""
    if not isinstance(value, Tensor):
        _fail(entry, f"is a {type(value).__name__}, expected a tensor")
    if not value.is_floating_point():
        _fail(entry, f"has dtype {value.dtype}, expected a floating dtype")
    if tuple(value.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(list(s)) for s in shapes)
        _fail(entry, f"has shape {list(value.shape)} ({value.numel()} elements), expected {want} for this model")
    if value.numel() and not bool(torch.isfinite(value).all()):
        _fail(entry, "holds NaN or inf")
    return value


def _count(entry: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        _fail(entry, f"is {value!r}, expected an int >= 0")
    return int(value)


def _statistic_shapes(approx: str, layout: Layout) -> List[List[Tuple[int, ...]]]:
    if approx == "diag":
        return [[(layout.numel,)]]
    if approx == "full":
        return [[(layout.numel, layout.numel)]]
    r, c = kfac_dims(layout)
    return [[(r, r), (r,)], [(c, c), (c,)]]


def _decomposition_shapes(approx: str, layout: Layout) -> Dict[str, List[Tuple[int, ...]]]:
    """Expected tensors of a decomposition (None allowed where a factor is diagonal)."""
    p = layout.numel
    if approx == "diag":
        return {"denom": [(p,)]}
    if approx == "full":
        return {"evecs": [(p, p)], "denom": [(p,)]}
    r, c = kfac_dims(layout)
    return {"ql": [(r, r)], "qr": [(c, c)], "denom": [(r, c)], "linv": [(r, r), (r,)], "rinv": [(c, c), (c,)]}


def _check_decomposition(entry: str, dec: Any, approx: str, layout: Layout, stats: Sequence[Tensor],
                         device: torch.device, dtype: torch.dtype) -> Optional[Dict[str, Any]]:
    if dec is None:
        return None
    if not isinstance(dec, dict):
        _fail(entry, f"is a {type(dec).__name__}, expected a dict or None")
    shapes = _decomposition_shapes(approx, layout)
    if approx == "kfac":
        method = dec.get("method", "eigen")
        need = {"eigen": ("ql", "qr", "denom"), "inverse": ("linv", "rinv")}.get(method)
        if need is None:
            _fail(f"{entry}['method']", f"is {method!r}, expected 'eigen' or 'inverse'")
        optional = {"ql": stats[0].dim() == 1, "qr": stats[1].dim() == 1}
    else:
        need, optional = tuple(shapes), {}
    out: Dict[str, Any] = {k: v for k, v in dec.items() if not isinstance(v, Tensor) and v is not None}
    for key in need:
        value = dec.get(key)
        if value is None and optional.get(key, False):
            out[key] = None
            continue
        if key not in dec:
            _fail(entry, f"has no {key!r}")
        tensor = _tensor(f"{entry}[{key!r}]", value, shapes[key])
        # a copy (the caller's dict stays theirs), at least as wide as this run's decompositions (a
        # float32 checkpoint in a float64 run); a wider saved one (a float64 retry) is kept as it was
        wide = torch.promote_types(tensor.dtype, dtype) if tensor.is_floating_point() else tensor.dtype
        out[key] = tensor.to(device=device, dtype=wide, copy=True)
    return out


def check_blocks(opt: Any, cstate: Any) -> Tuple[Dict[str, Block], int]:
    """The running blocks of a saved curvature state (``RunningCurvature.state_dict()``) in ``opt``'s
    model's compute dtype and device, and its update count; ValueError naming a malformed entry.
    Decompositions are kept at least as wide as ``opt.decomposition_dtype`` (or the blocks')."""
    if not isinstance(cstate, dict) or not isinstance(cstate.get("blocks"), dict):
        _fail("['torchsso2']['curvature']", "is not {'num_updates': int, 'blocks': {module: state}}")
    layouts, approx = opt.engine.layouts, opt.engine.approx
    saved = cstate["blocks"]
    if not set(saved) <= set(layouts):  # a module frozen before the first estimate has no block yet
        _fail("['torchsso2']['curvature']['blocks']",
              f"covers modules {sorted(saved)}, this model covers {sorted(layouts)}")
    blocks: Dict[str, Block] = {}
    for name, bstate in saved.items():
        entry = f"['torchsso2']['curvature']['blocks'][{name!r}]"
        want = approx[name].value
        if not isinstance(bstate, dict) or bstate.get("approx") != want:
            got = bstate.get("approx") if isinstance(bstate, dict) else bstate
            _fail(entry, f"holds a {got!r} block, this optimizer uses {want!r} for module {name!r}")
        lay = layouts[name]
        expected = _statistic_shapes(want, lay)
        tensors = bstate.get("tensors")
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(expected):
            _fail(f"{entry}['tensors']", f"does not hold {len(expected)} statistic tensors")
        ref = lay.params[0]
        dtype, device = compute_dtype(ref.dtype), ref.device
        stats = [_tensor(f"{entry}['tensors'][{i}]", t, shapes).to(dtype=dtype, device=device, copy=True)
                 for i, (t, shapes) in enumerate(zip(tensors, expected))]
        blk = _BLOCK_TYPES[want](lay, *stats)
        blk.decomposition = _check_decomposition(f"{entry}['decomposition']", bstate.get("decomposition"),
                                                 want, lay, stats, device,
                                                 getattr(opt, "decomposition_dtype", None) or dtype)
        blocks[name] = blk
    return blocks, _count("['torchsso2']['curvature']['num_updates']", cstate.get("num_updates", 0))


def _check_optimizer_state(opt: Any, sd: Dict[str, Any]) -> Dict[str, Any]:
    groups, saved_groups = opt.param_groups, sd.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        _fail("['param_groups']", f"is not a list of {len(groups)} param groups")
    params: List[nn.Parameter] = []
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(group["params"]):
            _fail(f"['param_groups'][{i}]", f"is not a group of {len(group['params'])} parameters")
        refused = sorted(k for k in saved if k in opt._REFUSED_GROUP_KEYS)
        if refused:
            _fail(f"['param_groups'][{i}]", f"has keys {refused}, options this optimizer does not have per group "
                  "(it would ignore them): saved by another optimizer, or set on a group by hand")
        for key in (k for k in opt.defaults if k in group):
            if key not in saved:
                _fail(f"['param_groups'][{i}]", f"has no {key!r} (this optimizer's groups have "
                      f"{sorted(opt.defaults)}): it was saved by another optimizer")
            if isinstance(opt.defaults[key], (int, float)) and not isinstance(opt.defaults[key], bool):
                opt._check_group_value(f"['param_groups'][{i}][{key!r}]", key, saved[key])
        params.extend(group["params"])
    index = {pid: k for k, pid in enumerate(pid for g in saved_groups for pid in g["params"])}
    names = {id(p): n for n, p in opt.model.named_parameters()}
    if "state" not in sd:
        _fail("['state']", "is missing (a state_dict() has 'state' and 'param_groups')")
    state = sd["state"]
    if not isinstance(state, dict):
        _fail("['state']", f"is a {type(state).__name__}, expected a dict")
    cloned: Dict[Any, Any] = {}
    for key, entry in state.items():
        if key not in index:
            _fail(f"['state'][{key!r}]", "names no parameter of the saved param groups")
        p = params[index[key]]
        if not isinstance(entry, dict):
            _fail(f"['state'][{key!r}]", f"is a {type(entry).__name__}, expected a dict")
        new = {}
        for k, v in entry.items():
            if isinstance(v, Tensor):
                what = f"['state'][{key!r}][{k!r}] (parameter {names.get(id(p), index[key])!r})"
                v = _tensor(what, v, [tuple(p.shape)]).clone()
            new[k] = v
        cloned[key] = new
    return {"state": cloned, "param_groups": saved_groups}


def _across_wrappers(extra: Dict[str, Any], covered: Dict[str, List[str]]) -> Dict[str, Any]:
    """``extra`` with its module names renamed to ``covered``'s where the two differ only by wrapper
    prefixes (saved under DDP or torch.compile, loaded into the bare model, or the reverse); else as is."""
    saved = extra.get("covered")
    if not isinstance(saved, dict) or saved == covered:
        return extra
    mine = {unwrapped_name(n): n for n in covered}
    rename = {n: mine.get(unwrapped_name(n)) for n in saved if isinstance(n, str)}
    if len(mine) != len(covered) or None in rename.values() or len(set(rename.values())) != len(saved) \
            or {rename[n]: v for n, v in saved.items()} != covered:
        return extra
    out = {**extra, "covered": covered}
    curv = extra.get("curvature")
    if isinstance(curv, dict) and isinstance(curv.get("blocks"), dict):
        out["curvature"] = {**curv, "blocks": {rename.get(n, n): b for n, b in curv["blocks"].items()}}
    return out


def _check_likelihood(opt: Any, extra: Dict[str, Any]) -> None:
    """A checkpoint's ``loss=`` (absent from older ones) must be this optimizer's: its curvature statistics are
    of that likelihood (a categorical Fisher is no Gaussian one)."""
    saved, loss = extra.get("loss"), opt.engine.loss.value
    if saved is not None and saved != loss:
        raise ValueError(f"checkpoint entry ['torchsso2']['loss'] is {saved!r}, this optimizer's loss is {loss!r}: the "
                         f"checkpoint's curvature statistics are of another likelihood; build the optimizer with "
                         f"loss={saved!r} to resume (or a new optimizer to start its curvature afresh); the optimizer "
                         "is unchanged")


def _check_groups_lr(opt: Any, own: Dict[str, Any]) -> None:
    """A checkpoint of a PyTorch-SSO compat class whose updates scale the groups' lr (a gradient EMA,
    ``grad_ema_decay``) loads only into such a class: the native classes would step with the groups' lr as
    it is (``1/scale`` times the compat's step)."""
    if own.get("groups_lr") != "pytorch-sso" or opt.groups_lr == "pytorch-sso":
        return
    scale = own.get("lr_scale")
    if scale == 1.0:  # no gradient EMA: the groups' lr is the native one
        return
    where = f"torchsso2.compat.pytorch_sso.{opt.face_name}"
    if scale is None:  # saved before the scale was recorded: the default grad_ema_decay=1 is the common case
        warnings.warn(f"load_state_dict: this checkpoint was saved by {where}, which did not record its gradient EMA "
                      f"(grad_ema_decay = d): the native {opt.face_name} steps with the groups' lr as saved, which is "
                      "right for d = 1 (the default) and 1/d times too large otherwise (multiply the groups' lr and "
                      "initial_lr by d after loading, or load it into the compat class)", UserWarning,
                      stacklevel=caller_stacklevel())
        return
    raise ValueError(f"this checkpoint was saved by {where}, whose updates apply the groups' lr times {scale!r} (its "
                     f"gradient EMA, grad_ema_decay): the native {opt.face_name} would step with the groups' lr as it "
                     "is; load it into the compat class, or set its param_groups' lr (and initial_lr) to lr × "
                     f"{scale!r} and its ['torchsso2']['extra']['lr_scale'] to 1.0 (the optimizer is unchanged)")


def check_checkpoint(opt: Any, state_dict: Any) -> CheckedCheckpoint:
    """Check ``state_dict`` against ``opt`` (a :class:`CurvatureOptimizer`) and its model; see the module
    docstring. Raises ``ValueError`` naming the bad entry; changes nothing."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict expects the dict returned by state_dict(), got {type(state_dict).__name__}")
    if "steps" in state_dict and "param_groups" not in state_dict:  # ('layers' only with include_factors)
        raise ValueError("this is a KFACPreconditioner (kfac_pytorch) checkpoint (key 'steps', no 'param_groups'), "
                         f"not a {opt.face_name}'s: load it with KFACPreconditioner.load_state_dict; the optimizer "
                         "is unchanged")
    extra = state_dict.get("torchsso2")
    if not isinstance(extra, dict):
        raise ValueError("state_dict has no 'torchsso2' entry: it was not saved by SecondOrderOptimizer or "
                         "VIOptimizer, or it went through torch.distributed.checkpoint's get_state_dict / "
                         "get_optimizer_state_dict, which keep only 'state' and 'param_groups' (the curvature is lost "
                         "there): save opt.state_dict() with torch.save instead (docs/guide.md); the optimizer is "
                         "unchanged")
    face, mine = face_of(extra), opt.face_name
    if face != mine:
        raise ValueError(f"this checkpoint was saved by a {face or 'different optimizer'}, not a {mine}: load it "
                         f"into a {face or 'matching optimizer'} (the optimizer is unchanged)")
    covered = {n: list(lay.param_names) for n, lay in opt.engine.layouts.items()}
    extra = _across_wrappers(extra, covered)
    if extra.get("covered") != covered:
        raise ValueError(f"checkpoint is for a model covering {extra.get('covered')}, this model covers {covered}; "
                         "the optimizer is unchanged")
    shapes = opt._param_shapes()
    if extra.get("param_shapes", shapes) != shapes:
        raise ValueError(f"checkpoint is for parameters of shapes {extra['param_shapes']}, "
                         f"this optimizer's parameters have shapes {shapes}; the optimizer is unchanged")
    _check_likelihood(opt, extra)
    optimizer_state = _check_optimizer_state(opt, state_dict)
    blocks, num_updates = check_blocks(opt, extra.get("curvature"))
    gen = extra.get("generator")
    try:
        torch.Generator().set_state(gen)
    except (TypeError, RuntimeError, ValueError) as err:
        _fail("['torchsso2']['generator']", f"is not a torch.Generator state ({err})")
    seed = extra.get("seed")
    if seed is not None:
        _count("['torchsso2']['seed']", seed)
    own = extra.get("extra", {})
    if not isinstance(own, dict):
        _fail("['torchsso2']['extra']", f"is a {type(own).__name__}, expected a dict")
    opt._check_extra_state(own)
    _check_groups_lr(opt, own)
    saved_kind, kind = extra.get("curvature_kind"), opt._curvature_name()
    if isinstance(saved_kind, str) and saved_kind != kind:
        warnings.warn(f"load_state_dict: the checkpoint's curvature statistics were estimated with curvature="
                      f"{saved_kind!r}, this optimizer estimates curvature={kind!r}: the running curvature continues "
                      f"from them and mixes the two until the EMA forgets the old ones (build the optimizer with "
                      f"curvature={saved_kind!r} to resume the same run)", UserWarning, stacklevel=caller_stacklevel())
    return CheckedCheckpoint(
        optimizer_state=optimizer_state, blocks=blocks, num_updates=num_updates, generator=gen.clone(),
        num_steps=_count("['torchsso2']['num_steps']", extra.get("num_steps")),
        num_skipped=_count("['torchsso2']['num_skipped']", extra.get("num_skipped", 0)),
        consecutive_skips=_count("['torchsso2']['consecutive_skips']", extra.get("consecutive_skips", 0)),
        num_amp_skipped=_count("['torchsso2']['num_amp_skipped']", extra.get("num_amp_skipped", 0)),
        decomposed=bool(extra.get("decomposed", False)), seed=seed, extra=own,
        saved_on_rank=_count("['torchsso2']['saved_on_rank']", extra.get("saved_on_rank", 0)))
