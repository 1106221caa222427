"""Small things a newcomer hits: install hints, --help defaults, output folders, progress bars,
rank counts and log volume of a diverged run."""
from __future__ import annotations

import argparse
import builtins
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.reporting import worth_reporting

ROOT = Path(__file__).resolve().parents[1]


def test_missing_mpi4py_names_installable_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchsso2.distributed import mpi_backend

    real_import = builtins.__import__

    def no_mpi(name, *a, **k):
        if name.startswith("mpi4py"):
            raise ImportError("No module named 'mpi4py'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpi)
    with pytest.raises(ImportError) as info:
        mpi_backend.import_mpi()
    msg = str(info.value)
    assert "pip install mpi4py mpich" in msg and "torchsso2[mpi]" not in msg  # not on the registry


def test_no_install_hint_names_a_torchsso2_extra_from_the_registry() -> None:
    for path in [*ROOT.glob("torchsso2/**/*.py"), *ROOT.glob("curvature/**/*.py"), ROOT / "docs" / "distributed.md"]:
        assert "pip install torchsso2[" not in path.read_text(encoding="utf-8"), path


def test_resnet_examples_help_shows_every_default() -> None:
    sys.path.insert(0, str(ROOT))
    from examples import resnet

    p = resnet.build_parser("x", 32, 10, 64, 128, 0.1)
    assert isinstance(p.formatter_class, type) and issubclass(p.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    missing = [a.dest for a in p._actions if a.help is None and a.option_strings and a.default is not None]
    assert not missing, f"options whose default --help does not show: {missing}"
    text = p.format_help()
    assert "training epochs (default: 1)" in " ".join(text.split())


def test_bayesian_digits_writes_outside_the_working_directory() -> None:
    pytest.importorskip("sklearn")
    from examples import bayesian_digits

    out = bayesian_digits.parse_args([]).out_dir
    assert out.is_absolute() and Path.cwd().resolve() not in out.resolve().parents
    assert "bayesian_digits_out/" in (ROOT / ".gitignore").read_text(encoding="utf-8")


def test_progress_bar_is_off_when_stderr_is_not_a_terminal() -> None:
    pytest.importorskip("tqdm")
    from examples.common import progress_bar

    assert not sys.stderr.isatty()  # pytest captures it, as mpiexec forwards it through a pipe
    bar = progress_bar(10, "x", disable=False)
    assert bar.disable
    bar.close()


def test_launch_note_names_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from examples.common import launch_note

    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launch_note() == ""
    monkeypatch.setenv("PMI_SIZE", "2")
    assert launch_note() == " on 2 ranks (mpiexec)"
    src = (ROOT / "examples" / "train_digits.py").read_text(encoding="utf-8")
    assert "launch_note()" in src and "launch_note()" in (ROOT / "examples" / "bayesian_digits.py").read_text()


def test_worth_reporting_is_a_1_2_5_series() -> None:
    assert [n for n in range(1, 1001) if worth_reporting(n)] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_diverged_run_logs_a_few_lines_not_one_per_step(caplog: pytest.LogCaptureFixture) -> None:
    """32 skipped steps out of 40 (every fifth batch finite, so no streak reaches the error or a
    consecutive-skip limit): warnings at skips 1, 2, 5, 10 and 20 only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = SecondOrderOptimizer(model, lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y) * (1.0 if len(calls) % 5 == 1 else float("nan"))
        loss.backward()
        return loss, out

    with caplog.at_level(logging.WARNING, logger="torchsso2.optim.base"):
        for _ in range(40):
            opt.step(closure)
    assert opt.num_skipped == 32
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [m.split("skipped so far: ")[1].split(";")[0] for m in warned] == ["1", "2", "5", "10", "20"]
