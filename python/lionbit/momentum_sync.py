"""Momentum synchronization (Lion Cub, Ishikawa et al. 2024): each rank's
momentum sees only its own gradients and drifts from the others'; now and
then the ranks average their momenta.

``DistributedLion(momentum_sync=k)`` averages them after every k-th step;
``momentum_sync=ExponentialSync(first, factor)`` at exponentially growing
intervals; any callable ``step -> bool`` decides itself (``step`` counts the
steps applied so far, 1 after the first; it must answer alike on every rank).
A step that GradScaler skips is not counted. The counter is kept in every
parameter group (key ``"step"``), so it travels in every checkpoint format
and a resumed run synchronizes at the same steps as an uninterrupted one.

What travels, and how it is rounded
-----------------------------------
``momentum_sync_dtype`` (T below) is torch.bfloat16 (the default) or
torch.float32. All momenta of the optimizer on one device are laid out in
one flat buffer of T (in parameter order; padded with zeros to N * S
elements, S = ceil(d / N)), and then, over lionbit's forwarded transport
(Gloo for CPU tensors, NCCL or Gloo for CUDA ones), in the caller's order:

1. an all-to-all of the buffer: rank r receives chunk r (S elements) of
   every rank's momenta;
2. rank r sums its N chunks in float64 (in rank order 0, 1, ..., N - 1;
   exact for bfloat16 values whose magnitudes are within 2^45 of each other,
   float32 ones within 2^29), divides by N in float64 and rounds the mean to
   T (torch's float64 -> bfloat16 conversion passes through float32);
3. an all-gather of the rounded chunks: every rank receives every chunk's
   mean, and copies it into its momenta (exactly, unless T is float32 and
   the momenta bfloat16: then rounded once more).

After a synchronization every rank's momentum is bitwise the same:
``T(mean_float64(T(m_0), ..., T(m_{N-1})))`` -- each chunk's mean is
computed once, by its owner, and copied to the others, so the result does
not depend on how a transport orders a reduction. Bytes per rank and
synchronization: (N - 1) * S * size(T) in each collective, 2 (N - 1)/N *
size(T) * N*S in all -- a ring all-reduce's figure for the buffer: 4 (N -
1)/N bytes per momentum element in bfloat16, 8 (N - 1)/N in float32 (the
Lion Cub authors' choice). Buffers: two of N*S of T, one of S float64 and
one of S of T per piece (4 + 10/N bytes per momentum element in bfloat16,
8 + 12/N in float32); a model of more than ``PIECE_ELEMENTS`` momentum
elements goes in pieces of that size (2 collectives each), which bounds the
memory a synchronization borrows.

Why bfloat16 by default: a synchronization is a dense exchange, 16 times
(bfloat16) or 32 times (float32) the bytes of a step's 1-bit vote, and what
the momentum decides is a sign; the error below (under 1 % of the ranks'
mean |m|) moves the sign of only the elements that were already at about 0.
Choose float32 for the authors' exact setting, or when the momenta are
float32 and the sync is rare enough that its bytes do not matter.

Why this and not a bfloat16 all-reduce (pre-divided by N, or divided
after): a transport's bfloat16 SUM rounds every partial sum to bfloat16
(N - 1 roundings, in an order of the transport's choosing, which also
decides whether the ranks get the same bits), on top of the rounding of each
input. Measured over Gloo on 200k elements of correlated float32 momenta (a
common part plus per-rank noise of 0.1x or 1x its size, magnitudes over six
decades) against the float64 mean of the float32 momenta; bfloat16's unit
roundoff is u = 2^-8 = 3.9e-3. Maximal error in units of the ranks' mean
|m_i|: pre-divided bfloat16 all-reduce 7.7e-3 (N=2), 9.2e-3 (N=3),
1.1e-2 (N=4), 1.3e-2 (N=8); this scheme 7.7e-3, 6.7e-3, 6.5e-3, 5.8e-3,
within the bound 2u of one rounding of each input and one of the result.
Maximal error relative to the mean itself, where the momenta do not cancel
(|mean| >= mean |m_i| / 4): 1.5e-2 at most (2.6e-2 for the all-reduce; the
inputs' roundings, u * mean |m_i| / |mean|), 1.4e-3 to 1.7e-3 median. With
bfloat16 momenta the inputs travel exactly and the mean is rounded once:
relative error <= u (measured 3.9e-3). (An all-gather of every rank's
bfloat16 momentum, averaged locally without the final rounding, halves the
error for float32 momenta, but sends N - 1 times the buffer per rank instead
of 2 (N - 1)/N times.)

Under DDP and a plain module the momenta are ``opt.state[p]["exp_avg"]`` of
every trainable parameter; under FSDP2 each rank's full-size momentum per
parameter (lionbit.fsdp); under FSDP1 the full-size flat momentum of every
FSDP instance, its parameters' segments only (lionbit.fsdp1). With one rank,
or without a process group, a synchronization does nothing. The counters
``momentum_sync_*`` of :func:`lionbit.stats` count what it sent.
"""

