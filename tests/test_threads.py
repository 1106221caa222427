"""The NumPy linear-algebra backend keeps NumPy's BLAS pool to torch's intra-op thread count
(otherwise OpenBLAS runs one thread per core beside torch's: 83 s vs 5.4 s for 30 K-FAC steps
of a small conv net on a loaded 2-core machine)."""
from __future__ import annotations

import pytest
import torch

threadpoolctl = pytest.importorskip("threadpoolctl", reason="pip install threadpoolctl (comes with scikit-learn)")

from curvature.linalg import get_backend  # noqa: E402


def _blas_threads() -> set:
    return {i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}


def test_numpy_backend_limits_blas_to_torch_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("numpy")
    import numpy

    a = torch.randn(6, 6, dtype=torch.float64)
    a = a @ a.T + torch.eye(6, dtype=torch.float64)
    seen = []
    real = numpy.linalg.eigh

    def spy(x):
        seen.append(_blas_threads())
        return real(x)

    monkeypatch.setattr(numpy.linalg, "eigh", spy)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # a pool wider than torch's
            backend.eigh(a)
            assert _blas_threads() == {2}  # restored after the call
    finally:
        torch.set_num_threads(old)
    assert seen == [{1}]
