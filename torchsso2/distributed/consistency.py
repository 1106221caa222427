"""Cross-rank consistency check of schedule-defining settings, run when an optimizer is built.

Ranks that disagree on, say, ``factor_update_steps`` run different collectives at the same
step and hang (or silently mix unrelated tensors). :func:`check_same_settings` compares a
dictionary of settings over all ranks with one small all-reduce of 56-bit digests (a second
one, only on a mismatch, gathers the differing values' text) and raises the same
``ValueError`` on every rank, naming each differing setting and every rank's value.
:func:`check_optimizer_settings` and :func:`check_kfac_settings` collect the settings of the
native optimizers and of :class:`~torchsso2.kfac.KFACPreconditioner`.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping
from typing import Any, Dict, List, Optional

import torch

from torchsso2.distributed.assignment import grad_worker_count
from torchsso2.distributed.communicator import BucketedCommunicator

#: characters of each differing value's text that travel in the error message
VALUE_CHARS = 160
#: the most of a differing setting's text gathered to find where the ranks' values first differ (error path only)
MAX_SHOWN_TEXT = 1 << 16


def describe(value: Any) -> str:
    """A text for ``value`` that is equal on two ranks exactly when the setting is the same.

    Callables (schedules) are described by their qualified name: two ranks passing a schedule
    and a constant differ; the schedules' code itself is not compared.
    """
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):  # a tensor lr: its value, as that number's (not its repr: device, precision)
        return describe(value.item()) if value.numel() == 1 else f"tensor {list(value.shape)} {value.dtype}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if hasattr(value, "value") and hasattr(type(value), "__members__"):  # an Enum
        return f"{type(value).__name__}.{value.name}"
    if callable(value) and not isinstance(value, type):
        return f"callable {getattr(value, '__qualname__', type(value).__name__)}"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # an int, a NumPy int: exactly
        return repr(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # 1.0, np.float64(1.0): the int 1's
        number = float(value)
        return repr(int(number)) if number.is_integer() else repr(number)
    return repr(value)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=7).digest(), "little")


def _gather(comm: Any, row: torch.Tensor) -> torch.Tensor:
    """Every rank's ``row`` (int64, same shape everywhere) as a ``[world, *row.shape]`` tensor.

    Not counted in ``comm.bytes_sent`` / ``num_collectives`` (they measure the optimizer's
    traffic, the quantity the cost models in docs/distributed.md predict).
    """
    table = torch.zeros((comm.world_size, *row.shape), dtype=torch.int64, device=row.device)
    table[comm.rank] = row
    counters = (comm._bytes_sent, comm._num_collectives) if isinstance(comm, BucketedCommunicator) else None
    comm.allreduce([table], op="sum")
    if counters is not None:
        comm._bytes_sent, comm._num_collectives = counters
    return table


def check_same_settings(comm: Any, settings: Mapping[str, Any], owner: str,
                        device: Optional[torch.device] = None) -> None:
    """Raise ``ValueError`` on every rank if any of ``settings`` differs between the ranks of ``comm``.

    Collective: every rank calls it with the same keys (in any order). Nothing happens with
    one rank.

    Args:
        comm: a :class:`~torchsso2.distributed.Communicator`.
        settings: name -> value (compared through :func:`describe`).
        owner: what is being built, for the message (e.g. ``"KFACPreconditioner"``).
        device: where the small int64 buffers live (CUDA for NCCL); CPU by default.
    """
    if comm.world_size <= 1:
        return
    device = torch.device("cpu") if device is None else device
    keys = sorted(settings)
    texts = [describe(settings[k]) for k in keys]
    row = torch.tensor([_digest(",".join(keys))] + [_digest(t) for t in texts], dtype=torch.int64, device=device)
    table = _gather(comm, row).cpu()
    if bool((table == table[0]).all()):
        return
    if not bool((table[:, 0] == table[0, 0]).all()):
        raise ValueError(f"{owner}: the ranks compare different sets of settings (torchsso2 versions differ "
                         f"between ranks?); this rank's: {keys}")
    differing = [i for i in range(len(keys)) if not bool((table[:, 1 + i] == table[0, 1 + i]).all())]
    # the whole texts (the error path only): each shown from a little before where the ranks' first differ, so that
    # a long value (a model's buffer list) names the entry that differs, not a prefix every rank shares
    raws = [texts[i].encode("utf-8")[:MAX_SHOWN_TEXT] for i in differing]
    lengths = _gather(comm, torch.tensor([len(r) for r in raws], dtype=torch.int64, device=device)).cpu()
    codes = torch.zeros(len(differing), max(1, int(lengths.max())), dtype=torch.int64)
    for j, raw in enumerate(raws):
        codes[j, :len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    values = _gather(comm, codes.to(device)).cpu()
    lines: List[str] = []
    for j, i in enumerate(differing):
        per = [bytes(values[r, j, :int(lengths[r, j])].tolist()) for r in range(comm.world_size)]
        first = next((k for k in range(min(map(len, per))) if len({t[k] for t in per}) > 1), min(map(len, per)))
        lo = max(0, first - VALUE_CHARS // 4)
        per_rank = []
        for r, raw in enumerate(per):
            shown = raw[lo:lo + VALUE_CHARS].decode("utf-8", errors="replace")
            per_rank.append(f"rank {r}: {'…' if lo else ''}{shown}{'…' if len(raw) > lo + VALUE_CHARS else ''}")
        lines.append(f"{keys[i]} ({', '.join(per_rank)})")
    raise ValueError(f"{owner} was built with different settings on different ranks, which would make their "
                     f"collectives mismatch (a hang or wrong results): " + "; ".join(lines)
                     + ". Pass the same values on every rank.")


def groups_digest(groups: Any, modulus: int, attrs: Optional[Dict[str, Any]] = None) -> List[int]:
    """Two independent numbers in ``[0, modulus)``, equal on two ranks when their param groups' settings
    (every key but ``params``: lr, momentum, weight decay, ...) and the optimizer attributes ``attrs``
    (those a user may set between steps: ``kl_clip``, ``damping``, ...) are equal: the step's gradient
    all-reduce carries them, so a group added on every rank with other values, or a schedule or an
    attribute set that differs between ranks, is found at the next step rather than drifting the replicas
    apart. Two, because the all-reduce averages them: with three or more ranks other ranks' different
    values can average to this rank's own one (chance about ``1/modulus`` per value)."""
    text = describe([{k: v for k, v in sorted(g.items()) if k != "params"} for g in groups])
    if attrs:
        text += "|" + describe(sorted(attrs.items()))
    m = max(1, int(modulus))
    return [_digest(text) % m, _digest("salt:" + text) % m]