import bisect
import math
import numbers
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from ._backend import backend_for, record_momentum_sync, record_momentum_sync_step

#: Momentum elements per piece of a synchronization (2 collectives each):
#: big enough that a model of up to 64 Mi parameters goes in one piece,
#: small enough that the buffers stay small (4 + 10/N bytes per element:
#: 576 MiB at N = 2, 416 MiB at N = 4).
PIECE_ELEMENTS = 1 << 26


class ExponentialSync:
    """Synchronize after step ``first``, then after intervals that grow by
    ``factor`` each time: at steps first, first + i_1, first + i_1 + i_2, ...
    with i_k = max(1, floor(first * factor^k)) (the float product kept from
    one interval to the next). ``factor=1`` is every ``first`` steps."""

    def __init__(self, first: int = 10, factor: float = 2.0):
        if isinstance(first, bool) or not isinstance(first, numbers.Integral) or first < 1:
            raise ValueError(f"ExponentialSync: argument 'first' must be an int >= 1, got {first!r}")
        if (
            isinstance(factor, bool)
            or not isinstance(factor, numbers.Real)
            or not math.isfinite(factor)
            or not factor >= 1.0
        ):
            raise ValueError(f"ExponentialSync: argument 'factor' must be a finite number >= 1, got {factor!r}")
        self.first, self.factor = int(first), float(factor)
        self._cursor = (self.first, float(self.first))  # a synchronization step and the interval that led to it

    def __call__(self, step: int) -> bool:
        if self.factor == 1.0:
            return step >= self.first and step % self.first == 0
        # The steps are asked in order: go on from the last answer (restart
        # when asked about an earlier step), so a long run costs O(1) a step.
        at, interval = self._cursor
        if step < at:
            at, interval = self.first, float(self.first)
        while at < step:
            interval *= self.factor
            at += max(1, int(interval))
        self._cursor = (at, interval)
        return at == step

    def __repr__(self) -> str:
        return f"ExponentialSync(first={self.first}, factor={self.factor})"


class Sync(NamedTuple):
    """When to synchronize (``step -> bool``) and in which dtype."""

    when: Callable[[int], bool]
    dtype: torch.dtype


