"""Fixes of the examples audit: partial gradient-accumulation groups, the colocate flag, numbers for
work that never ran, options silently ignored, and bad arguments that ended in tracebacks.

Everything runs in-process on tiny sizes (argparse errors are ``SystemExit`` with the message on
stderr); the whole file takes a few seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("sklearn", reason='the examples need scikit-learn (pip install -e ".[examples]")')

from benchmarks import adaptive_step_cost, kfac_adaptive, vi_kfac_intervals  # noqa: E402
from examples import bayesian_digits, common, resnet, train_digits  # noqa: E402
from examples import train_transformer as tt  # noqa: E402

#: a ResNet run of a few milliseconds per batch: 3 loader batches of 8 images
TINY_RESNET = ["--synthetic", "--width", "4", "--depths", "1,1", "--image-size", "8", "--num-classes", "4",
               "--batch-size", "8", "--steps-per-epoch", "3", "--threads", "1"]


def cifar_args(argv: Sequence[str]) -> argparse.Namespace:
    """examples/cifar10_resnet.py's command line."""
    return resnet.build_parser("cifar", 32, 10, 64, 128, 0.1).parse_args(list(argv))


def imagenet_args(argv: Sequence[str]) -> argparse.Namespace:
    """examples/imagenet_resnet.py's command line."""
    return resnet.build_parser("imagenet", 224, 1000, 64, 32, 0.1).parse_args(list(argv))


def transformer_args(argv: Sequence[str]) -> argparse.Namespace:
    """examples/train_transformer.py's command line (tying off: no start-up check)."""
    return tt.parse_args(list(argv), tie_default=False)


#: each program's command-line parser, looked up when called
PARSERS: Dict[str, Callable[[List[str]], object]] = {
    "train_digits": lambda argv: train_digits.parse_args(argv),
    "bayesian_digits": lambda argv: bayesian_digits.parse_args(argv),
    "train_transformer": transformer_args,
    "cifar10_resnet": cifar_args,
    "imagenet_resnet": imagenet_args,
    "adaptive_step_cost": lambda argv: adaptive_step_cost.parse_args(argv),
    "vi_kfac_intervals": lambda argv: vi_kfac_intervals.parse_args(argv),
}


