"""Models sharded across processes (FSDP's FullyShardedDataParallel and fully_shard, DTensor
parameters) are refused at construction by every face with the fix, data parallelism
(curvature/sharded.py). Before, a step failed inside torch ("got mixed torch.Tensor and DTensor"),
FSDP with use_orig_params=True built SecondOrderOptimizer and then reported that the closure
"did not call backward()", and a flat FSDP parameter was blamed on a weight reparametrization.
One gloo process in this process (a world of one is enough to build the wrappers)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import curvature
from curvature.sharded import sharding_of
from optim_helpers import make_closure
from torchsso2 import KFACPreconditioner, SecondOrderOptimizer, VIOptimizer

if not dist.is_available():  # pragma: no cover - torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

X, Y = torch.randn(8, 4), torch.randint(0, 3, (8,))

FACES = {
    "SecondOrderOptimizer": lambda m: SecondOrderOptimizer(m, approx="kfac", lr=0.1),
    "VIOptimizer": lambda m: VIOptimizer(m, dataset_size=8),
    "KFACPreconditioner": lambda m: KFACPreconditioner(m),
    "curvature.compute": lambda m: curvature.compute(m, X, Y, approx="kfac"),
}
WHO = {"KFACPreconditioner": "KFACPreconditioner"}  # the others: "torchsso2"


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _refused(build, model: nn.Module, face: str, what: str) -> None:
    with pytest.raises(ValueError) as info:
        build(model)
    text = str(info.value)
    assert text.startswith(f"{WHO.get(face, 'torchsso2')} cannot use a model whose parameters are sharded"), text
    assert what in text and "DistributedDataParallel" in text and "docs/distributed.md" in text, text


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("face", sorted(FACES))
def test_fully_sharded_data_parallel_is_refused(one_rank, face, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    _refused(FACES[face], model, face, "module '(the model)' is wrapped by FullyShardedDataParallel")


@pytest.mark.parametrize("face", sorted(FACES))
def test_fully_shard_is_refused_where_only_a_submodule_is_sharded(one_rank, face):
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model[2])
    _refused(FACES[face], model, face, "module '2' is wrapped by fully_shard (FSDP2)")


@pytest.mark.parametrize("face", sorted(FACES))
def test_dtensor_parameters_are_refused(one_rank, face):
    """Tensor parallelism without FSDP: a layer's weight as a DTensor on a one-device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _mlp()
    mesh = init_device_mesh("cpu", (1,))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh, [Replicate()]))
    _refused(FACES[face], model, face, "parameters 0.weight are DTensors")


def test_plain_and_ddp_models_are_not_sharded_and_train(one_rank):
    """Data parallelism stays supported: DistributedDataParallel and a plain model pass the check
    and take a step."""
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    assert sharding_of(_mlp()) is None and sharding_of(ddp) is None
    opt = SecondOrderOptimizer(ddp, approx="kfac", lr=0.1)
    before = [p.detach().clone() for p in ddp.parameters()]

    opt.step(make_closure(opt, ddp, X, Y))
    assert any(not torch.equal(b, p) for b, p in zip(before, ddp.parameters()))


def test_many_dtensor_parameters_are_counted_not_listed(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _mlp()
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        for name in ("weight", "bias"):
            setattr(layer, name, nn.Parameter(distribute_tensor(getattr(layer, name).detach(), mesh, [Replicate()])))
    assert sharding_of(model) == ("parameters 0.weight, 0.bias, 2.weight and 1 more are DTensors "
                                  "(sharded or tensor-parallel)")
