"""A plain module's step, planned once and replayed.

A step of ``step_vote``'s general path does Python work for every tensor
(its entry, its momentum looked up, its fused verdict, its place in a vote,
its Delta's view), ~5 us a tensor: 1.5-2 ms a step for a GPT-2-medium's 292
tensors, longer than a GPU takes for the step itself. Most steps are the
same step as the one before: the same parameters with a gradient, of the
same dtypes, the same momenta. A plan keeps what such a step computes from
its tensors (which tensors go in which call, their bit offsets, their
momenta) and replays it: a step reads the gradients (``p.grad``), checks that
the plan still describes them, and makes a few calls into C++ (a step's
directions per vote, parameter group and dtype pair; the votes; the momenta;
the parameters) with no Python code a tensor.

The plan covers the common step: every tensor served by the fused list
kernels, contiguous, on one device, voted (aggregation "vote", flat) into
planes. It is made from a step that the general path took, and dropped for
any step it does not describe: a gradient missing or present where it was
not, a non-contiguous gradient or parameter (``p.data`` replaced, a
``channels_last`` conversion), other dtypes or devices, another parameter
list or group, a momentum that is not the one it holds, another choice of kernels;
that step takes the general path, and the next is planned again. Both paths
run the same kernels on the same tensors: bit for bit the same step.
"""

from itertools import compress, repeat
from operator import attrgetter, eq, is_, is_not, methodcaller
from typing import Callable, List, Optional

import torch

from . import kernel_choice, lion_math, next_momenta, step_vote

_grad, _dtype, _device = attrgetter("grad"), attrgetter("dtype"), attrgetter("device")
_contiguous, _numel = methodcaller("is_contiguous"), methodcaller("numel")
_exp_avg = methodcaller("get", "exp_avg")  # (of a parameter's state; None where it has none)


class _Call:
    """One call of the list kernels: the step's tensors ``idx`` (positions in
    its list of parameters with a gradient) of parameter group ``group``,
    their momenta and bit offsets in their vote's planes."""

    __slots__ = ("group", "idx", "ms", "outs", "offsets", "xs")

    def __init__(self, group: int, idx: List[int], params, momenta, offsets, spares=None):
        self.group, self.idx = group, idx
        self.xs = [params[i] for i in idx]
        self.ms = [momenta[i] for i in idx]
        self.outs = None if spares is None else [spares[i] for i in idx]  # the momenta's second buffers
        self.offsets = [offsets[i] for i in idx]

    def grads(self, gs) -> list:
        return list(map(gs.__getitem__, self.idx))


def _calls(group_of, params, momenta, offsets, idx, kind, spares=None) -> List[_Call]:
    """The tensors ``idx`` as list-kernel calls, one per parameter group and
    ``kind`` (what one launch must share: on a GPU the dtypes), in order."""
    calls = {}
    for i in idx:
        calls.setdefault((group_of[i], kind(i)), []).append(i)
    return [_Call(g, ii, params, momenta, offsets, spares) for (g, _), ii in calls.items()]


class _Layout:
    """What a planned step replays, and what it must find to replay it."""

    def __init__(self, opt, entries, group):
        self.param_groups = opt.param_groups
        self.groups = [(g, list(g["params"])) for g in opt.param_groups]
        self.masks = [tuple(p.grad is not None for p in params) for _, params in self.groups]
        self.params = [e.param for e in entries]
        self.momenta = [e.momentum for e in entries]
        self.dtypes = tuple(map(_dtype, self.params))
        self.state = opt.state
        self.config = _config(opt, self.params[0].device, group)
        self.device = self.params[0].device
        self.cuda = self.params[0].is_cuda
        self.sizes = [e.numel for e in entries]
        group_of = []
        for gi, mask in enumerate(self.masks):
            group_of += [gi] * sum(mask)
        # Each tensor's bit offset in its vote's planes (VoteBuffers' chunks), and each vote's calls.
        self.chunks = step_vote.chunking(self.sizes, step_vote.chunk_limit(self.device))
        offsets = [0] * len(self.params)
        for first, end, _ in self.chunks:
            at = 0
            for i in range(first, end):
                offsets[i] = at
                at += self.sizes[i]
        pair = (lambda i: (self.dtypes[i], self.momenta[i].dtype)) if self.cuda else (lambda i: None)
        dtype = (lambda i: self.dtypes[i]) if self.cuda else (lambda i: None)
        # double_buffer=True: each direction call writes the next momenta into the second buffers,
        # which the agreement swaps in (lionbit.next_momenta); else the momenta are updated then.
        nexts = opt.next_momenta
        self.spares = None if nexts is None else list(map(nexts.spare, self.momenta))
        self.directions = [_calls(group_of, self.params, self.momenta, offsets, range(first, end), pair, self.spares)
                           for first, end, _ in self.chunks]
        self.applies = [_calls(group_of, self.params, self.momenta, offsets, range(first, end), dtype)
                        for first, end, _ in self.chunks]
        self.updates = _calls(group_of, self.params, self.momenta, offsets, range(len(self.params)), pair)

    def grads(self, opt, group) -> Optional[list]:
        """This step's gradients, in the plan's order, if the plan describes
        the step (else None)."""
        groups = opt.param_groups
        if groups is not self.param_groups or len(groups) != len(self.groups) or opt.state is not self.state:
            return None
        gs = []
        for (g, params), mask, now in zip(self.groups, self.masks, groups):
            ps = now["params"]
            if g is not now or len(ps) != len(params) or not all(map(is_, ps, params)):
                return None
            mine = list(map(_grad, ps))
            if tuple(map(is_not, mine, repeat(None))) != mask:
                return None
            gs += compress(mine, mask)
        if (not all(map(_contiguous, gs)) or tuple(map(_dtype, gs)) != self.dtypes
                or list(map(_numel, gs)) != self.sizes
                or not all(map(_contiguous, self.params)) or tuple(map(_dtype, self.params)) != self.dtypes
                or not all(map(eq, map(_device, self.params), repeat(self.device)))
                or not all(map(is_, map(_exp_avg, map(opt.state.get, self.params, repeat({}))), self.momenta))
                or _config(opt, self.device, group) != self.config):
            return None
        return gs


