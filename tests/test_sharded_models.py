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


def _fully_shard():
    """torch's ``fully_shard`` (``torch.distributed._composable.fsdp`` before torch 2.6)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _dtensor_api():
    """``(Replicate, distribute_tensor)`` (``torch.distributed._tensor`` before torch 2.5)."""
    try:
        from torch.distributed.tensor import Replicate, distribute_tensor
    except ImportError:
        from torch.distributed._tensor import Replicate, distribute_tensor
    return Replicate, distribute_tensor


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
    fully_shard = _fully_shard()

    model = _mlp()
    fully_shard(model[2])
    _refused(FACES[face], model, face, "module '2' is wrapped by fully_shard (FSDP2)")


@pytest.mark.parametrize("face", sorted(FACES))
def test_dtensor_parameters_are_refused(one_rank, face):
    """Tensor parallelism without FSDP: a layer's weight as a DTensor on a one-device mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    Replicate, distribute_tensor = _dtensor_api()

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
    Replicate, distribute_tensor = _dtensor_api()

    model = _mlp()
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        for name in ("weight", "bias"):
            setattr(layer, name, nn.Parameter(distribute_tensor(getattr(layer, name).detach(), mesh, [Replicate()])))
    assert sharding_of(model) == ("parameters 0.weight, 0.bias, 2.weight and 1 more are DTensors "
                                  "(sharded or tensor-parallel)")


STEPPING = {k: v for k, v in FACES.items() if k != "curvature.compute"}


def _one_step(face: str, opt, call) -> None:
    if face == "KFACPreconditioner":
        nn.functional.cross_entropy(call(X), Y).backward()
        opt.step()
        return

    def closure():
        opt.zero_grad()
        out = call(X)
        loss = nn.functional.cross_entropy(out, Y)
        loss.backward()
        return loss, out

    opt.step(closure)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("face", sorted(FACES))
def test_the_module_inside_an_fsdp_wrapper_is_refused(one_rank, face, use_orig_params):
    """Built on the user's own ``model`` after ``fsdp = FSDP(model)`` (the wrapper is its parent, so the model
    itself holds no FSDP class): VIOptimizer took the flat local shard as its only parameter and trained it
    without a word; the others blamed a module holding ``_flat_param`` or differing settings."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = _mlp()
    FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    _refused(FACES[face], model, face, "module '(the model)' is managed by FSDP")


@pytest.mark.parametrize("face", sorted(STEPPING))
def test_sharding_after_construction_fails_the_step_with_the_cause(one_rank, face):
    """``fully_shard`` applied after the optimizer was built: the step raised torch's "got mixed
    torch.Tensor and DTensor" or "the closure did not call backward()"; now a ValueError naming it."""
    fully_shard = _fully_shard()

    model = _mlp()
    opt = STEPPING[face](model)
    fully_shard(model)
    if face == "KFACPreconditioner" and torch.version.cuda and not torch.cuda.is_available():
        try:  # (the forward runs outside the preconditioner's step)
            model(X)
        except RuntimeError as err:  # a CUDA build of torch < 2.6 without a driver: FSDP2's forward needs one
            if "CUDA" in str(err):
                pytest.skip(f"fully_shard's forward on this CUDA build of torch needs a CUDA driver ({err})")
            raise
    with pytest.raises(ValueError, match=r"the model is sharded across processes now "
                                         r"\(module '\(the model\)' is wrapped by fully_shard \(FSDP2\)\)") as info:
        _one_step(face, opt, model)
    assert "DistributedDataParallel" in str(info.value)
    if face != "KFACPreconditioner":  # (which sees the re-created parameters before torch fails, at the factor step)
        assert info.value.__cause__ is not None and "step failed" in str(info.value)


@pytest.mark.parametrize("face", ["SecondOrderOptimizer", "VIOptimizer"])
def test_parameters_assigned_after_construction_fail_the_step_with_the_cause(face):
    """``load_state_dict(..., assign=True)`` after the optimizer was built re-creates the parameters: the step
    said "the closure did not call backward()" (the optimizer's parameters get no gradient)."""
    model = _mlp()
    opt = STEPPING[face](model)
    model.load_state_dict({k: v.clone() for k, v in _mlp().state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"step failed \(RuntimeError\) because 4 of the parameters "
                                         rf"{face} was built with are no longer the model's") as info:
        _one_step(face, opt, model)
    assert "did not call backward()" in str(info.value.__cause__)


@pytest.mark.parametrize("error", [KeyError("from the user's closure"), StopIteration(),
                                   torch.OutOfMemoryError("out of memory")])
def test_unrelated_step_errors_pass_through_unchanged(error):
    """The diagnosis changes nothing for a model that is unchanged, nor for an error of the closure's own on a
    model whose parameters were re-created (only "did not call backward()" is their symptom)."""
    for reassigned in (False, True):
        model = _mlp()
        opt = SecondOrderOptimizer(model, approx="kfac", lr=0.1)
        if reassigned:
            model.load_state_dict({k: v.clone() for k, v in _mlp().state_dict().items()}, assign=True)

        def closure():
            raise error

        with pytest.raises(type(error)):
            opt.step(closure)


def test_zero_redundancy_optimizer_beside_a_preconditioner_equals_plain_sgd(one_rank):
    """ZeroRedundancyOptimizer shards the optimizer state, not the parameters: a KFACPreconditioner (which only
    rewrites .grad) beside ZeRO over SGD gives SGD's steps exactly (docs/distributed.md)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    runs = []
    for zero in (False, True):
        model = nn.parallel.DistributedDataParallel(_mlp())
        pre = KFACPreconditioner(model)
        opt = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
               if zero else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), Y).backward()
            pre.step()
            opt.step()
        runs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], torch.cat(
        [p.detach().reshape(-1) for p in _mlp().parameters()]))
