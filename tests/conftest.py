"""Test-session settings shared by the curvature suite.

The test models are tiny (a few hundred parameters): intra-op threading only adds
synchronisation overhead there, and on a loaded 2-core machine OpenMP spin-waits make
double-backward/vmap calls 10-100x slower. One thread keeps the suite fast and its timing stable.

Benchmarks' ``main()`` run in-process by their tests quiet the library's loggers (skipped steps
are counted in their tables instead); the level is put back after every test, so that a later
test's ``caplog`` sees the library's warnings whatever ran before it.

The processes the tests launch (torchrun, mpiexec, the examples) get a ``TMPDIR`` under pytest's own
temporary directory, which pytest prunes: torchrun leaves a ``torchelastic_*`` log directory behind
at every launch (about 27 per run of the suite had gathered in /tmp).
"""
import logging
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

torch.set_num_threads(1)

_LIBRARY_LOGGERS = ("torchsso2", "curvature")


@pytest.fixture(autouse=True)
def _library_log_levels_restored() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _LIBRARY_LOGGERS]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


@pytest.fixture(autouse=True, scope="session")
def _launched_processes_use_a_pruned_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("launched-tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)  # (this process's tempfile.tempdir is not changed once it was read)
    yield path
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