def _config(opt, device, group) -> tuple:
    """What the plan's choice of kernels and vote rests on, besides the tensors."""
    return (opt.momentum_dtype, opt.fused, opt.voter.votes_into_planes(device, group), step_vote.chunk_limit(device),
            kernel_choice.list_kernels_allowed(device), kernel_choice.fused_lion_allowed(device))


def plannable(opt, entries, group) -> bool:
    """Whether a plan can replay the step of ``entries``: the common step (see the module's text)."""
    if not entries or opt.voter.bits:
        return False
    device = entries[0].param.device
    return (all(e.fused and not e.abstain and e.grad is e.param.grad and e.param.is_contiguous()
                and e.param.device == device for e in entries)
            and opt.voter.votes_into_planes(device, group) and kernel_choice.list_kernels_allowed(device)
            and (opt.next_momenta is None or all(e.momentum.is_contiguous() for e in entries)))


class StepPlan:
    """A plain module's planned step (see the module's text): :meth:`vote`
    replays it where it describes the step; :meth:`learn` plans from a step
    of the general path."""

    def __init__(self):
        self.layout: Optional[_Layout] = None
        self.replayed = 0  # steps voted as planned

    @property
    def params(self) -> list:
        """The parameters the plan steps (those with a gradient)."""
        return self.layout.params

    def learn(self, opt, entries, group) -> None:
        """Plans the step of ``entries`` (the general path's) where a plan can replay it."""
        self.layout = _Layout(opt, entries, group) if plannable(opt, entries, group) else None

    def vote(self, opt, group, buffers) -> Optional[Callable[[], None]]:
        """Votes the step as planned and returns the function that applies it;
        the momenta change once every rank has agreed to the votes, while
        their bits still move (as the general path's, step_vote.vote_chunks).
        None where the plan does not describe the step (nothing done). Raises
        :class:`step_vote.NonFinite` as the general path does, changing
        nothing."""
        lay = self.layout
        gs = None if lay is None else lay.grads(opt, group)
        if gs is None:
            self.layout = None
            return None
        coefs = [lion_math.Coefs(g) for g in opt.param_groups]
        voter = opt.voter
        buffers.prepare(lay.sizes, lay.device, voter.delta_dtype, None, True)
        works, agreed = [], []
        for (_, _, total), (sign, zero), out, calls in zip(lay.chunks, buffers.planes, buffers.outs, lay.directions):
            counts = torch.zeros(2, dtype=torch.int64, device=lay.device) if lay.cuda else None
            bad = sum(lion_math.directions_into(c.grads(gs), c.ms, c.offsets, None, None, coefs[c.group], sign, zero,
                                                counts, m_outs=c.outs) for c in calls)
            works.append(voter.all_reduce(sign, zero, total, bad, out, group, "step", out_planes=True,
                                          nans_tally=counts[1:] if lay.cuda else None, agreed=agreed))
        step_vote.wait_votes(agreed)  # every rank agreed: no direction non-finite anywhere
        # The momenta, while the votes' bits still move: the second buffers swapped in, or updated from g.
        if lay.spares is not None:
            next_momenta.swap(lay.momenta, lay.spares)
        else:
            for c in lay.updates:
                lion_math.momenta_from(c.grads(gs), c.ms, coefs[c.group])
        step_vote.wait_votes(works)
        outs = list(buffers.outs)

        def apply() -> None:
            for out, calls in zip(outs, lay.applies):
                half = out.numel() // 2
                for c in calls:
                    lion_math.apply_planes(c.xs, out[:half], out[half:], c.offsets, coefs[c.group])

        self.replayed += 1
        return apply