def assert_usage_error(program: str, argv: List[str], option: str, capsys: pytest.CaptureFixture) -> str:
    """``program``'s parser ends in an argparse error (exit status 2) on ``argv``, its message naming ``option``."""
    with pytest.raises(SystemExit) as info:
        PARSERS[program](argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and option in err, err
    return err


def assert_type_error(program: str, option: str, value: str, capsys: pytest.CaptureFixture) -> None:
    """``option value`` is refused by the option's argparse type: the message names that option
    alone and the value given (``argument --lr: expected a number > 0, got '-1'``)."""
    err = assert_usage_error(program, [option, value], option, capsys)
    assert f"argument {option}: expected " in err and f"got {value!r}" in err, err


# --------------------------------------------------------------------------------------------
# 5. bad arguments: argparse errors naming the option, before any work
# --------------------------------------------------------------------------------------------
BAD_VALUES = [
    *[("train_digits", opt, value) for opt, value in (
        ("--lr", "-1"), ("--damping", "-1"), ("--momentum", "1.5"), ("--curv-update-interval", "0"),
        ("--threads", "-1"), ("--hidden", "0"), ("--epochs", "0"), ("--epochs", "-1"), ("--batch-size", "0"))],
    *[("bayesian_digits", opt, value) for opt, value in (
        ("--n-bins", "0"), ("--vi-lr", "-1"), ("--ema-decay", "1.5"), ("--prior-precision", "0"),
        ("--train-mc-samples", "0"), ("--mc-samples", "0"), ("--epochs", "0"))],
    *[("train_transformer", opt, value) for opt, value in (
        ("--train-chars", "0"), ("--lr", "-1"), ("--steps-per-epoch", "-1"), ("--epochs", "0"),
        ("--batch-size", "0"))],
    *[(program, opt, value) for program in ("cifar10_resnet", "imagenet_resnet") for opt, value in (
        ("--depths", "a"), ("--depths", "2,0"), ("--batch-size", "0"), ("--width", "0"), ("--num-classes", "0"),
        ("--image-size", "0"), ("--steps-per-epoch", "-1"), ("--epochs", "0"))],
    *[("adaptive_step_cost", opt, value) for opt, value in (("--rounds", "0"), ("--steps", "0"))],
]


@pytest.mark.parametrize("program,option,value", BAD_VALUES, ids=[f"{p}:{o}={v}" for p, o, v in BAD_VALUES])
def test_bad_values_are_argparse_errors_naming_the_option(program, option, value, capsys) -> None:
    assert_type_error(program, option, value, capsys)


def test_train_text_shorter_than_one_window_is_an_argparse_error(capsys) -> None:
    err = assert_usage_error("train_transformer", ["--train-chars", "10", "--seq-len", "16"], "--train-chars", capsys)
    assert "shorter than one window" in err


def test_zero_stays_allowed_where_it_means_something() -> None:
    args = cifar_args(["--synthetic", "--steps-per-epoch", "0", "--threads", "0", "--kfac-inv-update-steps", "0"])
    assert (args.steps_per_epoch, args.threads, args.kfac_inv_update_steps) == (0, 0, 0)
    assert args.depths == (2, 2, 2, 2)  # the default string goes through the type too
    assert transformer_args(["--steps-per-epoch", "0"]).steps_per_epoch == 0
    assert train_digits.parse_args(["--threads", "0", "--momentum", "0"]).threads == 0


def test_vi_kfac_intervals_bad_variant_lists_the_valid_names(capsys) -> None:
    err = assert_usage_error("vi_kfac_intervals", ["--variants", "1/1", "foo"], "--variants", capsys)
    assert "'k/m' or 'k/m/decay'" in err and all(v in err for v in vi_kfac_intervals.DEFAULT_VARIANTS), err
    assert vi_kfac_intervals.parse_args(["--variants", "1/1", "10/100/pow", "5/5/0.9"]).variants == [
        "1/1", "10/100/pow", "5/5/0.9"]


# --------------------------------------------------------------------------------------------
# 1. an epoch's last, short accumulation group gets the mean gradient over its own micro-batches
# --------------------------------------------------------------------------------------------
def _grads_entering_preconditioner(monkeypatch: pytest.MonkeyPatch, k: int) -> List[torch.Tensor]:
    """The flat gradient handed to each ``KFACPreconditioner.step()`` of a 3-batch epoch with
    ``--batches-per-allreduce k`` at lr 0 (the weights never move, so the runs see the same model)."""
    from torchsso2.kfac.preconditioner import KFACPreconditioner

    grads: List[torch.Tensor] = []
    original = KFACPreconditioner.step

    def recording_step(self: KFACPreconditioner) -> None:
        grads.append(torch.cat([p.grad.reshape(-1).clone() for layer in self.layers.values() for p in layer.params]))
        original(self)

    args = cifar_args([*TINY_RESNET, "--lr", "0", "--momentum", "0", "--weight-decay", "0",
                       "--kfac-factor-update-steps", "1", "--kfac-inv-update-steps", "1",
                       "--batches-per-allreduce", str(k)])
    with monkeypatch.context() as patch:
        patch.setattr(KFACPreconditioner, "step", recording_step)
        resnet.run(args, "cifar", None)
    return grads


def test_short_last_group_is_averaged_over_its_own_micro_batches(monkeypatch, capsys) -> None:
    one = _grads_entering_preconditioner(monkeypatch, 1)
    out_one = capsys.readouterr().out
    two = _grads_entering_preconditioner(monkeypatch, 2)
    out_two = capsys.readouterr().out
    assert len(one) == 3 and len(two) == 2
    # the full group: the mean of batches 1 and 2; the short last group: batch 3 alone, not half of it
    torch.testing.assert_close(two[0], (one[0] + one[1]) / 2, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(two[1], one[2], rtol=1e-4, atol=1e-6)
    # the epoch line counts optimizer steps, and names the loader batches separately
    assert "(3 optimizer steps, 3 batches)" in out_one, out_one
    assert "(2 optimizer steps, 3 batches)" in out_two and "K-FAC steps so far 2" in out_two, out_two


def test_group_sizes_and_the_steps_per_epoch_help() -> None:
    assert [resnet.group_size(s, 3, 2) for s in range(3)] == [2, 2, 1]
    assert [resnet.group_size(s, 7, 3) for s in range(7)] == [3, 3, 3, 3, 3, 3, 1]
    help_text = " ".join(resnet.build_parser("x", 32, 10, 64, 128, 0.1).format_help().split())
    assert "cap on the loader batches (micro-batches) per epoch, not on optimizer steps" in help_text


# --------------------------------------------------------------------------------------------
# 2. --no-kfac-colocate-factors builds a working preconditioner with the default EIGEN method
# --------------------------------------------------------------------------------------------
def test_no_colocate_factors_builds_a_working_eigen_preconditioner() -> None:
    from examples.kfac_options import make_kfac
    from torchsso2.distributed import get_communicator
    from torchsso2.kfac import ComputeMethod

    args = cifar_args(["--synthetic", "--no-kfac-colocate-factors", "--kfac-factor-update-steps", "1",
                       "--kfac-inv-update-steps", "1"])
    torch.manual_seed(0)
    model = resnet.ResNet((1,), 4, 3, "cifar")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre, _, _ = make_kfac(model, opt, args, 1, get_communicator("none"))
    assert pre is not None and pre.compute_method is ComputeMethod.EIGEN
    assert not pre.colocate_factors and not pre.compute_eigenvalue_outer_product
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 2, 0])).backward()
    pre.step()
    assert pre.steps == 1 and all(torch.isfinite(p.grad).all() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# 3. no numbers for work that never ran; strict JSON; the train loss over every rank's shard
# --------------------------------------------------------------------------------------------
def test_transformer_json_is_strict_without_a_train_loss_before_training(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tt, "tying_supported", lambda: False)
    out = tmp_path / "t.json"
    assert tt.main(["--optimizer", "adamw", "--epochs", "1", "--steps-per-epoch", "1", "--train-chars", "400",
                    "--val-chars", "100", "--seq-len", "8", "--batch-size", "4", "--d-model", "8", "--heads", "2",
                    "--layers", "1", "--no-progress", "--json", str(out)]) == 0

    def no_constants(name: str) -> None:
        raise ValueError(f"non-standard JSON constant {name}")

    report = json.loads(out.read_text(), parse_constant=no_constants)
    history = report["results"][0]["history"]
    assert history[0]["epoch"] == 0 and history[0]["train_loss"] is None
    assert history[1]["train_loss"] > 0


def test_write_json_turns_non_finite_numbers_into_null(tmp_path) -> None:
    path = tmp_path / "sub" / "x.json"
    common.write_json(path, {"a": float("nan"), "b": [1.0, float("inf")], "c": (2, -float("inf"))})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": [2, None]}


class _TwoRanks:
    """A communicator of rank 0 of 2 whose other rank adds ``other`` (its loss sum and example count)."""

    world_size, rank = 2, 0

    def __init__(self, other: Sequence[float]) -> None:
        self.other = torch.tensor(other, dtype=torch.float64)
        self.mine: List[float] = []

    def allreduce(self, tensors: List[torch.Tensor], op: str = "mean") -> None:
        assert op == "sum" and len(tensors) == 1
        self.mine = tensors[0].tolist()
        tensors[0].add_(self.other)


def test_train_epoch_averages_the_loss_over_every_rank_shard() -> None:
    torch.manual_seed(0)
    data = common.load_digits_data()
    model = common.make_model("mlp", (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.comm = _TwoRanks([1000.0, 672.0])  # the other rank's shard: 672 examples, loss sum 1000
    loss = common.train_epoch(model, opt, data.x_train, data.y_train, 32, torch.Generator().manual_seed(0))
    mine_total, mine_count = opt.comm.mine
    assert mine_count == 672  # 42 batches of 32, this rank's half of each
    assert loss == pytest.approx((mine_total + 1000.0) / (mine_count + 672.0))


# --------------------------------------------------------------------------------------------
# 4. options that would be ignored are errors; --quick keeps explicit values
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("program,argv,option", [
    ("train_digits", ["--optimizer", "sso-diag", "--kfac-method", "eigen"], "--kfac-method"),
    ("train_digits", ["--optimizer", "sgd", "--damping", "0.1"], "--damping"),
    ("train_digits", ["--optimizer", "adam", "--momentum", "0.5"], "--momentum"),
    ("train_digits", ["--model", "cnn", "--hidden", "32"], "--hidden"),
    ("train_transformer", ["--optimizer", "sso-kfac", "--weight-decay", "0.1"], "--weight-decay"),
    ("train_transformer", ["--optimizer", "vi-diag", "sso-kfac", "--weight-decay", "5"], "--weight-decay"),
])
def test_options_that_would_be_ignored_are_errors(program, argv, option, capsys) -> None:
    err = assert_usage_error(program, argv, option, capsys)
    assert "applies to" in err


def test_applicable_options_still_parse() -> None:
    assert train_digits.parse_args(["--optimizer", "sso-kfac-eigen", "--kfac-method", "inverse"]).kfac_method \
        == "inverse"
    assert train_digits.parse_args(["--model", "mlp", "--hidden", "32", "16"]).hidden == [32, 16]
    assert transformer_args(["--optimizer", "adamw", "sso-kfac", "--weight-decay", "0.1"]).weight_decay == 0.1
    assert transformer_args(["--optimizer", "sso-kfac"]).weight_decay is None


def test_cnn_json_records_no_hidden_sizes(tmp_path) -> None:
    out = tmp_path / "cnn.json"
    assert train_digits.main(["--optimizer", "sgd", "--model", "cnn", "--epochs", "1", "--no-progress",
                              "--json", str(out)]) == 0
    assert json.loads(out.read_text())["hidden"] is None


def test_kfac_adaptive_quick_fills_only_what_was_not_given() -> None:
    explicit = kfac_adaptive.parse_args(["--quick", "--dampings", "0.5", "--seeds", "7", "--batch-sizes", "64",
                                         "--repeats", "3", "--max-epochs", "4", "--damping-decays", "0.9"])
    assert (explicit.dampings, explicit.seeds, explicit.batch_sizes, explicit.repeats, explicit.max_epochs,
            explicit.damping_decays) == ([0.5], [7], [64], 3, 4, [0.9])
    quick = kfac_adaptive.parse_args(["--quick", "--dampings", "0.5"])
    assert (quick.dampings, quick.seeds, quick.batch_sizes, quick.repeats, quick.max_epochs) == (
        [0.5], [0], [128], 2, 2)
    full = kfac_adaptive.parse_args([])
    assert (full.dampings, full.seeds, full.batch_sizes, full.repeats, full.max_epochs) == (
        [1e-3, 1e-2, 1e-1], [0, 1, 2], [512, 128], 15, 30)


def test_results_for_a_path_that_cannot_be_written_are_kept_in_a_temporary_file(tmp_path, monkeypatch):
    """A --json under a regular file crashed with a raw FileExistsError after the whole run: the results were lost."""
    import re
    import tempfile

    from benchmarks.common import write_json
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=r"could not write .*afile/out\.json .*the results are kept in") as err:
        write_json(blocker / "out.json", {"value": 1})
    kept = re.search(r"kept in (\S+)$", str(err.value)).group(1)
    assert '"value": 1' in open(kept, encoding="utf-8").read()
