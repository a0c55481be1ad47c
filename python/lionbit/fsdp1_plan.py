"""An FSDP1 model's step, planned once and replayed (sharded, NO_SHARD and
hybrid units).

FSDP1 packs a model's original parameters into a few flat parameters, and
the general path of its step (``fsdp1.FSDP1Attachment.vote_step``,
``vote_hybrid``) cuts each flat gradient, momentum and local shard into one
view per original parameter (its segment) for the direction, the momentum
update and the apply, three times a segment: about 27 us a segment on a
CPU at 2 ranks, 4 ms of a GPT-2's 6.5 ms ``opt.step()`` for 148 segments,
and on a GPU host time the step waits on. Most steps are the step before
again: the same units with a gradient, in the same order, of the same
dtypes and sizes, the same momenta. A plan keeps what such a step computes
from them: each vote's list-kernel calls, as spans (first element and
length) of the flat tensors with their bit offsets, the momenta's calls and
the applies' calls, and the sharded votes' buffers. A step checks, in a few
passes in C, that the plan still describes its flat tensors and makes a few
calls into C++, with no Python code and no view a segment.

The plan covers the common step: the aggregation "vote" with Delta as the
votes' planes, every pair served by the fused list kernels, every flat
tensor contiguous, one device, no rank abstaining (Join). It is made from a
step of the general path and dropped for any step it does not describe (a
unit with a gradient or without one where it was not, in another order, a
parameter that trains or is frozen where it was not, in another group, a
gradient or a local shard of another dtype or size or not contiguous,
another momentum tensor, another choice of kernels); that step takes the general path, which plans the
next. Both make the same collectives in the same order and run the same
kernels on the same elements: bit for bit the same step.
"""

from operator import attrgetter, is_, methodcaller
from typing import List, Optional

import torch

from . import kernel_choice, lion_math, step_vote
from .voter import KeptShardPlanes

_dtype, _momentum = attrgetter("dtype"), attrgetter("momentum")
_numel, _contiguous = methodcaller("numel"), methodcaller("is_contiguous")


class _Call:
    """One list-kernel call: elements [start, start + length) of the step's
    flat tensors ``idx`` (positions among its sources) of parameter group
    ``group``, with their momenta and bit offsets in their vote's planes."""

    __slots__ = ("group", "idx", "ms", "offsets", "starts", "lengths")

    def __init__(self, group: int):
        self.group = group
        self.idx, self.ms, self.offsets, self.starts, self.lengths = [], [], [], [], []

    def of(self, ts) -> list:
        return list(map(ts.__getitem__, self.idx))


def _grouped(items, momenta) -> List[_Call]:
    """A call per distinct key (parameter group first), in order of first
    appearance, from (key, (source, bit offset, start, length)) items."""
    calls = {}
    for key, (i, offset, start, length) in items:
        call = calls.get(key)
        if call is None:
            call = calls[key] = _Call(key[0])
        call.idx.append(i)
        call.ms.append(momenta[i])
        call.offsets.append(offset)
        call.starts.append(start)
        call.lengths.append(length)
    return list(calls.values())


class _Vote:
    """One collective of the step: a sharded unit's run (reduce-scatter;
    hybrid: the replicas' all-reduce, ``replicated``) or a chunk of the
    NO_SHARD units' segments (all-reduce over the optimizer's group,
    ``chunk``: its index in the attachment's VoteBuffers), with its
    directions' and applies' calls."""

    __slots__ = ("group", "replicated", "chunk", "numel", "where", "directions", "applies", "kept")

    def __init__(self, group, replicated: bool, chunk: Optional[int], numel: int, where: str, directions, applies):
        self.group, self.replicated, self.chunk, self.numel, self.where = group, replicated, chunk, numel, where
        self.directions, self.applies = directions, applies
        self.kept = KeptShardPlanes()

    def buffers(self, voter, device, shared):
        """The vote's planes (zeroed) and Delta buffer: a sharded vote's own
        (made at the first replay, kept), a chunk's the attachment's."""
        if self.chunk is not None:
            return (*shared.planes[self.chunk], shared.outs[self.chunk])
        return self.kept.get(voter, 1 if self.replicated else self.group.size(), self.numel, device)


