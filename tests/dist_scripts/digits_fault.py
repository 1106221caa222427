"""README's demo with a failing rank: ``mpiexec -n 2 python digits_fault.py MODE [train_digits args]``.

Runs ``examples/train_digits.py``'s ``main`` unchanged, except that on rank 1 the third call of
``SecondOrderOptimizer.step`` raises ``RuntimeError("rank 1 fails on purpose")`` (MODE
``raise``) or calls ``sys.exit(3)`` (MODE ``exit``). Nothing in the demo installs a fault
handler: whatever ends the job comes from the library.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from examples.train_digits import main  # noqa: E402
from torchsso2 import SecondOrderOptimizer  # noqa: E402

MODE = sys.argv[1]
RANK = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))

if RANK == 1:
    original = SecondOrderOptimizer.step
    calls = []

    def failing_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:
            if MODE == "raise":
                raise RuntimeError("rank 1 fails on purpose")
            sys.exit(3)
        return original(self, *args, **kwargs)

    SecondOrderOptimizer.step = failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[2:]))
