"""An FSDP2 model's step, planned once and replayed (a 1-D mesh and HSDP).

The general path of ``fsdp.fsdp_vote`` does Python work for every parameter
of every unit at each step: its local gradient read and checked, its
momentum looked up and viewed flat, its hyperparameters, its chunk layout's
spans re-tupled for the vote, its fused verdicts asked three times, its
Delta's view. That is about 15 us a parameter on a CPU: 2 ms a step for a
GPT-2's 148 parameters, as long as the list kernels themselves, and on a
GPU host time the step waits on. Most steps are the step before again: the
same units reduced in the same order, the same parameters with a gradient,
of the same dtypes and placements, the same momenta and local shards. A
plan keeps what such a step computes from them (each vote's list-kernel
calls with their tensors, bit offsets and spans, the momenta's calls, the
applies' calls, the votes' buffers) and replays it: a step reads the
gradients, checks in a few passes in C that the plan still describes them,
and makes a few calls into C++, with no Python code a parameter.

The plan covers the common step: the aggregation "vote" with Delta as the
votes' planes, every pair served by the fused list kernels, every local
gradient contiguous, one device. It is made from a step of the general
path and dropped for any step it does not describe (a unit reduced in
another order or with other parameters, a gradient missing or new, of
another dtype, placement or shape, a momentum or a local shard that is not
the one it holds, another parameter group, another choice of kernels);
that step takes the general path, which plans the next. Both run the same
kernels on the same tensors: bit for bit the same step.
"""

from itertools import compress, repeat
from operator import and_, attrgetter, is_, is_not, methodcaller
from typing import List, Optional

import torch
from torch.distributed.tensor import DTensor

from . import kernel_choice, lion_math, next_momenta, step_vote, torch_internals
from .voter import KeptShardPlanes

_grad, _requires_grad, _dtype = attrgetter("grad"), attrgetter("requires_grad"), attrgetter("dtype")
_shape, _mesh, _placements = attrgetter("shape"), attrgetter("device_mesh"), attrgetter("placements")
_sharded = attrgetter("sharded_param")
_contiguous = methodcaller("is_contiguous")
_exp_avg = methodcaller("get", "exp_avg")
_local = torch_internals.dtensor_local


class _Call:
    """One list-kernel call: the step's gradients ``idx`` (positions among
    the parameters with a gradient) of parameter group ``group``, with their
    momenta, and for a direction their spans' bit offsets, starts and
    lengths (a parameter once a span); for an apply ``xs``, their local
    shards, and their Delta's bit offsets."""

    __slots__ = ("group", "idx", "ms", "offsets", "starts", "lengths", "xs", "outs")

    def __init__(self, group: int):
        self.group = group
        self.idx, self.ms, self.offsets, self.starts, self.lengths, self.xs = [], [], [], [], [], []
        self.outs = None  # a direction's momenta's second buffers (double_buffer=True, lionbit.next_momenta)

    def grads(self, gs) -> list:
        return list(map(gs.__getitem__, self.idx))


def _grouped(keys, add) -> List[_Call]:
    """A call per distinct key (parameter group first), in order of first
    appearance; ``add(call, item)`` for each (key, item) of ``keys``."""
    calls = {}
    for key, item in keys:
        call = calls.get(key)
        if call is None:
            call = calls[key] = _Call(key[0])
        add(call, item)
    return list(calls.values())


class _Vote:
    """One collective of the step: its group, its directions' calls, its
    applies' calls, its size in each shard and its buffers (made at the
    first replay, kept)."""

    __slots__ = ("group", "replicated", "shards", "numel", "where", "directions", "applies", "kept")

    def __init__(self, group, replicated: bool, numel: int, where: str, directions, applies):
        self.group, self.replicated, self.numel, self.where = group, replicated, numel, where
        self.shards = 1 if replicated else group.size()
        self.directions, self.applies = directions, applies
        self.kept = KeptShardPlanes()

    def buffers(self, voter, device):
        """The planes (zeroed) and the Delta buffer of this vote."""
        return self.kept.get(voter, self.shards, self.numel, device)


def _config(att, device, votes) -> tuple:
    """What the plan's choice of kernels and votes rests on, besides the tensors."""
    opt = att.opt
    return (opt.momentum_dtype, opt.fused, step_vote.chunk_limit(device), kernel_choice.list_kernels_allowed(device),
            kernel_choice.fused_lion_allowed(device),
            tuple(opt.voter.votes_into_planes(device, v.group) for v in votes))


