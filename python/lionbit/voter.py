"""How the ranks' Lion directions become one update: the aggregation
("vote", "avg" or "l1" with ``bits``), the tie rule and its seeds, and the
calls of lionbit's collectives that carry them.

Every integration of DistributedLion (a plain module, DDP, FSDP2, FSDP1)
packs its directions into bit-planes (lionbit.lion_math) and hands them to
the optimizer's :class:`Voter`, which draws the tie rule's seed for the call
and issues the all-reduce or the reduce-scatter. Collectives are numbered
within a step (every rank issues the same ones in the same order), so the
"random" rule's signs depend only on the step and the call's number.
"""

from typing import Optional

import torch
import torch.distributed as dist

from . import lion_math
from ._backend import backend_for
from .errors import NonFiniteInput


class Voter:
    """The aggregation of one DistributedLion and its collectives."""

    def __init__(self, aggregation: str, bits: Optional[int], tie_break: str, counter, hierarchy: str = "flat"):
        self.aggregation = aggregation
        self.hierarchy = hierarchy  # "flat", "node" or "node_vote" (lionbit.hierarchy)
        self.bits = bits  # "l1" only
        self.tie_break = tie_break
        self._counter = counter  # its steps_taken: the optimizer's step counter
        self._calls = 0  # collectives issued so far in this step

    @property
    def delta_dtype(self) -> torch.dtype:
        """Delta's dtype: bfloat16 holds -1, 0, +1 exactly; avg needs more."""
        return torch.float32 if self.aggregation == "avg" else torch.bfloat16

    def planes(self, numel: int, device=None):
        """Zeroed buffers for the packed directions of ``numel`` elements."""
        return lion_math.planes(numel, device, self.bits)

    def shard_planes(self, shards: int, shard_numel: int, device=None):
        """The planes of a reduce-scatter: ``shards`` chunks of
        ``shard_numel`` elements, chunk r at bit r * 64 * ceil(shard_numel / 64)."""
        return lion_math.planes(shards * 64 * ((shard_numel + 63) // 64), device, self.bits)

    def new_step(self) -> None:
        """The next collective is the first of a new step."""
        self._calls = 0

    def _seed(self) -> int:
        """The tie rule's seed of the next collective: "alternate" follows
        the step counter; "random" draws from the step and the collective's
        number within the step (both the same on every rank; the number
        restarts at every step, so a resumed run draws the same signs)."""
        index, self._calls = self._calls, self._calls + 1
        if self.tie_break == "alternate":
            return self._counter.steps_taken
        if self.tie_break == "random":
            return (self._counter.steps_taken << 20) + index
        return -1

    def all_reduce(self, sign, zero, numel: int, nans: int, out: torch.Tensor, group, where: str):
        """Starts the all-reduce of packed directions (planes and ``out`` on
        one device, CPU or CUDA; ``nans``: this rank's non-finite count) into
        ``out`` (Delta); returns its future. Without a process group: this
        rank's own vote."""
        seed = self._seed()
        if group is None and not dist.is_initialized():
            fut = torch.futures.Future(devices=[out.device] if out.is_cuda else None)
            if nans:
                # What the header round raises, so that callers treat both alike.
                fut.set_exception(NonFiniteInput(f"DistributedLion.{where}: input contains NaN on rank(s) [0]", [0]))
                return fut
            out.copy_(lion_math.local_vote(sign, zero, numel, self.bits))
            fut.set_result([out])
            return fut
        backend = backend_for(group, out.device, where)
        if self.aggregation == "l1":
            work = backend.all_reduce_levels_packed(sign, self.bits, numel, nans, out, self.tie_break, seed)
        else:
            work = backend.all_reduce_sign_packed(
                sign, zero, numel, nans, out, self.aggregation, self.tie_break, seed, self.hierarchy
            )
        return work.get_future()

    def reduce_scatter(self, sign, zero, shard_numel: int, nans: int, delta: torch.Tensor, group, where: str) -> None:
        """The FSDP reduce-scatter of packed directions (``zero`` is None for
        "l1"): this rank's shard of Delta into ``delta``; waits."""
        seed = self._seed()
        backend = backend_for(group, delta.device, where)
        if self.bits:
            work = backend.reduce_scatter_levels_packed(sign, self.bits, shard_numel, nans, delta, self.tie_break, seed)
        else:
            work = backend.reduce_scatter_sign_packed(
                sign, zero, shard_numel, nans, delta, self.aggregation, self.tie_break, seed, self.hierarchy
            )
        work.wait()
