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

import weakref
from itertools import repeat
from typing import Optional

import torch
import torch.distributed as dist

from . import _C, kernel_choice, lion_math
from ._backend import backend_for
from .errors import NonFiniteInput
from .step_vote import NonFinite, nonfinite_ranks, pack_directions


def runs(items, key, size, limit) -> list:
    """``items`` in order as runs, one sharded vote each: consecutive items
    of equal ``key(item)`` while the run's ``size(item)`` (elements of
    planes) add up to at most ``limit(item)``; an item over the limit is a
    run of its own. FSDP's units voted at step() in a few calls, not one a
    unit (on a GPU a call is ~130 launches)."""
    out, total = [], 0
    for item in items:
        n = size(item)
        if out and key(item) == key(out[-1][0]) and total + n <= limit(item):
            out[-1].append(item)
            total += n
        else:
            out.append([item])
            total = n
    return out


def end_to_end(parts):
    """The pieces of one :meth:`Voter.sharded_vote` from ``parts``, each
    (pieces, shard_numel) laid out in shards of its own: part i's chunk after
    the earlier parts' in every shard. Returns (pieces, shard_numel, each
    part's first element in a shard)."""
    pieces, bases, total = [], [], 0
    for part, s in parts:
        pieces += [(g, m, coefs, [(r, start, k, total + at) for r, start, k, at in spans])
                   for g, m, coefs, spans in part]
        bases.append(total)
        total += s
    return pieces, total, bases


class KeptShardPlanes:
    """A planned sharded vote's buffers (lionbit.fsdp_plan, lionbit.fsdp1_plan):
    its planes and its Delta as the vote's two result planes, made at the
    first use and zeroed at each use after."""

    __slots__ = ("sign", "zero", "delta")

    def __init__(self):
        self.sign = self.zero = self.delta = None

    def get(self, voter, shards: int, shard_numel: int, device):
        """(sign, zero, Delta) of a vote of ``shards`` shards of ``shard_numel`` elements."""
        if self.sign is None:
            self.sign, self.zero = voter.shard_planes(shards, shard_numel, device)
            self.delta = torch.empty(2 * lion_math.plane_bytes(shard_numel), dtype=torch.uint8, device=device)
        else:
            self.sign.zero_()
            self.zero.zero_()
        return self.sign, self.zero, self.delta