class _Layout:
    """What a planned step replays, and what it must find to replay it."""

    def __init__(self, att, units, calls):
        opt = att.opt
        self.param_groups = opt.param_groups
        self.groups = [(g, list(g["params"])) for g in opt.param_groups]
        self.state = opt.state
        self.order = list(att.order)
        self.unit_params = [list(c.params) for c in self.order]
        self.unit_groups = [c.group for c in self.order]
        # Every parameter of the units, in order, and which ones the step reads (the general path's mask).
        self.all_ps = [p for ps in self.unit_params for p in map(_sharded, ps)]
        gs = list(map(_grad, self.all_ps))
        self.mask = tuple(map(and_, map(_requires_grad, self.all_ps), map(is_not, gs, repeat(None))))
        gs = list(compress(gs, self.mask))
        self.ps = list(compress(self.all_ps, self.mask))
        self.meshes = list(map(_mesh, gs))
        self.placements = tuple(map(_placements, gs))
        locals_ = list(map(_local, gs))
        self.shapes, self.dtypes = tuple(map(_shape, locals_)), tuple(map(_dtype, locals_))
        self.momenta = [opt.state[p]["exp_avg"] for p in self.ps]
        self.shards = list(map(_local, self.ps))
        self.device = self.ps[0].device
        self.cuda = self.device.type == "cuda"
        index = {p: i for i, p in enumerate(self.ps)}
        group_of = {p: gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
        pair = (lambda i: (self.dtypes[i], self.momenta[i].dtype)) if self.cuda else (lambda i: None)
        dtype = (lambda i: self.ps[i].dtype) if self.cuda else (lambda i: None)
        self.votes = []
        for run, bases, numel, group, replicated, where in calls:
            stride = lion_math.shard_bit(1, numel)
            directions, applies = [], []
            for u, base in zip(run, bases):
                for p, (_, _, _, spans), (*_, off, own) in zip(u.ps, u.pieces, u.entries):
                    i = index[p]
                    key = group_of[p]
                    directions += [((key, pair(i)), (i, stride * r + base + at, a, k)) for r, a, k, at in spans if k]
                    if own:
                        applies.append(((key, dtype(i)), (i, base + off)))
            self.votes.append(_Vote(group, replicated, numel, where, _grouped(directions, self._add_span),
                                    _grouped(applies, self._add_apply)))
        self.updates = _grouped((((group_of[p], pair(i)), i) for i, p in enumerate(self.ps)), self._add_momentum)
        self.config = _config(att, self.device, self.votes)
        self.spares = self._spares(opt.next_momenta)

    def _spares(self, nexts) -> Optional[list]:
        """double_buffer=True: each momentum's second buffer, which the
        directions' calls write and the agreement swaps in, where their spans
        tile every momentum (else None: the momenta are updated from g)."""
        if nexts is None:
            return None
        spans = [set() for _ in self.momenta]
        for v in self.votes:
            for c in v.directions:
                for i, a, k in zip(c.idx, c.starts, c.lengths):
                    spans[i].add((a, k))
        if not all(next_momenta.tiles(s, m.numel()) for s, m in zip(spans, self.momenta)):
            return None
        spares = list(map(nexts.spare, self.momenta))
        for v in self.votes:
            for c in v.directions:
                c.outs = [spares[i] for i in c.idx]
        return spares

    def _add_span(self, call, item) -> None:
        i, offset, start, length = item
        call.idx.append(i)
        call.ms.append(self.momenta[i])
        call.offsets.append(offset)
        call.starts.append(start)
        call.lengths.append(length)

    def _add_apply(self, call, item) -> None:
        i, offset = item
        call.xs.append(self.shards[i])
        call.offsets.append(offset)

    def _add_momentum(self, call, i) -> None:
        call.idx.append(i)
        call.ms.append(self.momenta[i])

    def grads(self, att) -> Optional[list]:
        """This step's local gradients, in the plan's order, if the plan
        describes the step (else None)."""
        opt = att.opt
        groups = opt.param_groups
        if groups is not self.param_groups or len(groups) != len(self.groups) or opt.state is not self.state:
            return None
        for (g, params), now in zip(self.groups, groups):
            ps = now["params"]
            if g is not now or len(ps) != len(params) or not all(map(is_, ps, params)):
                return None
        order = att.order
        if len(order) != len(self.order) or not all(map(is_, order, self.order)):
            return None
        for comm, params, group in zip(order, self.unit_params, self.unit_groups):
            now = comm.params
            if comm.group is not group or len(now) != len(params) or not all(map(is_, now, params)):
                return None
        ps = self.all_ps
        gs = list(map(_grad, ps))
        if tuple(map(and_, map(_requires_grad, ps), map(is_not, gs, repeat(None)))) != self.mask:
            return None
        gs = list(compress(gs, self.mask))
        if (not all(map(is_, map(type, gs), repeat(DTensor)))
                or not all(map(is_, map(_mesh, gs), self.meshes)) or tuple(map(_placements, gs)) != self.placements):
            return None
        locals_ = list(map(_local, gs))
        if (tuple(map(_shape, locals_)) != self.shapes or tuple(map(_dtype, locals_)) != self.dtypes
                or not all(map(_contiguous, locals_))
                or not all(map(is_, map(_exp_avg, map(opt.state.get, self.ps, repeat({}))), self.momenta))
                or not all(map(is_, map(_local, self.ps), self.shards))
                or _config(att, self.device, self.votes) != self.config):
            return None
        return locals_


def plannable(att, units, calls, fused_for) -> bool:
    """Whether a plan can replay the step the general path just started
    (``units``, ``calls``): the common step (see the module's text)."""
    opt = att.opt
    if not units or opt.voter.bits or opt.voter.aggregation != "vote":
        return False
    device = units[0].device
    if not kernel_choice.list_kernels_allowed(device) or any(u.device != device for u in units):
        return False
    if not all(opt.voter.votes_into_planes(device, group) for _, _, _, group, _, _ in calls):
        return False
    grads = [p.grad for u in units for p in u.ps]
    if not all(type(g) is DTensor for g in grads):
        return False
    gs = list(map(_local, grads))
    ms = [opt.state[p].get("exp_avg") for u in units for p in u.ps]
    shards = [e[3] for u in units for e in u.entries]
    if any(m is None for m in ms) or not all(map(_contiguous, gs)) or not all(map(_contiguous, ms)):
        return False
    if not all(map(_contiguous, shards)) or not all(fused_for.many(ms, gs)):
        return False
    planes = lion_math.VotedPlanes(None, None, 0, 0)  # (what the apply's verdict reads of a Delta)
    return all(fused_for.many(shards, [planes] * len(shards)))


class FSDP2Plan:
    """An FSDP2 model's planned step (see the module's text): :meth:`start`
    replays it where it describes the step; :meth:`learn` plans from a step
    of the general path."""

    def __init__(self):
        self.layout: Optional[_Layout] = None
        self.replayed = 0  # steps voted as planned (counted once every rank agreed to them)

    def learn(self, att, units, calls, fused_for) -> None:
        """Plans the step the general path just started: ``units``
        (fsdp._UnitVote, with the parameters that had a gradient) and
        ``calls`` (units, their first elements in a shard, elements in a
        shard, process group, replicated (HSDP), where), where a plan can
        replay it."""
        self.layout = _Layout(att, units, calls) if plannable(att, units, calls, fused_for) else None

    def start(self, att):
        """Starts the step's votes as planned; returns (agreements, works,
        the momentum update, the apply), as fsdp's general
        path does, or None where the plan does not describe the step
        (nothing done). Raises :class:`step_vote.NonFinite` as the general
        path does."""
        lay = self.layout
        gs = None if lay is None else lay.grads(att)
        if gs is None:
            self.layout = None
            return None
        opt = att.opt
        voter = opt.voter
        coefs = [lion_math.Coefs(g) for g in opt.param_groups]
        agreed, works = [], []
        for v in lay.votes:
            sign, zero, delta = v.buffers(voter, lay.device)
            counts = torch.zeros(2, dtype=torch.int64, device=lay.device) if lay.cuda else None
            bad = sum(lion_math.directions_into(c.grads(gs), c.ms, c.offsets, c.starts, c.lengths, coefs[c.group],
                                                sign, zero, counts, m_outs=c.outs) for c in v.directions)
            tally = counts[1:] if lay.cuda else None
            works.append(voter.start_sharded(sign, zero, v.numel, bad, delta, v.group, v.where, v.replicated,
                                             out_planes=True, nans_tally=tally, agreed=agreed))

        def momenta() -> None:
            if lay.spares is not None:  # the next momenta are in the second buffers: swapped in
                next_momenta.swap(lay.momenta, lay.spares)
                return
            for c in lay.updates:
                lion_math.momenta_from(c.grads(gs), c.ms, coefs[c.group])

        def apply() -> None:
            for v in lay.votes:
                delta = v.kept.delta
                half = delta.numel() // 2
                for c in v.applies:
                    lion_math.apply_planes(c.xs, delta[:half], delta[half:], c.offsets, coefs[c.group])

        return agreed, works, momenta, apply