def sizes_row(count: int, numel: int, modulus: int) -> List[float]:
    """``[count, numel, digest]`` modulo ``modulus``, as floats: what a gradient all-reduce carries so that every
    rank can tell whether all ranks hold the same count and total size of trainable parameters (their mean
    equals this rank's row only then; ``modulus`` keeps the sum over the ranks exact in the reduce's dtype)."""
    return [float(count % modulus), float(numel % modulus), float(sizes_digest(count, numel, modulus))]


def sizes_digest(count: int, numel: int, modulus: int) -> int:
    """A number in ``[0, modulus)`` for a rank's count and total size of trainable parameters, sent beside
    the two sizes themselves: their average over three or more ranks can equal this rank's own sizes
    while the ranks differ; the digest's average then still differs (chance about ``1/modulus``)."""
    return _digest(f"{count}:{numel}") % max(1, int(modulus))


def _model_device(model: Any) -> torch.device:
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    return params[0].device if params else torch.device("cpu")


def _nccl(comm: Any) -> bool:
    return getattr(comm, "backend_name", "") == "nccl"


#: optimizer attributes compared when present (SecondOrderOptimizer: damping, kl_clip,
#: damping_adaptation_interval, decay and min_damping, curv_warmup_steps, kfac_method, the adaptive-mode flags and
#: interval; VIOptimizer: dataset_size, prior_precision, init_precision, num_mc_samples, kl_weighting,
#: damping, noise_variance, the reparam estimator, momentum_debias, curvature_init, mc_parallel)
SUBCLASS_ATTRIBUTES = ("damping", "kl_clip", "damping_adaptation_interval", "dataset_size", "prior_precision",
                       "init_precision", "num_mc_samples", "kl_weighting", "noise_variance", "curv_warmup_steps",
                       "use_adaptive_learning_rate", "use_adaptive_momentum", "adaptive_coefficients_interval",
                       "kfac_method", "damping_adaptation_decay", "min_damping", "reparam", "momentum_debias",
                       "curvature_init", "mc_parallel")


