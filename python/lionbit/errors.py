"""The outcomes of lionbit's sign collectives that code acts on, as types.

Both are ``ValueError`` (what these failures always raised), carry the ranks
they name in ``.ranks``, and are raised on every rank of the call alike, by
the header round that runs before any data moves: nothing was reduced. Their
messages are for people; act on the type and ``.ranks``. Ranks are global
ranks (``dist.get_rank()``'s numbers), in ``.ranks`` and in every message of
lionbit, whatever group the call ran over: in a group of global ranks [4, 5],
its first rank is "rank 4"::

    try:
        lionbit.all_reduce_sign(x)
    except lionbit.NonFiniteInput as err:
        print("NaN on ranks", err.ranks)
"""

from typing import Iterable, List


class _RanksError(ValueError):
    def __init__(self, message: str, ranks: Iterable[int]):
        super().__init__(message)
        self.ranks: List[int] = sorted(set(int(r) for r in ranks))

    def __reduce__(self):  # picklable across processes, ranks included
        return type(self), (str(self), self.ranks)


class NonFiniteInput(_RanksError):
    """The input held NaN on ``ranks`` (for DistributedLion: a NaN or
    infinite Lion direction, from a non-finite gradient or momentum)."""


class PeerRejected(_RanksError):
    """``ranks`` rejected their own arguments to this call (each raised its
    own error, which says why); the other ranks raise this at once instead of
    waiting for them."""
