"""``KFACPreconditioner``: a drop-in for kfac_pytorch's (KAISA) preconditioner.

Switch by changing the import::

    from torchsso2.kfac import KFACPreconditioner        # was: from kfac.preconditioner import ...

    preconditioner = KFACPreconditioner(model, lr=0.1, damping=0.003)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        preconditioner.step()        # rewrites p.grad of every registered layer
        optimizer.step()

The per-layer math comes from the curvature engine (:mod:`curvature.modules` for the
factors, :mod:`curvature.linalg` for the decompositions), scaled as kfac_pytorch scales it
(:mod:`torchsso2.kfac.factors`); distribution from :mod:`torchsso2.distributed`. See
``docs/kfac.md`` for the formulas, the cadence and the KAISA placement.
"""
from __future__ import annotations

import functools
import logging
import numbers
import warnings
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from curvature.linalg import Backend, get_backend
from torchsso2.distributed import Communicator, WorkAssignment, get_communicator
from torchsso2.distributed.consistency import check_kfac_settings

from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, parse_enum
from .hyperparams import Schedule, check_schedule, evaluate
from .kaisa import KAISAComm
from .kl_clip import kl_clip_scale
from .layer import KFACLayer, grad_scale_of
from .register import find_layers
from .state import HYPERPARAMS, layers_state, load_layers_state

logger = logging.getLogger(__name__)

__all__ = ["KFACPreconditioner"]


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _check_dtype(name: str, value: object, optional: bool) -> Optional[torch.dtype]:
    if value is None and optional:
        return None
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        expected = "a floating torch.dtype" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return value


