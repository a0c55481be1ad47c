"""The Lion arithmetic every path of DistributedLion shares (DDP, FSDP2,
FSDP1, a plain module): no process groups here.

Per element, with every float32 operation rounded on its own and no fused
multiply-add (the fused C++ kernels and the torch ops below give the same
bits; the coefficients are computed in float64 and rounded once)::

    c     = fl(fl(b1 * m) + fl((1 - b1) * g))       # direction = sign(c)
    m_new = fl(fl(b2 * m) + fl((1 - b2) * g))
    x_new = fl(fl(x * (1 - lr * wd)) - fl(lr * Delta))

A float64 parameter's x_new is computed the same way in float64 (its
coefficients rounded once to float64): in float32 every step would round
the parameter to float32. Its direction and momentum follow the float32
contract (the momentum is float32 or bfloat16).

A step is split so that nothing changes before every rank knows the step
is good: :func:`pack_direction` reads g and m and writes only bits (and
counts non-finite directions), the vote runs, then :func:`update_momentum`
and :func:`apply_update` change the state.
"""

from functools import partial
from operator import attrgetter, itemgetter

import torch

from . import _C


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


class Coefs:
    """A parameter group's hyperparameters: the float64 values of the
    contract (the fused kernels round them to float32) and, made at first
    use, their float32 tensors (for the torch path): a step builds one per
    parameter, and the fused kernels never need the tensors."""

    def __init__(self, group: dict):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        self.values = (b1, 1.0 - b1, b2, 1.0 - b2, lr, 1.0 - lr * wd)
        self._tensors = None

    def tensors(self) -> tuple:
        """(b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd) as float32 tensors."""
        if self._tensors is None:
            self._tensors = tuple(_f32(v) for v in self.values)
        return self._tensors


def coefs_by_param(param_groups) -> dict:
    """Every parameter's hyperparameters as they stand now, one Coefs a
    parameter group (a step asks once, not once a parameter)."""
    out = {}
    for group in param_groups:
        coefs = Coefs(group)
        for p in group["params"]:
            out[p] = coefs
    return out


class CoefsIndex:
    """Each parameter's group, kept while the groups' membership stays the
    same, for :meth:`coefs` of a few parameters at a time (a DDP bucket's):
    coefs_by_param would hash every parameter of the model for each."""

    def __init__(self):
        self.groups, self.sizes, self.index = None, None, {}

    def coefs(self, param_groups, params) -> list:
        """The hyperparameters of each of ``params`` as they stand now (a Coefs a group, shared)."""
        sizes = [len(g["params"]) for g in param_groups]
        if param_groups is not self.groups or sizes != self.sizes:
            self.index = {p: i for i, g in enumerate(param_groups) for p in g["params"]}
            self.groups, self.sizes = param_groups, sizes
        coefs = [Coefs(g) for g in param_groups]
        return [coefs[i] for i in map(self.index.__getitem__, params)]


def plane_bytes(numel: int) -> int:
    return (numel + 63) // 64 * 8