def check_optimizer_settings(opt: Any) -> None:
    """:func:`check_same_settings` for a :class:`~torchsso2.optim.base.CurvatureOptimizer` under construction.

    Compares the optimizer class, the curvature kind, loss, per-module approximation and ``kfac_approx``, the
    update intervals, ``ema_decay``, ``mc_samples``, the non-finite policy, the decomposition
    dtype, ``grad_worker_fraction`` / ``assignment_strategy`` (passed through ``opt``), the
    defaults of the param groups (lr, momentum, ...), every group's parameter shapes and settings, the model's
    parameters and buffers (counts, names, shapes and dtypes: the start broadcasts them, frozen ones too), and
    the attributes of :data:`SUBCLASS_ATTRIBUTES` the optimizer has set (damping, ...).
    """
    if opt.comm.world_size <= 1:
        return
    engine = opt.engine
    settings: Dict[str, Any] = {
        "optimizer": type(opt).__name__,
        "curvature": engine.kind,
        "loss": engine.loss,
        "mc_samples": engine.mc_samples,
        "modules": {name: approx for name, approx in engine.approx.items()},
        "kfac_approx": engine.kfac_approx.value,
        "curv_update_interval": opt.curv_update_interval,
        "inv_update_interval": opt.inv_update_interval,
        "ema_decay": opt.ema_decay,
        "on_nonfinite": opt.on_nonfinite,
        "decomposition_dtype": opt.decomposition_dtype,
        "param_groups": [[list(p.shape) for p in g["params"]] for g in opt.param_groups],
        # the start's broadcast and every all-reduce pair the ranks' tensors by position: a dtype that
        # differs (float32 here, float64 there) would corrupt them, not raise
        "param_dtypes": sorted({str(p.dtype) for g in opt.param_groups for p in g["params"]}),
        # the start's broadcast sends rank 0's parameters (those outside the groups too: a frozen embedding) and
        # buffers (torchsso2/optim/grid.py: agree_on_start), paired by position: another number, shape or dtype
        # would corrupt them (gloo) or fail without naming them (MPI)
        "model.parameters.count": len(list(opt.model.parameters())),
        "model.parameters": [f"{name}: {list(p.shape)} {p.dtype}" for name, p in opt.model.named_parameters()],
        "buffers.count": len(list(opt.model.buffers())),
        "buffers": [f"{name}: {list(b.shape)} {b.dtype}" for name, b in opt.model.named_buffers()],
    }
    placement = getattr(opt, "placement", None)
    if placement is not None:
        # the grad workers per block it gives at this world size: "comm_opt" on one rank and 1.0 on another agree
        try:
            settings["grad_worker_fraction"] = grad_worker_count(opt.comm.world_size, placement.grad_worker_fraction)
        except ValueError:  # not one for this world size: the placement's own check names it
            settings["grad_worker_fraction"] = placement.grad_worker_fraction
        settings["assignment_strategy"] = placement.strategy
    for key, value in opt.defaults.items():
        settings[f"defaults.{key}"] = value
    for i, group in enumerate(opt.param_groups):  # a group's own lr, momentum, weight decay, ...
        settings[f"param_groups[{i}]"] = {k: v for k, v in sorted(group.items()) if k != "params"}
    for attr in SUBCLASS_ATTRIBUTES:  # set by SecondOrderOptimizer / VIOptimizer before the base's __init__
        if hasattr(opt, attr):
            settings[attr] = getattr(opt, attr)
    if hasattr(opt, "lm"):
        settings["adaptive_damping"] = opt.lm is not None
    device = _model_device(opt.model) if _nccl(opt.comm) else None
    check_same_settings(opt.comm, settings, type(opt).__name__, device)


#: the KFACPreconditioner arguments compared across ranks (taken from its constructor's locals)
KFAC_ARGUMENTS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr",
                  "accumulation_steps", "allreduce_bucket_cap_mb", "colocate_factors",
                  "compute_eigenvalue_outer_product", "symmetry_aware", "update_factors_in_hook",
                  "factor_dtype", "inv_dtype", "skip_layers")


def check_kfac_settings(comm: Any, arguments: Mapping[str, Any]) -> None:
    """:func:`check_same_settings` for a :class:`~torchsso2.kfac.KFACPreconditioner` under construction.

    Args:
        comm: its communicator.
        arguments: the constructor's ``locals()`` once the layers are registered: the
            arguments of :data:`KFAC_ARGUMENTS`, ``grad_worker_fraction`` (or its parsed
            ``fraction``), and ``self`` (its ``layers``: name -> factor sizes,
            ``assignment_strategy`` and ``compute_method``).
    """
    if comm.world_size <= 1:
        return
    settings: Dict[str, Any] = {k: arguments[k] for k in KFAC_ARGUMENTS if k in arguments}
    settings["grad_worker_fraction"] = arguments.get("fraction", arguments.get("grad_worker_fraction"))
    me = arguments.get("self")
    for attr in ("assignment_strategy", "compute_method"):
        settings[attr] = getattr(me, attr, arguments.get(attr))
    layers = getattr(me, "layers", {})
    settings["layers"] = {name: dict(getattr(layer, "sizes", {})) for name, layer in layers.items()}
    model = arguments.get("model")
    device = _model_device(model) if _nccl(comm) and model is not None else None
    check_same_settings(comm, settings, "KFACPreconditioner", device)


__all__ = ["check_kfac_settings", "check_optimizer_settings", "check_same_settings", "describe", "groups_digest",
           "sizes_digest", "sizes_row"]