def schedule(momentum_sync, dtype=torch.bfloat16) -> Optional[Sync]:
    """The synchronization of a ``momentum_sync`` argument, in ``dtype``
    (the ``momentum_sync_dtype`` argument); None: never."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"DistributedLion: argument 'momentum_sync_dtype' must be torch.bfloat16 or torch.float32, "
                         f"got {dtype!r}")
    when = _when(momentum_sync)
    return None if when is None else Sync(when, dtype)


def _when(momentum_sync) -> Optional[Callable[[int], bool]]:
    if momentum_sync is None:
        return None
    if isinstance(momentum_sync, bool):
        raise ValueError(f"DistributedLion: argument 'momentum_sync' must be None, an int k >= 1 or a callable, "
                         f"got {momentum_sync!r}")
    if isinstance(momentum_sync, numbers.Integral):
        if momentum_sync < 1:
            raise ValueError(f"DistributedLion: argument 'momentum_sync' must be an int k >= 1, got {momentum_sync}")
        k = int(momentum_sync)
        return lambda step: step % k == 0
    if callable(momentum_sync):
        return momentum_sync
    raise ValueError(f"DistributedLion: argument 'momentum_sync' must be None, an int k >= 1 or a callable, "
                     f"got {type(momentum_sync).__name__}")


def after_step(sync: Optional[Sync], step: int, attachment) -> None:
    """Called by the optimizer after step number ``step`` was applied on
    every rank: counts it (for the amortized bytes in lionbit.stats) and, if
    the schedule says so, averages the attachment's momenta across its group."""
    if sync is None:
        return
    record_momentum_sync_step(attachment.group)
    if sync.when(step):
        for momenta, group in attachment.momentum_groups():
            synchronize(momenta, group, sync.dtype)


def synchronize(momenta: List[torch.Tensor], group, dtype=torch.bfloat16) -> None:
    """Average ``momenta`` (the same layout on every rank) across the ranks
    of ``group``, through buffers of ``dtype`` (see the module's docstring).
    Every rank must call it at the same point."""
    if not dist.is_initialized():
        return
    n = dist.get_world_size(group)
    if n == 1:
        return
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for m in momenta:
        by_device.setdefault(m.device, []).append(m)
    counted = set()
    for device, ms in by_device.items():
        backend = backend_for(group, device, "DistributedLion (momentum sync)")  # lionbit, or a clear error
        elements, sent = _average(ms, n, group, device, dtype)
        record_momentum_sync(group, device, elements, sent, sent, call=id(backend) not in counted)
        counted.add(id(backend))


def _average(ms: List[torch.Tensor], n: int, group, device, dtype) -> tuple:
    """Averages the tensors ``ms`` (one device) across the ranks in place,
    through buffers of ``dtype``. Returns (elements, bytes this rank sent =
    bytes it received)."""
    flats = []
    copies = []  # (momentum, contiguous copy) of non-contiguous momenta, written back at the end
    for m in ms:
        if m.is_contiguous():
            flats.append(m.view(-1))
        else:
            c = m.contiguous().view(-1)
            flats.append(c)
            copies.append((m, c))
    starts = [0]
    for f in flats:
        starts.append(starts[-1] + f.numel())
    total = starts[-1]
    sent = 0
    for lo in range(0, total, PIECE_ELEMENTS):
        hi = min(total, lo + PIECE_ELEMENTS)
        s = -(-(hi - lo) // n)
        buf = torch.empty(n * s, dtype=dtype, device=device)
        buf[hi - lo :].zero_()
        for f, a, b, at in _spans(flats, starts, lo, hi):
            buf[at : at + b - a].copy_(f[a:b])  # round to nearest even where dtype is narrower
        got = torch.empty_like(buf)
        dist.all_to_all_single(got, buf, group=group)
        parts = got.view(n, s)
        acc = parts[0].to(torch.float64)
        for r in range(1, n):
            acc.add_(parts[r])
        mean = acc.div_(n).to(dtype)
        dist.all_gather_into_tensor(buf, mean, group=group)
        for f, a, b, at in _spans(flats, starts, lo, hi):
            f[a:b].copy_(buf[at : at + b - a])
        sent += 2 * (n - 1) * s * buf.element_size()
    for m, c in copies:
        m.copy_(c.view_as(m))
    return total, sent


def _spans(flats, starts, lo: int, hi: int):
    """(flat tensor, first, end, position in the piece) of every part of the
    flat tensors that lies in [lo, hi) of their concatenation."""
    i = bisect.bisect_right(starts, lo) - 1
    while i < len(flats) and starts[i] < hi:
        a, b = max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]
        if b > a:
            yield flats[i], a, b, starts[i] + a - lo
        i += 1