class KFACPreconditioner:
    """K-FAC gradient preconditioner with KAISA distribution (kfac_pytorch's interface).

    Registers ``nn.Linear`` and ``nn.Conv2d`` leaf modules of ``model`` (see
    :func:`~torchsso2.kfac.register.find_layers`); hooks record layer inputs in the forward
    pass and output gradients in the user's backward pass (only in training mode, with grad
    enabled, on factor-update steps). :meth:`step` replaces ``p.grad`` of the registered
    layers by the KL-clipped preconditioned gradient; call it after ``loss.backward()``
    (after DDP has averaged gradients) and before ``optimizer.step()``.

    Args (names, defaults and meaning as kfac_pytorch):
        model: the model (may be wrapped in ``DistributedDataParallel``).
        factor_update_steps: steps between factor updates (int or callable of the step).
        inv_update_steps: steps between recomputing the decompositions (int or callable).
        damping: Tikhonov damping (float or callable), ``> 0``.
        factor_decay: running-average coefficient of the factors, in ``(0, 1]``.
        kl_clip: KL clipping parameter, ``> 0`` (``None``: no clipping).
        lr: learning rate used by the KL clip, ``>= 0``.
        accumulation_steps: forward/backward passes per optimization step.
        allreduce_bucket_cap_mb: all-reduce bucket size in MiB (``0``: one all-reduce per factor).
        assignment_strategy: ``COMPUTE`` (cost ``n³``) or ``MEMORY`` (``n²``) for balancing
            the decompositions over ranks.
        colocate_factors: decompose A and G of a layer on the same rank.
        compute_method: ``EIGEN`` or ``INVERSE``.
        compute_eigenvalue_outer_product: with ``EIGEN``, the G worker precomputes
            ``1/(λ_G λ_Aᵀ + damping)`` (needs ``colocate_factors=True``).
        grad_worker_fraction: fraction of ranks preconditioning each layer's gradient, in
            ``[0, 1]`` (``0`` means ``1/world_size``), or a :class:`DistributedStrategy`
            (``COMM_OPT`` = 1, ``MEM_OPT`` = 1/world_size, ``HYBRID_OPT`` = 0.5).
        symmetry_aware: communicate only the upper triangle of symmetric matrices.
        grad_scaler: AMP ``GradScaler`` (its ``get_scale()``) or a callable returning the
            loss scale; output gradients are divided by it before the G factor is formed.
        factor_dtype: dtype of the factors (``None``: the training dtype).
        inv_dtype: dtype of the stored decompositions.
        skip_layers: regexes; a module whose name or class name matches is not registered.
        update_factors_in_hook: fold factor batches into the running averages in the backward
            hook of the last micro-batch (``True``) or at the start of :meth:`step`.
        linalg: linear-algebra backend of the decompositions (``"torch"``, ``"cupy"``,
            ``"numpy"`` or a :class:`curvature.linalg.Backend`).
        communicator: ``"auto"``, ``"none"``, ``"torch"``, ``"mpi"`` or a ``Communicator``.
            Selecting MPI installs the process-wide fault handlers (an uncaught exception calls
            ``MPI_Abort``, a rank that exits tells the others; opt out with
            ``TORCHSSO2_ABORT_ON_EXCEPTION=0`` or ``get_communicator("mpi", abort_on_exception=False)``);
            collectives give up after ``TORCHSSO2_DIST_TIMEOUT`` s (60). The ranks' settings are
            compared at construction (``ValueError`` naming any that differ). See docs/distributed.md.
        loglevel: level of the registration / assignment log messages.

    Raises:
        ValueError / TypeError: a bad argument (the message names it and what was expected).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule = 1,
        inv_update_steps: Schedule = 1,
        damping: Schedule = 0.001,
        factor_decay: Schedule = 0.95,
        kl_clip: Optional[Schedule] = 0.001,
        lr: Schedule = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: Union[AssignmentStrategy, str] = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: Union[ComputeMethod, str] = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: Union[DistributedStrategy, float] = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Optional[Union[Any, Callable[[], float]]] = None,
        factor_dtype: Optional[torch.dtype] = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Optional[List[str]] = None,
        update_factors_in_hook: bool = True,
        linalg: Union[str, Backend] = "torch",
        communicator: Union[str, Communicator] = "auto",
        loglevel: int = logging.DEBUG,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, value in (("factor_update_steps", factor_update_steps), ("inv_update_steps", inv_update_steps),
                            ("damping", damping), ("factor_decay", factor_decay), ("kl_clip", kl_clip), ("lr", lr)):
            check_schedule(name, value)
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(f"accumulation_steps must be an int > 0, got {accumulation_steps!r}")
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be an int > 0, got {accumulation_steps!r}")
        if isinstance(allreduce_bucket_cap_mb, bool) or not isinstance(allreduce_bucket_cap_mb, numbers.Real):
            raise TypeError(f"allreduce_bucket_cap_mb must be a float >= 0, got {allreduce_bucket_cap_mb!r}")
        if not allreduce_bucket_cap_mb >= 0:
            raise ValueError(f"allreduce_bucket_cap_mb must be >= 0 (0: no bucketing), got {allreduce_bucket_cap_mb!r}")
        self.assignment_strategy = parse_enum(assignment_strategy, AssignmentStrategy, "assignment_strategy")
        self.compute_method = parse_enum(compute_method, ComputeMethod, "compute_method")
        self.colocate_factors = _check_bool("colocate_factors", colocate_factors)
        self.compute_eigenvalue_outer_product = _check_bool("compute_eigenvalue_outer_product",
                                                            compute_eigenvalue_outer_product)
        self.symmetry_aware = _check_bool("symmetry_aware", symmetry_aware)
        self.update_factors_in_hook = _check_bool("update_factors_in_hook", update_factors_in_hook)
        self.factor_dtype = _check_dtype("factor_dtype", factor_dtype, optional=True)
        self.inv_dtype = _check_dtype("inv_dtype", inv_dtype, optional=False)
        if grad_scaler is not None and not (callable(getattr(grad_scaler, "get_scale", None)) or callable(grad_scaler)):
            raise TypeError(f"grad_scaler must be a GradScaler, a callable returning the scale, or None; "
                            f"got {type(grad_scaler).__name__}")
        if grad_worker_fraction is DistributedStrategy.MEM_OPT and not self.colocate_factors:
            raise ValueError("grad_worker_fraction=DistributedStrategy.MEM_OPT (one grad worker per layer) "
                             "requires colocate_factors=True, got colocate_factors=False")
        if (self.compute_method is ComputeMethod.EIGEN and self.compute_eigenvalue_outer_product
                and not self.colocate_factors):
            raise ValueError("compute_eigenvalue_outer_product=True (with compute_method=EIGEN) needs "
                             "colocate_factors=True; set one of them to the other value")

        self.comm: Communicator = communicator if not isinstance(communicator, str) else get_communicator(communicator)
        if not isinstance(self.comm, Communicator):
            raise TypeError(f"communicator must be a backend name or a Communicator, got {type(communicator).__name__}")
        world = self.comm.world_size
        fraction = self._parse_fraction(grad_worker_fraction, world)
        self.backend = get_backend(linalg)
        self.grad_scaler = grad_scaler
        self.allreduce_bucket_cap_mb = float(allreduce_bucket_cap_mb)
        self.skip_layers = [] if skip_layers is None else skip_layers
        self.loglevel = loglevel

        prediv = self.compute_method is ComputeMethod.EIGEN and self.compute_eigenvalue_outer_product
        self.layers: Dict[str, KFACLayer] = {}
        for name, module, family in find_layers(model, self.skip_layers):
            layer = KFACLayer(name, module, family, self.compute_method, prediv, self.factor_dtype,
                              self.inv_dtype, self.backend)
            self.layers[name] = layer
            logger.log(loglevel, "Registered name=%r: %r", name, layer)
        if not self.layers:
            warnings.warn("KFACPreconditioner: the model has no nn.Linear / nn.Conv2d layer to precondition "
                          "(after skip_layers); step() will leave the gradients unchanged", stacklevel=2)
        self._by_module = {layer.module: layer for layer in self.layers.values()}
        check_kfac_settings(self.comm, locals())  # ranks agree on the schedule before any collective

        sizes = {name: dict(layer.sizes) for name, layer in self.layers.items()}
        self.assignment = WorkAssignment.from_sizes(sizes, world, fraction, self.assignment_strategy,
                                                    self.colocate_factors)
        self.grad_worker_fraction = self.assignment.grad_worker_fraction
        g = self.assignment.grad_workers_per_layer
        self.distributed_strategy = (DistributedStrategy.COMM_OPT if g == world else
                                     DistributedStrategy.MEM_OPT if g == 1 else DistributedStrategy.HYBRID_OPT)
        logger.log(loglevel, "K-FAC layer assignment:\n%s", self.assignment.summary())
        self._kaisa = KAISAComm(self.comm, self.assignment, self.allreduce_bucket_cap_mb, self.symmetry_aware)

        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self._accumulation_steps = accumulation_steps
        if (not callable(factor_update_steps) and not callable(inv_update_steps)
                and inv_update_steps % factor_update_steps != 0):
            warnings.warn("It is suggested that inv_update_steps be an integer multiple of factor_update_steps "
                          f"(got {inv_update_steps} and {factor_update_steps})", stacklevel=2)
        self._steps = 0
        self._mini_steps: Dict[str, int] = defaultdict(int)
        self._updated: set = set()
        self._handles = [layer.module.register_forward_hook(self._forward_hook) for layer in self.layers.values()]

    @staticmethod
    def _parse_fraction(value: Union[DistributedStrategy, float], world: int) -> Union[DistributedStrategy, float]:
        if isinstance(value, DistributedStrategy):
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"grad_worker_fraction must be a DistributedStrategy or a float in [0, 1], "
                            f"got {type(value).__name__} {value!r}")
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"grad_worker_fraction must be in [0, 1] (0 means 1/world_size), got {value!r}")
        return 1.0 / world if float(value) == 0.0 else float(value)

    # ---- hyper-parameters at the current step ---------------------------------------------
    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._steps

    @property
    def factor_update_steps(self) -> int:
        return int(evaluate("factor_update_steps", self._factor_update_steps, self._steps))

    @property
    def inv_update_steps(self) -> int:
        return int(evaluate("inv_update_steps", self._inv_update_steps, self._steps))

    @property
    def damping(self) -> float:
        return evaluate("damping", self._damping, self._steps)

    @property
    def factor_decay(self) -> float:
        return evaluate("factor_decay", self._factor_decay, self._steps)

    @property
    def kl_clip(self) -> Optional[float]:
        return None if self._kl_clip is None else evaluate("kl_clip", self._kl_clip, self._steps)

    @property
    def lr(self) -> float:
        return evaluate("lr", self._lr, self._steps)

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    # ---- hooks ------------------------------------------------------------------------------
    def _forward_hook(self, module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        if self._steps % self.factor_update_steps != 0:
            return
        layer = self._by_module[module]
        self._mini_steps[layer.name] += 1
        saved = tuple(i.detach() if isinstance(i, Tensor) else i for i in inputs)
        output.register_hook(functools.partial(self._grad_hook, layer, saved, self._mini_steps[layer.name]))

    def _grad_hook(self, layer: KFACLayer, inputs: Tuple[Any, ...], mini_step: int, grad: Tensor) -> None:
        with torch.no_grad():
            layer.accumulate(inputs, grad.detach(), grad_scale_of(self.grad_scaler))
            if self.update_factors_in_hook and mini_step % self._accumulation_steps == 0:
                if layer.update_factors(self.factor_decay):
                    self._updated.add(layer.name)

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model (the hooks are removed)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place (then call ``optimizer.step()``).

        Gradients must already be averaged over ranks (``DistributedDataParallel`` does it in
        ``backward``). Every rank must call it.
        """
        layers = list(self.layers.values())
        if not self.update_factors_in_hook and self._steps % self.factor_update_steps == 0:
            decay = self.factor_decay
            for layer in layers:
                if layer.update_factors(decay):
                    self._updated.add(layer.name)
        self._kaisa.allreduce_factors([layer for layer in layers if layer.name in self._updated])
        self._updated.clear()

        if self._steps % self.inv_update_steps == 0:
            damping = self.damping
            for layer in layers:
                if layer.has_factors():
                    self._kaisa.compute_and_share_inverses(layer, damping)

        active = [layer for layer in layers if layer.inv_ready and layer.has_grad()]
        if self.grad_scaler is not None and not all(
                bool(torch.isfinite(p.grad).all()) for layer in active for p in layer.params):
            logger.warning("K-FAC step %d: non-finite gradients (AMP overflow), gradients left unpreconditioned",
                           self._steps)
            active = []
        damping = self.damping
        results: List[Tuple[KFACLayer, Tensor, Tensor]] = []
        for layer in active:
            grad = layer.grad_matrix()
            if self._kaisa.is_grad_worker(layer):
                precond = layer.precondition(grad, damping)
            else:
                precond = torch.empty_like(grad)
            self._kaisa.share_gradient(layer, precond)
            results.append((layer, precond, grad))
        kl_clip = self.kl_clip
        scale = None if kl_clip is None else kl_clip_scale([(p, g) for _, p, g in results], self.lr, kl_clip)
        for layer, precond, _ in results:
            layer.set_grad(precond, scale)
        self._steps += 1
        self._mini_steps.clear()

    def reset_batch(self) -> None:
        """Drop the factor batches collected since the last update."""
        for layer in self.layers.values():
            layer.reset_batch()

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True) -> Dict[str, Any]:
        """kfac_pytorch's state: ``steps``, the non-callable hyper-parameters and (optionally) factors."""
        state: Dict[str, Any] = {"steps": self._steps}
        for name in HYPERPARAMS:
            value = getattr(self, f"_{name}")
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = layers_state(list(self.layers.values()))
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict`; with ``compute_inverses`` the decompositions are recomputed
        from the loaded factors (every rank must call it then)."""
        if not isinstance(state_dict, dict) or "steps" not in state_dict:
            raise ValueError("state_dict must be a dict from KFACPreconditioner.state_dict() (with a 'steps' key)")
        self._steps = int(state_dict["steps"])
        for name in HYPERPARAMS:
            if name in state_dict:
                setattr(self, f"_{name}", state_dict[name])
        if "layers" in state_dict:
            load_layers_state(list(self.layers.values()), state_dict["layers"])
        elif compute_inverses:
            warnings.warn("Layer factors are not included in the state_dict so inverses cannot be computed; "
                          "skipping inverse computation", stacklevel=2)
            compute_inverses = False
        self.reset_batch()
        self._mini_steps.clear()
        self._updated.clear()
        if compute_inverses:
            damping = self.damping
            for layer in self.layers.values():
                if layer.has_factors():
                    self._kaisa.compute_and_share_inverses(layer, damping)

    def memory_usage(self) -> Dict[str, int]:
        """Bytes of K-FAC state on this rank: factors, factor batches, decompositions and ``total``."""
        sizes: Dict[str, int] = defaultdict(int)
        for layer in self.layers.values():
            for key, n in layer.memory_usage().items():
                sizes[key] += n
        sizes["total"] = sum(sizes.values())
        return dict(sizes)

    def __repr__(self) -> str:
        params = {
            "accumulation_steps": self._accumulation_steps, "allreduce_bucket_cap_mb": self.allreduce_bucket_cap_mb,
            "assignment_strategy": self.assignment_strategy, "colocate_factors": self.colocate_factors,
            "compute_eigenvalue_outer_product": self.compute_eigenvalue_outer_product,
            "compute_method": self.compute_method, "damping": self._damping,
            "distributed_strategy": self.distributed_strategy, "factor_decay": self._factor_decay,
            "factor_dtype": self.factor_dtype, "factor_update_steps": self._factor_update_steps,
            "grad_scaler": self.grad_scaler is not None, "grad_worker_fraction": self.grad_worker_fraction,
            "inv_dtype": self.inv_dtype, "inv_update_steps": self._inv_update_steps, "kl_clip": self._kl_clip,
            "layers": len(self.layers), "lr": self._lr, "skip_layers": self.skip_layers, "steps": self._steps,
            "symmetry_aware": self.symmetry_aware, "update_factors_in_hook": self.update_factors_in_hook,
            "world_size": self.comm.world_size,
        }
        body = "\n".join(f"  {k}={v}," for k, v in sorted(params.items()))
        return f"{type(self).__name__}(\n{body}\n)"
