"""``import torchsso2`` does not import ``torch._dynamo`` (about a second, as long as ``import torch``).

The library's eager-under-``torch.compile`` functions are wrapped with :func:`curvature.eager.eager`,
which defers ``torch.compiler.disable`` until dynamo is imported by someone else; tests/test_compiled_step.py
and tests/test_compile_audit_fixes.py check that they still run eagerly inside compiled code.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import torch
from curvature.eager import eager

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import torch
from torch import nn
import curvature, torchsso2, torchsso2.kfac, torchsso2.optim
assert "torch._dynamo" not in sys.modules, "import"
m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
curvature.compute(m, x, y, kind="fisher", approx="kfac")
pre = torchsso2.kfac.KFACPreconditioner(m)
nn.functional.cross_entropy(m(x), y).backward()
pre.step()
assert "torch._dynamo" not in sys.modules, "compute / KFACPreconditioner.step"
print("ok")
"""


def test_import_and_eager_use_do_not_import_dynamo():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_eager_calls_through_and_keeps_the_signature():
    calls = []

    @eager
    def f(a: int, *, b: int = 2) -> int:
        """doc"""
        calls.append((a, b))
        return a + b

    assert f(1, b=3) == 4 and calls == [(1, 3)]
    assert f.__name__ == "f" and f.__doc__ == "doc"


def test_eager_function_breaks_the_graph_under_compile():
    """Inside a compiled function the wrapped function runs eagerly (``torch.compiler.is_compiling()`` is
    False in it); the same function unwrapped is traced (True)."""
    importlib.import_module("torch._dynamo")  # the case eager defers to torch's own lazy disable

    def probe(seen: list) -> "callable":
        def inner(x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.compiler.is_compiling())
            return x * 2
        return inner

    for wrap, expected in ((eager, False), (lambda f: f, True)):
        seen: list = []
        inner = wrap(probe(seen))

        def g(x: torch.Tensor) -> torch.Tensor:
            return inner(x + 1) - 1

        torch._dynamo.reset()
        compiled = torch.compile(g, backend="eager")
        for i in range(2):
            x = torch.full((2,), float(i))
            assert torch.equal(compiled(x), x * 2 + 1)
        assert seen and set(seen) == {expected}, (wrap, seen)
    torch._dynamo.reset()