class Voter:
    """The aggregation of one DistributedLion and its collectives."""

    def __init__(self, aggregation: str, bits: Optional[int], tie_break: str, counter, hierarchy: str = "flat"):
        self.aggregation = aggregation
        self.hierarchy = hierarchy  # "flat", "node" or "node_vote" (lionbit.hierarchy)
        self.bits = bits  # "l1" only
        self.tie_break = tie_break
        # what counts the steps (its steps_taken: the optimizer), weakly: the optimizer holds its voter
        self._counter = None if counter is None else weakref.ref(counter)
        self._calls = 0  # collectives issued so far in this step

    @property
    def delta_dtype(self) -> torch.dtype:
        """Delta's dtype: bfloat16 holds -1, 0, +1 exactly; avg needs more."""
        return torch.float32 if self.aggregation == "avg" else torch.bfloat16

    def votes_into_planes(self, device, group) -> bool:
        """Whether a vote over ``group``'s ranks (an all-reduce, or FSDP's
        reduce-scatter) can return its Delta as planes
        (:class:`lion_math.VotedPlanes`, 2 bits an element) rather than
        values: a flat vote over a process group (without one, this rank's
        own vote writes values), on the CPU, or on a GPU where the list
        kernels (the apply from planes among them) passed their first-use
        checks."""
        if not (self.aggregation == "vote" and not self.bits and self.hierarchy == "flat"
                and (group is not None or dist.is_initialized())):
            return False
        device = torch.device(device)
        return device.type == "cpu" or kernel_choice.list_kernels_allowed(device)

    def planes(self, numel: int, device=None):
        """Zeroed buffers for the packed directions of ``numel`` elements."""
        return lion_math.planes(numel, device, self.bits)

    def shard_planes(self, shards: int, shard_numel: int, device=None):
        """The planes of a reduce-scatter: ``shards`` chunks of
        ``shard_numel`` elements, chunk r at lion_math.shard_bit(r, shard_numel)."""
        return lion_math.planes(lion_math.shard_bit(shards, shard_numel), device, self.bits)

    def sharded_vote(self, pieces, shard_numel: int, group, device, where: str, fused_for,
                     agreed: list, works: list, replicated: bool = False,
                     into_planes: bool = False, nexts=None) -> torch.Tensor:
        """The vote of directions laid out in N shards of ``shard_numel``
        elements (FSDP2's chunks, FSDP1's flat parameter), as a sign
        reduce-scatter: this rank's shard of Delta (``into_planes``, where
        :meth:`votes_into_planes`: as its two result planes, uint8, for
        lion_math.delta_views). ``replicated`` (HSDP):
        the pieces are one shard only, which every rank of ``group`` holds
        (the replicas of a shard), every span's r is 0, and a sign
        all-reduce over ``group`` gives all of that shard's Delta. Each piece is
        (g, m, coefs, spans), one parameter's (or segment's) flat local
        gradient and momentum (only read) with its hyperparameters, and
        spans (r, start, length, at): elements [start, start + length) of g
        and m go to shard r at element ``at``. "l1" scales each piece over
        all its spans. Changes no state. The call is left in flight, its
        agreement (:meth:`all_reduce`'s) and future appended to ``agreed``
        and ``works``; the caller waits for them (step_vote.wait_votes,
        which raises step_vote.NonFinite naming the ranks that had a
        non-finite direction) before it reads Delta. ``fused_for(m, g)``:
        whether the fused kernels serve a pair (a step_vote.FusedVerdicts);
        ``nexts``: the optimizer's second momentum buffers (lionbit.next_momenta),
        written in the same pass."""
        sign, zero = self.shard_planes(1 if replicated else group.size(), shard_numel, device)
        nans, items = 0, []
        stride = lion_math.shard_bit(1, shard_numel)  # bits from one shard to the next
        # (what a span of a pair would be asked)
        verdicts = repeat(None) if self.bits else fused_for.many([p[1] for p in pieces], [p[0] for p in pieces])
        for (g, m, coefs, spans), fused in zip(pieces, verdicts):
            if self.bits:
                parts = [(g[a : a + k], m[a : a + k], stride * r + at) for r, a, k, at in spans if k]
                if parts:
                    nans += lion_math.pack_levels_pieces(parts, coefs, self.bits, sign)
                continue
            items += [(g, m, coefs, fused, stride * r + at, a, k) for r, a, k, at in spans if k]
        packed, tally = pack_directions(items, sign, zero, nexts=nexts)
        nans += packed
        if into_planes:
            delta = torch.empty(2 * lion_math.plane_bytes(shard_numel), dtype=torch.uint8, device=device)
        else:
            delta = torch.empty(shard_numel, dtype=self.delta_dtype, device=device)
        works.append(self.start_sharded(sign, zero, shard_numel, nans, delta, group, where, replicated,
                                        out_planes=into_planes, nans_tally=tally, agreed=agreed))
        return delta

    def start_sharded(self, sign, zero, shard_numel: int, nans: int, delta: torch.Tensor, group, where: str,
                      replicated: bool, out_planes: bool = False, nans_tally=None, agreed: Optional[list] = None):
        """Starts a sharded vote's collective over packed planes: the
        reduce-scatter (:meth:`reduce_scatter`), or with ``replicated`` the
        all-reduce of the one shard every rank of ``group`` holds; returns
        its future. A non-finite direction that the call reports at once
        raises :class:`step_vote.NonFinite`, as waiting for it would."""
        start = self.all_reduce if replicated else self.reduce_scatter
        try:
            return start(sign, zero, shard_numel, nans, delta, group, where, out_planes=out_planes,
                         nans_tally=nans_tally, agreed=agreed)
        except (RuntimeError, ValueError) as err:
            ranks = nonfinite_ranks(err)
            if ranks is None:
                raise
            raise NonFinite(ranks) from None

    def new_step(self) -> None:
        """The next collective is the first of a new step."""
        self._calls = 0

    def _seed(self) -> int:
        """The tie rule's seed of the next collective: "alternate" (and
        "zero", which draws nothing from it) the step counter; "random" the
        step and the collective's number within the step (both the same on
        every rank; the number restarts at every step, so a resumed run draws
        the same signs). Every rank's header carries the seed and the header
        round checks it: ranks at different steps (one resumed from another
        checkpoint than the others, or from none) fail their first vote,
        every rank alike, rather than vote one step against another."""
        index, self._calls = self._calls, self._calls + 1
        if self.tie_break == "random":
            return (self._counter().steps_taken << 20) + index
        return self._counter().steps_taken

    def all_reduce(self, sign, zero, numel: int, nans: int, out: torch.Tensor, group, where: str,
                   out_planes: bool = False, nans_tally=None, agreed: Optional[list] = None):
        """Starts the all-reduce of packed directions (planes and ``out`` on
        one device, CPU or CUDA; ``nans``: this rank's non-finite count, plus
        ``nans_tally``'s where given: pack_directions' device tally) into
        ``out`` (Delta; with ``out_planes``, where :meth:`votes_into_planes`,
        uint8: the sign plane, then the zero plane); returns its future.
        Without a process group: this rank's own vote. ``agreed``: a list
        that receives what to wait() for until every rank has agreed to the
        call (its header round: no rank's direction non-finite, every input
        accepted; backend/agreement.hpp), raising what the future would
        (the future itself where nothing else tells)."""
        seed = self._seed()
        if group is None and not dist.is_initialized():
            if out_planes:
                raise ValueError(f"DistributedLion.{where}: out_planes needs a process group")
            if nans_tally is not None:
                nans += int(nans_tally)
            fut = torch.futures.Future(devices=[out.device] if out.is_cuda else None)
            if agreed is not None:
                agreed.append(fut)  # (settled below, before anyone waits)
            if nans:
                # What the header round raises, so that callers treat both alike.
                fut.set_exception(NonFiniteInput(f"DistributedLion.{where}: input contains NaN on rank(s) [0]", [0]))
                return fut
            out.copy_(lion_math.local_vote(sign, zero, numel, self.bits))
            fut.set_result([out])
            return fut
        backend = backend_for(group, out.device, where)
        agreement = None if agreed is None else _C.Agreement()
        if self.aggregation == "l1":
            work = backend.all_reduce_levels_packed(sign, self.bits, numel, nans, out, self.tie_break, seed,
                                                    agreement)
        else:
            work = backend.all_reduce_sign_packed(
                sign, zero, numel, nans, out, self.aggregation, self.tie_break, seed, self.hierarchy, out_planes,
                nans_tally, agreement
            )
        if agreed is not None:
            agreed.append(agreement)
        return work.get_future()

    def reduce_scatter(self, sign, zero, shard_numel: int, nans: int, delta: torch.Tensor, group, where: str,
                       out_planes: bool = False, nans_tally=None, agreed: Optional[list] = None):
        """Starts the FSDP reduce-scatter of packed directions (``zero`` is
        None for "l1"): this rank's shard of Delta into ``delta``; returns its
        future. ``out_planes``, ``agreed``: as :meth:`all_reduce`'s, of the
        shard; ``nans_tally``: as :meth:`all_reduce`'s (sign planes only)."""
        seed = self._seed()
        backend = backend_for(group, delta.device, where)
        agreement = None if agreed is None else _C.Agreement()
        if self.bits:
            work = backend.reduce_scatter_levels_packed(sign, self.bits, shard_numel, nans, delta, self.tie_break, seed,
                                                        agreement)
        else:
            work = backend.reduce_scatter_sign_packed(
                sign, zero, shard_numel, nans, delta, self.aggregation, self.tie_break, seed, self.hierarchy,
                out_planes=out_planes, nans_tally=nans_tally, agreement=agreement
            )
        if agreed is not None:
            agreed.append(agreement)
        return work.get_future()
