"""PyTorch Lightning's automatic optimization drives SecondOrderOptimizer and VIOptimizer.

Lightning calls ``optimizer.step(closure=closure)`` with a closure that runs ``training_step``,
zeroes the gradients, calls ``backward()`` and returns the loss alone (torch.optim's convention). A
LightningModule returning either optimizer from ``configure_optimizers`` must train exactly as the
same optimizer in a plain loop over the same batches: the parameters are compared bit for bit.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from torchsso2 import SecondOrderOptimizer, VIOptimizer

from optim_helpers import param_vec

pl = pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is not installed (pip install -e '.[test]')")

EPOCHS = 2
OPTIMIZERS = {
    "second_order": lambda m: SecondOrderOptimizer(m, lr=0.1, curv_update_interval=2, inv_update_interval=4, seed=5),
    "adaptive": lambda m: SecondOrderOptimizer(m, use_adaptive_learning_rate=True, use_adaptive_momentum=True,
                                               adaptive_damping=True, seed=5),
    "vi": lambda m: VIOptimizer(m, dataset_size=96, lr=0.1, seed=5),
    "vi-kfac": lambda m: VIOptimizer(m, dataset_size=96, approx="kfac", seed=5),
}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    return TensorDataset(x, (x @ torch.randn(6, 3, generator=g)).argmax(1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


class _Module(pl.LightningModule):
    def __init__(self, make, on_root: bool, skip_batch: int = -1) -> None:
        super().__init__()
        self.make, self.on_root, self.skip_batch = make, on_root, skip_batch
        self.net = _net()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return None if batch_idx == self.skip_batch else loss  # None: Lightning skips the batch

    def configure_optimizers(self):
        return self.make(self if self.on_root else self.net)


class _Wrapper(nn.Module):
    """The LightningModule's shape without Lightning: a root module around the net (adaptive mode takes
    its generic forward-mode path on it, its hand-written one on a bare nn.Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x):
        return self.net(x)


def _plain_loop(make, on_root: bool, with_targets: bool = False) -> torch.Tensor:
    root = _Wrapper()
    model = root if on_root else root.net
    opt = make(model)
    for _ in range(EPOCHS):
        for x, y in DataLoader(_data(), batch_size=32):
            def closure():
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                return loss
            opt.step(closure, **({"targets": y} if with_targets else {}))
    return param_vec(root.net)


@pytest.mark.parametrize("on_root", [True, False], ids=["built-on-the-lightning-module", "built-on-its-net"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lightning_automatic_optimization_equals_the_plain_loop(name, on_root):
    _fit_and_compare(name, on_root)


@pytest.mark.parametrize("name", ["second_order", "vi"])
def test_a_batch_lightning_skips_is_a_clear_error(name):
    """``training_step`` returning None (Lightning's skipped batch) is not supported: a TypeError that says so."""
    module = _Module(OPTIMIZERS[name], on_root=True, skip_batch=1)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*training_step. returned .None.")
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        with pytest.raises(TypeError, match="PyTorch Lightning's training_step returning None to skip a batch is not "
                                            "supported"):
            trainer.fit(module, DataLoader(_data(), batch_size=32))
    assert trainer.global_step == 1


def _fit_and_compare(name: str, on_root: bool) -> None:
    module = _Module(OPTIMIZERS[name], on_root)
    start = param_vec(module.net)
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")  # its advice on num_workers, logging
        warnings.filterwarnings("ignore", module="lightning_fabric")
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        trainer.fit(module, DataLoader(_data(), batch_size=32))
    assert trainer.global_step == EPOCHS * 3
    trained = param_vec(module.net)
    assert not torch.equal(trained, start)
    assert torch.equal(trained, _plain_loop(OPTIMIZERS[name], on_root))


def _trainer(max_epochs: int, **kwargs: Any) -> Any:
    return pl.Trainer(max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **{"enable_checkpointing": False, **kwargs})


def _quiet_fit(trainer: Any, module: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        warnings.filterwarnings("ignore", module="lightning_fabric")
        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        trainer.fit(module, DataLoader(_data(), batch_size=32), **kwargs)


@pytest.mark.parametrize("name", ["second_order", "vi", "vi-kfac"])
def test_resuming_from_a_lightning_checkpoint_is_bit_exact(name, tmp_path):
    """Lightning saves ``optimizer.state_dict()`` in its checkpoint and loads it on ``fit(ckpt_path=...)``:
    4 epochs straight equal 2 epochs, a checkpoint, and 2 more in a new Trainer and module."""
    from pytorch_lightning.callbacks import ModelCheckpoint
    straight = _Module(OPTIMIZERS[name], on_root=True)
    _quiet_fit(_trainer(4), straight)
    first = _Module(OPTIMIZERS[name], on_root=True)
    _quiet_fit(_trainer(2, enable_checkpointing=True,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)]), first)
    resumed = _Module(OPTIMIZERS[name], on_root=True)
    trainer = _trainer(4)
    _quiet_fit(trainer, resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.optimizers[0].num_steps == 4 * 3
    assert torch.equal(param_vec(resumed.net), param_vec(straight.net))
    assert not torch.equal(param_vec(resumed.net), param_vec(first.net))


class _WithTargets(_Module):
    """Passes the batch's targets to ``step`` (the Hessian, VI's learned noise, adaptive mode's LM forward)
    by overriding ``optimizer_step``."""

    def on_train_batch_start(self, batch, batch_idx):
        self._targets = batch[1]

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure, targets=self._targets)


@pytest.mark.parametrize("name", ["hessian", "adaptive"])
def test_targets_reach_step_through_optimizer_step(name):
    make = {"hessian": lambda m: SecondOrderOptimizer(m, lr=0.1, curvature="hessian", approx="diag", seed=5),
            "adaptive": OPTIMIZERS["adaptive"]}[name]
    module = _WithTargets(make, on_root=True)
    _quiet_fit(_trainer(EPOCHS), module)
    assert torch.equal(param_vec(module.net), _plain_loop(make, on_root=True, with_targets=True))


class _Preconditioned(pl.LightningModule):
    """kfac_pytorch's pattern under Lightning: SGD from configure_optimizers, KFACPreconditioner.step()
    in on_before_optimizer_step (after the backward, before SGD's update)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        from torchsso2.kfac import KFACPreconditioner
        self.precond = KFACPreconditioner(self.net, factor_update_steps=2, inv_update_steps=4)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.precond.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)


def test_kfac_preconditioner_in_on_before_optimizer_step_equals_the_plain_loop():
    from torchsso2.kfac import KFACPreconditioner
    module = _Preconditioned()
    _quiet_fit(_trainer(EPOCHS), module)
    trained = {}
    for preconditioned in (True, False):
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        precond = KFACPreconditioner(net, factor_update_steps=2, inv_update_steps=4) if preconditioned else None
        for _ in range(EPOCHS):
            for x, y in DataLoader(_data(), batch_size=32):
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                if precond is not None:
                    precond.step()
                opt.step()
        trained[preconditioned] = param_vec(net)
    assert module.precond.steps == EPOCHS * 3
    assert torch.equal(param_vec(module.net), trained[True])
    assert not torch.allclose(trained[True], trained[False])  # the preconditioner changed the steps