def shard_bit(r: int, shard_numel: int) -> int:
    """The reduce-scatter's layout: shard r of ``shard_numel`` elements starts
    at bit r * 64 * ceil(shard_numel / 64) of the planes (on a 64-bit word)."""
    return r * 64 * ((shard_numel + 63) // 64)


def planes(numel: int, device=None, bits=None):
    """Buffers for the packed directions of ``numel`` elements: the sign and
    zero planes, or with ``bits`` (aggregation "l1") ``bits`` planes of
    levels in one buffer and None."""
    nbytes = plane_bytes(numel)
    if bits:
        return torch.zeros(bits * nbytes, dtype=torch.uint8, device=device), None
    return (
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
    )


class VotedPlanes:
    """One tensor's Delta as a vote's result planes (the sign all-reduce's
    ``out_planes``): element i is bit ``offset + i`` of ``sign`` (+1) and
    ``zero`` (0; it wins); -1 where neither bit is set. 2 bits an element
    where a bfloat16 Delta takes 16: the DDP hook's votes on the CPU."""

    __slots__ = ("sign", "zero", "offset", "numel")

    #: What the fused kernels' verdict (DistributedLion.fused_for(x, delta))
    #: reads of a Delta: the dtype of its values (-1, 0, +1), always contiguous.
    dtype = torch.bfloat16

    def __init__(self, sign, zero, offset: int, numel: int):
        self.sign, self.zero, self.offset, self.numel = sign, zero, offset, numel

    @staticmethod
    def is_contiguous() -> bool:
        return True

    def values(self) -> torch.Tensor:
        """Delta as a bfloat16 tensor (-1, 0, +1: what the unpack writes)."""
        w0, w1 = self.offset // 64, (self.offset + self.numel + 63) // 64
        shifts = torch.arange(64, dtype=torch.int64, device=self.sign.device)

        def bits(plane):
            words = plane.view(torch.int64)[w0:w1]
            start = self.offset - 64 * w0
            return ((words.unsqueeze(1) >> shifts) & 1).reshape(-1)[start : start + self.numel]

        s, z = bits(self.sign), bits(self.zero)
        return torch.where(z.bool(), 0, 2 * s - 1).to(torch.bfloat16)


def delta_views(out: torch.Tensor, into_planes: bool):
    """(offset, numel) -> that span's Delta in a vote's result ``out``: a view
    of its values, or (``into_planes``: uint8, the sign plane then the zero
    plane) a :class:`VotedPlanes`."""
    if not into_planes:
        return lambda off, n: out[off : off + n]
    half = out.numel() // 2
    return partial(VotedPlanes, out[:half], out[half:])


def dense_layout(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory without gaps or overlaps
    in some order of its dims (torch's "non-overlapping and dense":
    contiguous, channels_last, a transpose): a copy of it is contiguous and
    its memory is a permutation of that copy's."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def fusable_layout(t: torch.Tensor) -> bool:
    """Whether the fused kernels take t as a parameter: contiguous, or of
    another dense layout (channels_last), updated through a contiguous copy
    (lionbit.step_vote.update_state)."""
    return t.is_contiguous() or dense_layout(t)


def _fusable(g, m) -> bool:
    """Whether the fused L1 passes take g and m (lion_direction's dtypes)."""
    return (
        g.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and m.dtype in (torch.float32, torch.bfloat16)
        and g.is_contiguous()
        and m.is_contiguous()
    )


def level_factor(pieces, k: Coefs, bits: int) -> float:
    """The L1 scale of one parameter tensor's pre-sign update
    c = b1 m + (1 - b1) g, given as the pieces (g, m, bit_offset):
    q = clamp(rint(c * factor), -s, s) with factor = s / (2 * mean|c|),
    s = 2^(bits-1) - 1, mean|c| summed in float64 (Lion Cub's
    q = clip(round(c / mean|c| * s/2), -s, s)); each piece's sum|c| is one
    fused pass over g and m (optimizer/lion_levels.h) where the dtypes allow.
    0 when c is all zero (every q is 0) or not finite (the step is refused
    anyway)."""
    total = sum(g.numel() for g, _, _ in pieces)
    if total == 0:
        return 0.0
    b1, omb1 = k.values[0], k.values[1]
    acc = 0.0
    for g, m, _ in pieces:
        if _fusable(g, m):
            acc += _C.lion_level_abs_sum(g.reshape(-1), m.reshape(-1), b1, omb1)
        else:
            acc += float(direction(g, m, k).abs().sum(dtype=torch.float64))
    mean = acc / total
    if not (mean > 0.0 and mean < float("inf")):
        return 0.0
    return ((1 << (bits - 1)) - 1) / (2.0 * mean)


def pack_levels(c, factor: float, bits: int, levels, bit_offset: int) -> int:
    """ORs the ``bits``-bit levels of c (float32, on the planes' device) into
    the planes of ``levels`` at bit_offset; returns the number of non-finite
    values."""
    return _C.pack_levels_into(c.reshape(-1).contiguous(), factor, bits, levels, bit_offset)


def _direction_torch(g, m, k: Coefs):
    b1, omb1 = k.tensors()[:2]
    return torch.add(torch.mul(m.float(), b1), torch.mul(g.float(), omb1))


def direction(g, m, k: Coefs) -> torch.Tensor:
    """c = fl(fl(b1 m) + fl((1 - b1) g)) in float32 (a new tensor)."""
    return _direction_torch(g.reshape(-1), m.reshape(-1), k)


def pack_levels_pieces(pieces, k: Coefs, bits: int, levels) -> int:
    """The "l1" packing of one parameter tensor given as pieces
    (g, m, bit_offset): its L1 scale over all the pieces first
    (:func:`level_factor`), then each piece's levels packed at its offset in
    a second fused pass over g and m (m is only read). Returns the
    non-finite count."""
    factor = level_factor(pieces, k, bits)
    b1, omb1, b2, omb2 = k.values[:4]
    bad = 0
    for g, m, off in pieces:
        if _fusable(g, m):
            bad += _C.lion_pack_levels_into(
                g.reshape(-1), m.view(-1), b1, omb1, b2, omb2, factor, bits, levels, off, False
            )
            continue
        bad += pack_levels(direction(g, m, k), factor, bits, levels, off)
    return bad


def pack_direction(g, m, k: Coefs, sign, zero, bit_offset: int, fused: bool, bits=None, counts=None,
                   m_out=None) -> int:
    """ORs the bits of sign(b1 m + (1 - b1) g) into the uint8 planes at
    bit_offset (on g's device); m is only read. Returns the number of
    non-finite directions (NaN or +-Inf: a non-finite g or m). With ``bits``
    (aggregation "l1"): the levels of c = b1 m + (1 - b1) g, scaled by this
    tensor's mean |c|, into the level planes ``sign`` (zero: None).
    ``counts`` (int64 (zeros, non-finite) on g's GPU): the fused GPU kernel
    adds its tallies there and this returns 0, so that a caller reads them
    once for many tensors (a read is a host round trip). ``m_out`` (fused
    only, m's size and dtype, contiguous): the new momentum
    fl(fl(b2 m) + fl((1 - b2) g)) is written there in the same pass."""
    g = g.reshape(-1)
    if bits:
        return pack_levels_pieces([(g, m.reshape(-1), bit_offset)], k, bits, sign)
    if fused:
        b1, omb1, b2, omb2, _, _ = k.values
        update, out = m_out is not None, None if m_out is None else m_out.view(-1)
        if not g.is_cuda:
            return _C.lion_direction_into(g, m.view(-1), b1, omb1, b2, omb2, sign, zero, bit_offset,
                                          update_momentum=update, m_out=out)
        mine = counts if counts is not None else torch.zeros(2, dtype=torch.int64, device=g.device)
        _C.lion_direction_into_device(g, m.view(-1), b1, omb1, b2, omb2, sign, zero, mine, bit_offset,
                                      update_momentum=update, m_out=out)
        return 0 if counts is not None else int(mine[1])
    if m_out is not None:
        raise ValueError("lionbit.lion_math.pack_direction: m_out needs the fused kernels")
    c = _direction_torch(g, m.reshape(-1), k)
    _, nans = _C.pack_signs_into(c, sign, zero, bit_offset)
    return nans + int(torch.isinf(c).sum())


_dtype, _first, _second = attrgetter("dtype"), itemgetter(0), itemgetter(1)


def _by_dtypes(items):
    """``items`` grouped by the dtypes of their first two tensors, in order
    (one pair, the common case, read in C)."""
    if len(set(zip(map(_dtype, map(_first, items)), map(_dtype, map(_second, items))))) == 1:
        return [items]
    groups = {}
    for item in items:
        groups.setdefault((item[0].dtype, item[1].dtype), []).append(item)
    return groups.values()


def pack_directions_list(items, k: Coefs, sign, zero, counts=None) -> int:
    """:func:`pack_direction` of many tensors on one device in one call (the
    list kernels; on a GPU a launch per dtype pair): ``items`` are (g, m,
    bit_offset, start, length[, m_out]): elements [start, start + length) of
    g and m (each contiguous, of any shape, in the fused kernels' dtypes; m
    only read), so that the pieces of a tensor need no view each; with
    m_out (None or m's second buffer, lionbit.next_momenta), the new momentum
    of those elements written there. On a GPU the tallies are added to
    ``counts`` and this returns 0; on the CPU it returns the non-finite
    count."""
    groups = [items] if not items[0][0].is_cuda else _by_dtypes(items)
    bad = 0
    for group in groups:
        cols = list(zip(*group))
        outs = cols[5] if len(cols) > 5 else None
        if outs is not None and None in outs:  # (some pairs' momenta are updated after the agreement)
            bad += pack_directions_list([item[:5] for item in group if item[5] is None], k, sign, zero, counts)
            group = [item for item in group if item[5] is not None]
            if not group:
                continue
            cols = list(zip(*group))
            outs = cols[5]
        bad += directions_into(*cols[:5], k, sign, zero, counts, m_outs=outs)
    return bad


def directions_into(gs, ms, offsets, starts, lengths, k: Coefs, sign, zero, counts=None, m_outs=None) -> int:
    """:func:`pack_directions_list` of lists given column by column (starts
    and lengths None: whole tensors); on a GPU one dtype pair, its tallies
    added to ``counts``; ``m_outs``: each pair's new momentum written there."""
    b1, omb1, b2, omb2, _, _ = k.values
    update, outs = m_outs is not None, None if m_outs is None else list(m_outs)
    if not gs[0].is_cuda:
        return _C.lion_direction_list(gs, ms, b1, omb1, b2, omb2, sign, zero, offsets, update_momentum=update,
                                      starts=starts, lengths=lengths, m_outs=outs)
    _C.lion_direction_list_device(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, offsets, update_momentum=update,
                                  starts=starts, lengths=lengths, m_outs=outs)
    return 0


def span(t, start: int, length: int):
    """Elements [start, start + length) of t, flat (t itself when that is all of it)."""
    return t if start == 0 and length == t.numel() else t.reshape(-1)[start : start + length]


def update_momenta(items, k: Coefs) -> None:
    """:func:`update_momentum` of many (g, m) pairs (contiguous, of any
    shape) on one device in one call (on a GPU a launch per dtype pair)."""
    for group in [items] if not items[0][0].is_cuda else _by_dtypes(items):
        momenta_from(*zip(*group), k)


def momenta_from(gs, ms, k: Coefs, starts=None, lengths=None) -> None:
    """:func:`update_momenta` of lists given column by column (on a GPU one
    dtype pair); with ``starts`` and ``lengths``, elements [start, start +
    length) of each pair (flat indices), as :func:`directions_into`."""
    b1, omb1, b2, omb2, _, _ = k.values
    if not gs[0].is_cuda:
        _C.lion_direction_list(gs, ms, b1, omb1, b2, omb2, None, None, [0] * len(gs), update_momentum=True,
                               starts=starts, lengths=lengths)
        return
    _C.lion_direction_list_device(gs, ms, b1, omb1, b2, omb2, None, None, None, [0] * len(gs), update_momentum=True,
                                  starts=starts, lengths=lengths)


_sign, _offset = attrgetter("sign"), attrgetter("offset")

#: The tensor types whose memory the kernels write as it is.
PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_NO_DISPATCH = torch.Tensor.__torch_dispatch__  # (a subclass that overrides it may keep no memory of its own)


def memory_of(x: torch.Tensor):
    """x itself where it is a plain tensor or a subclass that leaves torch's
    dispatch alone (its memory is its own). Else a plain view of the memory
    that holds its values, what its own in-place ops change: its
    ``aten.alias``, provided that is of x's shape, dtype and strides and
    lies in x's own memory or in a tensor x holds (its
    ``__tensor_flatten__`` names them). A wrapper that casts on use, such as
    torchao's float8 training weights (which FSDP2 shards as they are), has
    no memory of its own (its data pointer is null) and keeps its values in
    a tensor it holds. None where no such memory exists: a quantized or
    packed form, whose alias would be a new tensor, computed (an update of
    it would be lost)."""
    if type(x) in PLAIN or type(x).__torch_dispatch__ is _NO_DISPATCH:  # (a subclass of torch functions alone:
        return x  # its own memory, as a Parameter's)
    try:
        with torch.no_grad():
            a = torch.ops.aten.alias.default(x)
        if type(a) not in PLAIN or (a.shape, a.dtype, a.device, a.stride()) != (x.shape, x.dtype, x.device, x.stride()):
            return None
        if not a.numel():
            return a
        flatten = getattr(x, "__tensor_flatten__", None)
        holders = [x] if flatten is None else [getattr(x, name) for name in flatten()[0]]
        where = a.untyped_storage().data_ptr()
        held = any(h.untyped_storage().data_ptr() == where for h in holders if isinstance(h, torch.Tensor))
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):  # (a subclass without these: no such memory)
        return None
    return a if held and where else None


def in_memory(xs):
    """:func:`memory_of` each of the parameters ``xs`` (checked before the
    step: DistributedLion.check_params); ``xs`` itself where every one is
    a plain tensor, the common case, read in C."""
    if PLAIN.issuperset(map(type, xs)):
        return xs
    out = list(map(memory_of, xs))
    if None in out:
        raise RuntimeError("lionbit: a parameter's values are not in memory the kernels can update (unchecked)")
    return out


def apply_updates(items, k: Coefs) -> None:
    """:func:`apply_update` of many (p, delta) pairs (p contiguous, of any
    shape) on one device in one call per kind of delta: values (on a GPU a
    launch per dtype pair), or :class:`VotedPlanes` (a call per vote's
    planes; on a GPU per vote's planes and parameter dtype)."""
    _, _, _, _, lr, decay = k.values
    cuda = items[0][0].is_cuda
    xs, ds = zip(*items)
    mem = in_memory(xs)
    if mem is not xs:  # (a wrapper among them: its tensor of values in its place)
        xs, items = tuple(mem), list(zip(mem, ds))
    one = ds[0]
    if (
        set(map(type, ds)) == {VotedPlanes}
        and len(set(map(id, map(_sign, ds)))) == 1
        and (not cuda or len(set(map(_dtype, xs))) == 1)
    ):  # the vote's planes of one call (most steps): read in C, not item by item
        apply_planes(list(xs), one.sign, one.zero, list(map(_offset, ds)), k)
        return
    values, voted = [], {}
    for p, d in items:
        if type(d) is VotedPlanes:
            key = (id(d.sign), p.dtype) if cuda else id(d.sign)
            _, xs, offsets = voted.setdefault(key, (d, [], []))
            xs.append(p)
            offsets.append(d.offset)
        else:
            values.append((p, d))
    if cuda:
        for group in _by_dtypes(values):
            xs, deltas = zip(*group)
            _C.lion_apply_list_device(xs, deltas, lr, decay)
    elif values:
        xs, deltas = zip(*values)
        _C.lion_apply_list(xs, deltas, lr, decay)
    for d, xs, offsets in voted.values():
        apply_planes(xs, d.sign, d.zero, offsets, k)


def apply_planes(xs, sign, zero, offsets, k: Coefs, starts=None, lengths=None) -> None:
    """The parameters ``xs`` (on a GPU of one dtype) updated from a vote's
    result planes, each from its Delta's bits at its offset; with ``starts``
    and ``lengths``, elements [start, start + length) of each (flat indices)."""
    _, _, _, _, lr, decay = k.values
    xs = in_memory(xs)
    if not xs[0].is_cuda:
        _C.lion_apply_planes_list(xs, sign, zero, offsets, lr, decay, starts=starts, lengths=lengths)
        return
    _C.lion_apply_planes_list_device(xs, sign, zero, offsets, lr, decay, starts=starts, lengths=lengths)


def pack_abstain(numel: int, sign, zero, bit_offset: int, bits=None) -> None:
    """Packs direction 0 for ``numel`` elements at bit_offset: the vote of a
    rank that has run out of data (it abstains; its momentum stays)."""
    c = torch.zeros(numel, dtype=torch.float32, device=sign.device)
    if bits:
        pack_levels(c, 0.0, bits, sign, bit_offset)
    else:
        _C.pack_signs_into(c, sign, zero, bit_offset)


def update_momentum(g, m, k: Coefs, fused: bool, scratch, counts=None) -> None:
    """m = fl(fl(b2 m) + fl((1 - b2) g)) in place. ``scratch``: two uint8
    planes of at least plane_bytes(m.numel()) bytes for the fused kernel's
    direction bits (not needed afterwards); ``counts``: on a GPU, an int64
    buffer of 2 for its tallies (not needed either; one for many tensors
    saves a launch each)."""
    g = g.reshape(-1)
    if fused:
        b1, omb1, b2, omb2, _, _ = k.values
        if not g.is_cuda:
            _C.lion_direction_into(g, m.view(-1), b1, omb1, b2, omb2, scratch[0], scratch[1], 0)
        else:
            if counts is None:
                counts = torch.zeros(2, dtype=torch.int64, device=g.device)
            _C.lion_direction_into_device(g, m.view(-1), b1, omb1, b2, omb2, scratch[0], scratch[1], counts, 0)
        return
    mv = m.view(-1)
    b2, omb2 = k.tensors()[2:4]
    mv.copy_(torch.add(torch.mul(mv.float(), b2), torch.mul(g.float(), omb2)))


def apply_update(p, delta, k: Coefs, fused: bool) -> None:
    """x = fl(fl(x * decay) - fl(lr * Delta)), in place; ``delta`` a tensor
    or :class:`VotedPlanes`."""
    p = in_memory([p])[0]
    if isinstance(delta, VotedPlanes):
        if fused and not p.is_cuda:
            _, _, _, _, lr, decay = k.values
            _C.lion_apply_planes(p.view(-1), delta.sign, delta.zero, delta.offset, lr, decay)
            return
        delta = delta.values()
    if fused:
        _, _, _, _, lr, decay = k.values
        apply = _C.lion_apply_device if p.is_cuda else _C.lion_apply
        apply(p.view(-1), delta.reshape(-1), lr, decay)
        return
    if p.dtype == torch.float64:  # in its own precision: float32 would round the parameter every step
        _, _, _, _, lr, decay = k.values
        p.copy_(torch.sub(torch.mul(p, decay), torch.mul(delta.reshape(p.shape).double(), lr)))
        return
    xf = p.float()
    lr, decay = k.tensors()[4:]
    p.copy_(torch.sub(torch.mul(xf, decay), torch.mul(delta.reshape(p.shape).float(), lr)))


def local_vote(sign, zero, numel: int, bits=None) -> torch.Tensor:
    """Delta of a single rank (no process group): its own direction (with
    ``bits``: the sign of its own level). Its zeros stay 0 under every tie
    rule, as the collective's owner keeps an element every rank voted 0 for
    (signbits/ties.h): with one rank there is no other kind of tie."""
    shifts = torch.arange(64, dtype=torch.int64, device=sign.device)

    def unpacked(plane):
        return ((plane.view(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]

    if bits:
        plane = sign.numel() // bits
        u = sum(unpacked(sign[b * plane : (b + 1) * plane]) << b for b in range(bits))
        delta = torch.sign(u - ((1 << (bits - 1)) - 1))
    else:
        s, z = unpacked(sign), unpacked(zero)
        delta = s - (1 - s) * (1 - z)
    return delta.to(torch.bfloat16)