def _config(att, device, groups) -> tuple:
    """What the plan's choice of kernels and votes rests on, besides the tensors."""
    opt = att.opt
    return (opt.momentum_dtype, opt.fused, opt.voter.aggregation, opt.voter.bits, step_vote.chunk_limit(device),
            kernel_choice.list_kernels_allowed(device), kernel_choice.fused_lion_allowed(device),
            tuple(opt.voter.votes_into_planes(device, g) for g in groups))


class _Layout:
    """What a planned step replays, and what it must find to replay it."""

    def __init__(self, att, sources, calls):
        self.units = [u for u, _, _, _ in sources]
        gs, xs = [g for _, g, _, _ in sources], [x for _, _, x, _ in sources]
        self.groups = tuple(groups for *_, groups in sources)
        self.g_dtypes, self.g_sizes = tuple(map(_dtype, gs)), tuple(map(_numel, gs))
        self.x_dtypes, self.x_sizes = tuple(map(_dtype, xs)), tuple(map(_numel, xs))
        self.momenta = [u.momentum_tensor() for u in self.units]
        self.device = gs[0].device
        self.cuda = self.device.type == "cuda"
        index = {id(u): i for i, u in enumerate(self.units)}
        pair = (lambda i: (gs[i].dtype, self.momenta[i].dtype)) if self.cuda else (lambda i: None)
        x_dtype = (lambda i: xs[i].dtype) if self.cuda else (lambda i: None)
        self.votes, updates = [], []
        # The sharded (and hybrid) units' votes, as the general path made them (fsdp1._vote_units).
        covered = set()
        for run, bases, s, group, replicated, where in calls:
            stride = lion_math.shard_bit(1, s)
            directions, applies = [], []
            for u, base in zip(run, bases):
                i = index[id(u)]
                covered.add(i)
                for si, a, n, spans, x_at, x_n in u.cuts:
                    gi = self.groups[i][si]
                    if gi is None:  # (frozen now: no vote, no momentum update, no apply)
                        continue
                    directions += [((gi, pair(i)), (i, stride * r + base + at, a + sa, k))
                                   for r, sa, k, at in spans if k]
                    if x_n:
                        applies.append(((gi, x_dtype(i)), (i, base + x_at, x_at, x_n)))
                    updates.append(((gi, pair(i)), (i, 0, a, n)))
            self.votes.append(_Vote(group, replicated, None, s, where, _grouped(directions, self.momenta),
                                    _grouped(applies, self.momenta)))
        # The NO_SHARD units' segments, as step_vote.start_chunks lays them out over the optimizer's group.
        flat = [(i, off, numel, gi) for i, u in enumerate(self.units) if i not in covered
                for (off, numel, _, _), gi in zip(u.segments, self.groups[i]) if gi is not None]
        self.sizes = [numel for _, _, numel, _ in flat]
        self.wait_between = bool(calls) and bool(flat) and att.group is not calls[0][3]
        for k, (first, end, total) in enumerate(step_vote.chunking(self.sizes, step_vote.chunk_limit(self.device))):
            items, at = [], 0
            for i, off, numel, gi in flat[first:end]:
                items.append(((gi, pair(i)), (i, at, off, numel)))
                updates.append(((gi, pair(i)), (i, 0, off, numel)))
                at += numel
            applies = [((key[0], x_dtype(item[0])), item) for key, item in items]
            self.votes.append(_Vote(att.group, False, k, total, "step", _grouped(items, self.momenta),
                                    _grouped(applies, self.momenta)))
        self.updates = _grouped(updates, self.momenta)
        self.config = _config(att, self.device, [v.group for v in self.votes])

    def describes(self, att, sources) -> bool:
        """Whether the plan describes the step of ``sources``."""
        units = [u for u, _, _, _ in sources]
        if len(units) != len(self.units) or not all(map(is_, units, self.units)):
            return False
        if tuple(groups for *_, groups in sources) != self.groups:
            return False
        gs, xs = [g for _, g, _, _ in sources], [x for _, _, x, _ in sources]
        return (tuple(map(_dtype, gs)) == self.g_dtypes and tuple(map(_numel, gs)) == self.g_sizes
                and all(map(_contiguous, gs)) and tuple(map(_dtype, xs)) == self.x_dtypes
                and tuple(map(_numel, xs)) == self.x_sizes and all(map(_contiguous, xs))
                and all(map(is_, map(_momentum, units), self.momenta))
                and _config(att, self.device, [v.group for v in self.votes]) == self.config)


