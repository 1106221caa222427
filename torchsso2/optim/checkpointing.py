"""How a native optimizer is saved and loaded: ``state_dict`` adds the curvature, the random streams
and the counters to torch.optim's dict; ``load_state_dict`` checks the whole checkpoint first
(:mod:`torchsso2.optim.checkpoint`) and loads all or nothing. Mixin of
:class:`~torchsso2.optim.base.CurvatureOptimizer`, before ``torch.optim.Optimizer`` in its bases."""
from __future__ import annotations

import contextlib
import zlib
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List

import torch

from curvature.blocks import KFACBlock

from ..distributed.assignment import grad_worker_count
from .checkpoint import check_checkpoint
from .grid import rank_seed
from .skips import SkipStreak

__all__ = ["CheckpointState"]


@contextlib.contextmanager
def _hooks_held(opt: torch.optim.Optimizer, attr: str) -> Iterator["OrderedDict[int, Callable]"]:
    """``opt.<attr>`` (a dict of torch.optim hooks) emptied for the block, so that a call of
    torch.optim's method inside runs none of them; yields the hooks, put back after the block."""
    hooks = getattr(opt, attr)
    setattr(opt, attr, OrderedDict())
    try:
        yield hooks
    finally:
        setattr(opt, attr, hooks)


class CheckpointState:
    """``state_dict`` / ``load_state_dict`` of a native optimizer and the hooks of its face's own entries."""

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s ``{"state", "param_groups"}`` plus ``"torchsso2"`` (curvature, streams,
        counters); the state-dict post-hooks see (and may replace) the whole dict."""
        self._check_attrs()  # a value set since the last step (opt.damping = "0.1") is named, not a raw TypeError
        with _hooks_held(self, "_optimizer_state_dict_post_hooks") as post_hooks:
            sd = super().state_dict()
        sd["torchsso2"] = {
            "curvature": self.running.state_dict(),
            "generator": self.generator.get_state(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "consecutive_skips": self._streak.count,
            "num_amp_skipped": self.num_amp_skipped,
            "decomposed": self._decomposed,
            "seed": self.seed,
            "saved_on_rank": self.comm.rank,  # whose label stream "generator" is
            "optimizer": self.face_name,
            "loss": self.engine.loss.value,
            "curvature_kind": self._curvature_name(),
            "covered": {n: list(lay.param_names) for n, lay in self.engine.layouts.items()},
            "param_shapes": self._param_shapes(),
            "extra": self._extra_state(),
        }
        for hook in post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def _curvature_name(self) -> str:
        """The ``curvature=`` kind the running statistics are estimated with (saved, compared at load)."""
        return self.engine.kind.value

    def _param_shapes(self) -> List[List[int]]:
        return [list(p.shape) for g in self.param_groups for p in g["params"]]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint of this optimizer; all or nothing.

        The whole checkpoint is checked first (:func:`torchsso2.optim.checkpoint.check_checkpoint`:
        kind of optimizer, every tensor's shape against this model, finiteness, counters) and a bad
        one is refused with a ``ValueError`` naming the entry, before anything changes. Floating
        tensors are cast to the parameters' dtype and device (as ``torch.optim`` does); the loaded
        state tensors are copies (the optimizer never writes into ``state_dict``)."""
        if isinstance(state_dict, dict):  # shallow copy, as torch.optim; the pre-hooks see the whole dict
            state_dict = dict(state_dict)
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        checked = check_checkpoint(self, state_dict)
        saved_attrs = dict(self.__dict__)
        had_differentiable = "differentiable" in self.defaults
        saved_running = (self.running.blocks, self.running.num_updates)
        saved_generator = self.generator.get_state()
        saved_extra = self._extra_snapshot()
        try:
            # the pre-hooks ran above; the post-hooks run below, once everything is loaded
            with _hooks_held(self, "_optimizer_load_state_dict_pre_hooks"), \
                    _hooks_held(self, "_optimizer_load_state_dict_post_hooks"):
                super().load_state_dict(checked.optimizer_state)
            # torch's __setstate__ (which load_state_dict calls) adds defaults["differentiable"] = False, and
            # add_param_group copies every default into a new group, whose checks refuse that torch-only key
            if not had_differentiable:
                self.defaults.pop("differentiable", None)
            self.running.blocks = checked.blocks
            self.running.num_updates = checked.num_updates
            self.generator.set_state(checked.generator)
            self.num_steps = checked.num_steps
            self.num_skipped = checked.num_skipped
            self._streak = SkipStreak(self._streak.limit)  # a new object: the except branch restores the old one
            self._streak.count = checked.consecutive_skips
            self.num_amp_skipped = checked.num_amp_skipped
            self._decomposed = checked.decomposed
            self.seed = int(checked.seed) if checked.seed is not None else self.seed
            if self.placement.active and grad_worker_count(self.comm.world_size, self.placement.grad_worker_fraction) \
                    < self.comm.world_size:  # [issue #7] the saving rank lacks some decompositions: redo them
                self._decomposed = False  # (with every rank a grad worker, the saved ones are every rank's)
            if self.comm.rank != checked.saved_on_rank:  # another rank's label stream (rank 0's, loaded on every
                # rank): draw independently of it; a rank's own checkpoint continues its stream exactly
                self.generator.manual_seed(rank_seed(zlib.crc32(checked.generator.numpy().tobytes()), self.comm.rank))
            if any(isinstance(b, KFACBlock) and b.decomposition is not None
                   and b.decomposition.get("method") != self.kfac_method for b in self.running.blocks.values()):
                self._decomposed = False  # saved with the other kfac_method: decompose again at the next step
            if any(b.decomposition is None for b in self.running.blocks.values()):
                self._decomposed = False
            self._load_extra_state(checked.extra)
            #: a posterior loaded without (all) its decompositions: VIOptimizer redoes them before its next noise
            #: (not when the saving optimizer had none either, a failed first decomposition: its next step
            #: decomposes, and a second attempt before it would count a second skip)
            self._loaded_undecomposed = checked.decomposed and not self._decomposed and self.running.num_updates > 0
        except BaseException:  # not expected after the checks; the optimizer is left as it was anyway
            self.__dict__.clear()
            self.__dict__.update(saved_attrs)
            self.running.blocks, self.running.num_updates = saved_running
            self.generator.set_state(saved_generator)
            self._restore_extra(saved_extra)
            raise
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    #: the kind of optimizer a checkpoint is tagged with (a checkpoint loads only into the same kind)
    face_name = "CurvatureOptimizer"
    #: what the groups' ``lr`` means: ``"native"``, or ``"pytorch-sso"`` for the compat classes, whose
    #: updates apply it times a scale (:mod:`torchsso2.compat.pytorch_sso`); a checkpoint of theirs with a
    #: scale other than 1 is refused by the native classes (:func:`torchsso2.optim.checkpoint.check_checkpoint`)
    groups_lr = "native"

    def _check_extra_state(self, state: Dict[str, Any]) -> None:
        """Check the face's own checkpoint entries (ValueError naming the entry)."""

    def _extra_snapshot(self) -> Any:
        """What :meth:`_load_extra_state` may change in place (restored if loading fails)."""
        return None

    def _restore_extra(self, snapshot: Any) -> None:
        pass

    def _extra_state(self) -> Dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        pass
