"""Momentum synchronization (Lion Cub, Ishikawa et al. 2024): each rank's
momentum sees only its own gradients and drifts from the others'; now and
then the ranks average their momenta.

``DistributedLion(momentum_sync=k)`` averages them after every k-th step;
``momentum_sync=ExponentialSync(first, factor)`` at exponentially growing
intervals; any callable ``step -> bool`` decides itself (``step`` counts the
steps applied so far, 1 after the first).
"""

from typing import Callable, Optional


class ExponentialSync:
    """Synchronize after step ``first``, then after intervals that grow by
    ``factor`` each time: first, first + first*factor, ... (rounded down,
    at least 1 step apart)."""

    def __init__(self, first: int = 10, factor: float = 2.0):
        if isinstance(first, bool) or not isinstance(first, int) or first < 1:
            raise ValueError(f"ExponentialSync: argument 'first' must be an int >= 1, got {first!r}")
        if not factor >= 1.0:
            raise ValueError(f"ExponentialSync: argument 'factor' must be >= 1, got {factor!r}")
        self.first, self.factor = first, float(factor)

    def __call__(self, step: int) -> bool:
        at, interval = self.first, float(self.first)
        while at < step:
            interval *= self.factor
            at += max(1, int(interval))
        return at == step

    def __repr__(self) -> str:
        return f"ExponentialSync(first={self.first}, factor={self.factor})"


def schedule(momentum_sync) -> Optional[Callable[[int], bool]]:
    """The schedule of a ``momentum_sync`` argument (None: never)."""
    if momentum_sync is None:
        return None
    if isinstance(momentum_sync, bool):
        raise ValueError(f"DistributedLion: argument 'momentum_sync' must be None, an int k >= 1 or a callable, "
                         f"got {momentum_sync!r}")
    if isinstance(momentum_sync, int):
        if momentum_sync < 1:
            raise ValueError(f"DistributedLion: argument 'momentum_sync' must be an int k >= 1, got {momentum_sync}")
        k = momentum_sync
        return lambda step: step % k == 0
    if callable(momentum_sync):
        return momentum_sync
    raise ValueError(f"DistributedLion: argument 'momentum_sync' must be None, an int k >= 1 or a callable, "
                     f"got {type(momentum_sync).__name__}")


def synchronize(opt) -> None:
    raise NotImplementedError("momentum synchronization: in progress")