def plannable(att, sources, calls, fused_for) -> bool:
    """Whether a plan can replay the step the general path just started from
    ``sources`` and ``calls``: the common step (see the module's text)."""
    opt = att.opt
    voter = opt.voter
    if not sources or voter.bits or voter.aggregation != "vote":
        return False
    device = sources[0][1].device
    if not kernel_choice.list_kernels_allowed(device):
        return False
    gs, xs = [g for _, g, _, _ in sources], [x for _, _, x, _ in sources]
    ms = [u.momentum_tensor() for u, _, _, _ in sources]
    if any(t.device != device for t in gs + xs + ms):
        return False
    if not all(map(_contiguous, gs + xs + ms)) or any(g.numel() != m.numel() for g, m in zip(gs, ms)):
        return False
    covered = {id(u) for run, *_ in calls for u in run}
    groups = [group for _, _, _, group, _, _ in calls]
    if any(id(u) not in covered for u, _, _, _ in sources):
        groups.append(att.group)
    if not all(voter.votes_into_planes(device, g) for g in groups):
        return False
    planes = lion_math.VotedPlanes(None, None, 0, 0)  # (what the apply's verdict reads of a Delta)
    return all(fused_for.many(ms, gs)) and all(fused_for.many(xs, [planes] * len(xs)))


class FSDP1Plan:
    """An FSDP1 model's planned step (see the module's text): :meth:`start`
    replays it where it describes the step; :meth:`learn` plans from a step
    of the general path."""

    def __init__(self):
        self.layout: Optional[_Layout] = None
        self.replayed = 0  # steps voted as planned (counted once every rank agreed to them)

    def learn(self, att, sources, calls, fused_for) -> None:
        """Plans the step the general path just started: ``sources`` (unit,
        its flat gradient, its flat local shard, each segment's parameter
        group or None where it does not train) of every unit it voted, the
        sharded ones first in their calls' order, then the NO_SHARD ones, and
        ``calls`` (the sharded calls: units, their first elements in a shard,
        elements in a shard, process group, replicated, where), where a plan
        can replay it."""
        self.layout = _Layout(att, sources, calls) if plannable(att, sources, calls, fused_for) else None

    def start(self, att, sources):
        """Starts the step's votes as planned; returns (agreements, works,
        the momentum update, the apply), or None where the plan does not
        describe the step (nothing done). Raises :class:`step_vote.NonFinite`
        as the general path does."""
        lay = self.layout
        if lay is None or not lay.describes(att, sources):
            self.layout = None
            return None
        opt = att.opt
        voter = opt.voter
        gs, xs = [g for _, g, _, _ in sources], [x for _, _, x, _ in sources]
        coefs = [lion_math.Coefs(g) for g in opt.param_groups]
        if lay.sizes:
            att.buffers.prepare(lay.sizes, lay.device, voter.delta_dtype, None, True)
        agreed, works, outs = [], [], []
        for v in lay.votes:
            if v.chunk == 0 and lay.wait_between:
                # (another communicator: its calls start once the sharded votes' bits are in, as fsdp1's)
                step_vote.wait_votes(works)
            sign, zero, delta = v.buffers(voter, lay.device, att.buffers)
            outs.append(delta)
            counts = torch.zeros(2, dtype=torch.int64, device=lay.device) if lay.cuda else None
            bad = sum(lion_math.directions_into(c.of(gs), c.ms, c.offsets, c.starts, c.lengths, coefs[c.group],
                                                sign, zero, counts) for c in v.directions)
            tally = counts[1:] if lay.cuda else None
            if v.chunk is not None:
                works.append(voter.all_reduce(sign, zero, v.numel, bad, delta, v.group, v.where, out_planes=True,
                                              nans_tally=tally, agreed=agreed))
                continue
            works.append(voter.start_sharded(sign, zero, v.numel, bad, delta, v.group, v.where, v.replicated,
                                             out_planes=True, nans_tally=tally, agreed=agreed))

        def momenta() -> None:
            for c in lay.updates:
                lion_math.momenta_from(c.of(gs), c.ms, coefs[c.group], c.starts, c.lengths)

        def apply() -> None:
            for v, out in zip(lay.votes, outs):
                half = out.numel() // 2
                for c in v.applies:
                    lion_math.apply_planes(c.of(xs), out[:half], out[half:], c.offsets, coefs[c.group], c.starts,
                                           c.lengths)

        return agreed, works, momenta, apply
