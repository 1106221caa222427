"""A stand-in for ``time.perf_counter`` that makes the benchmarks' timing code deterministic in tests."""
from __future__ import annotations

from typing import Sequence


class FakeClock:
    """A ``perf_counter`` called in start / stop pairs: the k-th pair is ``durations[k]`` seconds apart."""

    def __init__(self, durations: Sequence[float]) -> None:
        self.durations, self.calls, self.now = list(durations), 0, 0.0

    def __call__(self) -> float:
        if self.calls % 2 == 1:
            self.now += self.durations[self.calls // 2]
        self.calls += 1
        return self.now
