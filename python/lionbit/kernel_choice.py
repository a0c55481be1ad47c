"""Which kernels run DistributedLion's arithmetic on a device, and the check
of a device's fused Lion kernel at its first use.

``LIONBIT_KERNELS`` (read at every use, as the C++ side reads it):

- ``auto`` (default): the fused Lion kernels wherever the dtypes allow. On
  CUDA the fused apply kernel (``_C.lion_apply_device``) is first checked on
  each device against the torch path of lionbit.lion_math on small random
  inputs (float32, bfloat16 and float16 parameters and deltas, weight decay
  on and off, sizes that are not whole vectors); a mismatch warns once,
  naming the kernel and the case, and that device uses the torch path from
  then on. (The CPU's fused kernels are checked by the test suite.)
- ``custom``: the fused kernels, unchecked.
- ``aten``: never the fused kernels (CPU or CUDA): the plain-torch path,
  which gives the same bits by lion_math's contract.

The sign collectives and the packers make the same choice in C++
(backend/kernel_set.hpp); :func:`kernels` reports both.
"""

import os
from typing import Callable, Dict, Optional

import torch

from . import _C, lion_math, user_warning

ENV = "LIONBIT_KERNELS"
CHOICES = ("auto", "custom", "aten")

#: Parameter and delta dtypes, sizes (not whole vectors or words; the last
#: holds two whole units of the GPU apply kernels' vector path, 4096 elements
#: each, and a tail) and weight decays the first-use check runs.
CHECK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHECK_SIZES = (1, 7, 67, 1029, 8259)
CHECK_DECAYS = (0.0, 0.1)
CHECK_LR = 3e-3


def requested() -> str:
    """The value of LIONBIT_KERNELS ("auto" when unset); raises ValueError
    naming the variable for any other value."""
    value = os.environ.get(ENV, "").strip()
    if value == "":
        return "auto"
    if value not in CHOICES:
        raise ValueError(f"lionbit: {ENV} must be one of {', '.join(CHOICES)} (or unset), got {value!r}")
    return value


def _inputs(n: int, pdt: torch.dtype, ddt: torch.dtype, gen: torch.Generator):
    """A parameter and a delta of n elements: random magnitudes over several
    octaves, some exact zeros and +-1 in the delta (what a vote gives)."""
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-8, 9, (n,), generator=gen))
    d = torch.randn(n, generator=gen, dtype=torch.float64)
    pick = torch.randint(0, 4, (n,), generator=gen)
    d = torch.where(pick == 0, torch.zeros_like(d), torch.where(pick == 1, d.sign(), d))
    return x.to(pdt), d.to(ddt)


def check_apply(candidate: Callable, device, seed: int = 0) -> Optional[str]:
    """Runs ``candidate(x, delta, lr, decay)`` (an in-place fused Lion apply:
    x = fl(fl(x * decay) - fl(lr * delta))) and the torch path of
    lionbit.lion_math on the same small random inputs on ``device``; returns
    the first case where their bits differ ("bfloat16 parameter, float16
    delta, n=67, weight_decay=0.1"), or None when every case agrees. Changes
    no global random state."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    cases, same = [], []
    with torch.no_grad():
        for pdt in CHECK_DTYPES:
            for ddt in CHECK_DTYPES:
                for wd in CHECK_DECAYS:
                    coefs = lion_math.Coefs({"betas": (0.9, 0.99), "lr": CHECK_LR, "weight_decay": wd})
                    for n in CHECK_SIZES:
                        x, d = (t.to(device) for t in _inputs(n, pdt, ddt, gen))
                        got, want = x.clone(), x.clone()
                        candidate(got, d, coefs.values[4], coefs.values[5])
                        lion_math.apply_update(want, d, coefs, False)
                        bits = torch.int32 if pdt == torch.float32 else torch.int16
                        same.append(torch.equal(got.view(bits), want.view(bits)))
                        cases.append(f"{_name(pdt)} parameter, {_name(ddt)} delta, n={n}, weight_decay={wd}")
    for case, ok in zip(cases, same):
        if not ok:
            return case
    return None


def check_direction(candidate: Callable, device, seed: int = 0) -> Optional[str]:
    """Runs ``candidate(g, m, b1, omb1, b2, omb2, sign, zero, counts,
    bit_offset, update_momentum, m_out=None)`` (a fused Lion direction: the
    bits of sign(b1 m + (1 - b1) g) at bit_offset, {c == 0, c non-finite}
    added to counts, and with update_momentum m = b2 m + (1 - b2) g, written
    into m_out where given, m only read) against the torch
    path of lionbit.lion_math on small random inputs on ``device`` (some
    exact zeros, and Inf and NaN where the dtypes make them); returns the
    first case that differs, or None. Changes no global random state."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    coefs = lion_math.Coefs({"betas": (0.9, 0.99), "lr": CHECK_LR, "weight_decay": 0.0})
    b1, omb1, b2, omb2 = coefs.values[:4]
    with torch.no_grad():
        for gdt in CHECK_DTYPES:
            for mdt in (torch.float32, torch.bfloat16):
                for n in CHECK_SIZES:
                    g, m = _inputs(n, gdt, mdt, gen)
                    if n > 7:  # an Inf and a NaN gradient: counted, never applied
                        g[3], g[5] = float("inf"), float("nan")
                    g, m = g.to(device), m.to(device)
                    # a word-aligned offset (the GPU's 16-byte vector path) and an odd one
                    # (update "m_out": the new momentum into a second buffer, m only read)
                    for update, off in ((False, 5), (False, 64), (True, 5), (True, 64), ("m_out", 5), ("m_out", 64)):
                        nbytes = lion_math.plane_bytes(off + n) + 8
                        planes = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(4)]
                        counts = torch.zeros(2, dtype=torch.int64, device=device)
                        got_m = m.clone()
                        out = torch.full_like(m, 7.0) if update == "m_out" else None
                        kw = {} if out is None else {"m_out": out}
                        candidate(g, got_m, b1, omb1, b2, omb2, planes[0], planes[1], counts, off, bool(update), **kw)
                        c = lion_math.direction(g, m, coefs)
                        _C.pack_signs_into(c, planes[2], planes[3], off)
                        want_m = m.clone()
                        if update:
                            lion_math.update_momentum(g, want_m, coefs, False, None)
                        case = (f"{_name(gdt)} gradient, {_name(mdt)} momentum, n={n}, "
                                f"bit_offset={off}, update_momentum={update}")
                        if not (torch.equal(planes[0], planes[2]) and torch.equal(planes[1], planes[3])):
                            return case + ": direction bits"
                        if int(counts[1]) != int((~torch.isfinite(c)).sum()) or int(counts[0]) != int((c == 0).sum()):
                            return case + ": counts"
                        if out is not None and not _same_bits(got_m, m):
                            return case + ": momentum written"
                        if not _same_bits(got_m if out is None else out, want_m):
                            return case + ": momentum"
    return None


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, but NaN payloads (not the contract: any NaN is a NaN)."""
    bits = torch.int32 if want.dtype == torch.float32 else torch.int16
    if torch.equal(got.view(bits), want.view(bits)):
        return True
    return bool(((torch.isnan(got) & torch.isnan(want)) | (got.view(bits) == want.view(bits))).all())


def check_direction_list(candidate: Callable, device, seed: int = 0) -> Optional[str]:
    """Runs ``candidate(gs, ms, b1, omb1, b2, omb2, sign, zero, counts,
    bit_offsets, update_momentum, starts=None, lengths=None, m_outs=None)``
    (the fused direction over a list of tensors in one launch, their bits
    end to end in one pair of planes, so that neighbours share plane words;
    with sign None the momentum update alone; with starts and lengths,
    elements [start, start + length) of each pair, FSDP's chunks; with
    m_outs, each pair's new momentum there, ms only read) against the torch path
    tensor by tensor (on views, for spans); returns the first case that
    differs, or None."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    coefs = lion_math.Coefs({"betas": (0.9, 0.99), "lr": CHECK_LR, "weight_decay": 0.0})
    # Whole tensors, then spans of them (FSDP's chunks, in shard order, not
    # the tensors'): an empty one, odd starts, spans that cross words.
    whole = [(i, 0, n) for i, n in enumerate(CHECK_SIZES)]
    spans = [(3, 3, 500), (1, 2, 5), (3, 503, 0), (2, 0, 67), (3, 503, 526), (0, 0, 1), (4, 64, 8000)]
    updated = [(3, 0, 3), (2, 1, 66), (3, 503, 526), (4, 64, 8000)]  # disjoint: the momentum update's
    with torch.no_grad():
        for gdt in CHECK_DTYPES:
            for mdt in (torch.float32, torch.bfloat16):
                pairs = [_inputs(n, gdt, mdt, gen) for n in CHECK_SIZES]
                pairs[3][0][3], pairs[3][0][5] = float("inf"), float("nan")
                gs = [g.to(device) for g, _ in pairs]
                ms = [m.to(device) for _, m in pairs]
                for cuts, moved, layout in ((whole, whole, ""), (spans, updated, ", spans")):
                    case = f"{_name(gdt)} gradients, {_name(mdt)} momenta, sizes {CHECK_SIZES}{layout}"
                    wrong = _direction_list_differs(candidate, gs, ms, coefs, cuts, moved, bool(layout))
                    if wrong:
                        return f"{case}: {wrong}"
    return None


def _direction_list_differs(candidate: Callable, gs, ms, coefs, cuts, moved, spans: bool) -> Optional[str]:
    """One layout of :func:`check_direction_list`: ``cuts`` (tensor, start,
    length) packed end to end from bit 5 (neighbours share plane words; a
    long one from the next plane word), then the momentum update of the
    disjoint ``moved``, in place and into second buffers; what differs
    ("direction bits", "counts", "momentum written", "momentum", "momentum
    in m_outs") or None."""
    b1, omb1, b2, omb2 = coefs.values[:4]
    device = gs[0].device

    def call(cs, ms_, sign, zero, counts, offsets, update, outs=None):
        pick = [i for i, _, _ in cs]
        kw = {"starts": [a for _, a, _ in cs], "lengths": [k for *_, k in cs]} if spans else {}
        if outs is not None:
            kw["m_outs"] = [outs[i] for i in pick]
        candidate([gs[i] for i in pick], [ms_[i] for i in pick], b1, omb1, b2, omb2, sign, zero, counts, offsets,
                  update, **kw)

    offsets, off = [], 5
    for *_, k in cuts:
        if k > 4096:  # a long one from a plane word: the GPU's vector path, several groups at once
            off = (off + 63) // 64 * 64
        offsets.append(off)
        off += k
    nbytes = lion_math.plane_bytes(off) + 8
    planes = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(4)]
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    got_ms = [m.clone() for m in ms]
    call(cuts, got_ms, planes[0], planes[1], counts, offsets, False)
    zeros = bad = 0
    for (i, a, k), at in zip(cuts, offsets):
        c = lion_math.direction(lion_math.span(gs[i], a, k), lion_math.span(ms[i], a, k), coefs)
        _C.pack_signs_into(c, planes[2], planes[3], at)
        zeros += int((c == 0).sum())
        bad += int((~torch.isfinite(c)).sum())
    if not (torch.equal(planes[0], planes[2]) and torch.equal(planes[1], planes[3])):
        return "direction bits"
    if int(counts[0]) != zeros or int(counts[1]) != bad:
        return "counts"
    if any(not torch.equal(a, b) for a, b in zip(got_ms, ms)):
        return "momentum written"
    want_ms = [m.clone() for m in ms]
    for i, a, k in moved:
        lion_math.update_momentum(lion_math.span(gs[i], a, k), lion_math.span(want_ms[i], a, k), coefs, False, None)
    call(moved, got_ms, None, None, None, [0] * len(moved), True)
    if not all(map(_same_bits, got_ms, want_ms)):
        return "momentum"
    # Into second buffers (double_buffer=True): outside the spans they keep what they held.
    outs, got_outs = [torch.full_like(m, 7.0) for m in ms], [torch.full_like(m, 7.0) for m in ms]
    for i, a, k in moved:
        lion_math.span(outs[i], a, k).copy_(lion_math.span(want_ms[i], a, k))
    got_ms = [m.clone() for m in ms]
    call(moved, got_ms, None, None, None, [0] * len(moved), True, got_outs)
    if any(not torch.equal(a, b) for a, b in zip(got_ms, ms)):
        return "momentum written"
    if not all(map(_same_bits, got_outs, outs)):
        return "momentum in m_outs"
    return None


def check_apply_list(candidate: Callable, device, seed: int = 0) -> Optional[str]:
    """Runs ``candidate(xs, deltas, lr, decay)`` (the fused apply over a list
    of tensors in one launch) against the torch path tensor by tensor;
    returns the first case that differs, or None."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pdt in CHECK_DTYPES:
            for ddt in CHECK_DTYPES:
                for wd in CHECK_DECAYS:
                    coefs = lion_math.Coefs({"betas": (0.9, 0.99), "lr": CHECK_LR, "weight_decay": wd})
                    pairs = [tuple(t.to(device) for t in _inputs(n, pdt, ddt, gen)) for n in CHECK_SIZES]
                    got = [x.clone() for x, _ in pairs]
                    candidate(got, [d for _, d in pairs], coefs.values[4], coefs.values[5])
                    bits = torch.int32 if pdt == torch.float32 else torch.int16
                    for (x, d), g in zip(pairs, got):
                        want = x.clone()
                        lion_math.apply_update(want, d, coefs, False)
                        if not torch.equal(g.view(bits), want.view(bits)):
                            return (f"{_name(pdt)} parameters, {_name(ddt)} deltas, sizes {CHECK_SIZES}, "
                                    f"weight_decay={wd}")
    return None


def check_apply_planes_list(candidate: Callable, device, seed: int = 0) -> Optional[str]:
    """Runs ``candidate(xs, sign, zero, bit_offsets, lr, decay, starts=None,
    lengths=None)`` (the fused apply over a list of tensors in one launch,
    each tensor's Delta from its bits of a vote's result planes: -1, +1 and
    0 where the zero bit is set) against the torch path tensor by tensor,
    the tensors end to end from an odd bit and from a word; then spans of
    the tensors (elements [start, start + length) of each: FSDP1's segments
    of a flat shard) the same way. Returns the first case that differs, or
    None."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    # Disjoint spans, not in the tensors' order: an empty one, odd starts, spans that cross words.
    spans = [(3, 3, 500), (1, 2, 5), (3, 503, 0), (2, 0, 67), (3, 503, 526), (0, 0, 1), (4, 64, 8000)]
    with torch.no_grad():
        for pdt in CHECK_DTYPES:
            for wd in CHECK_DECAYS:
                coefs = lion_math.Coefs({"betas": (0.9, 0.99), "lr": CHECK_LR, "weight_decay": wd})
                for start, cuts in ((5, None), (64, None), (5, spans)):
                    xs = [_inputs(n, pdt, pdt, gen)[0].to(device) for n in CHECK_SIZES]
                    cuts_ = cuts if cuts is not None else [(i, 0, x.numel()) for i, x in enumerate(xs)]
                    offsets, off = [], start
                    for _, _, k in cuts_:
                        offsets.append(off)
                        off += k
                    nbytes = lion_math.plane_bytes(off) + 8
                    sign = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).to(device)
                    zero = (torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
                            & torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)).to(device)
                    got = [x.clone() for x in xs]
                    if cuts is None:
                        candidate(got, sign, zero, offsets, coefs.values[4], coefs.values[5])
                    else:
                        candidate([got[i] for i, _, _ in cuts], sign, zero, offsets, coefs.values[4], coefs.values[5],
                                  starts=[a for _, a, _ in cuts], lengths=[k for *_, k in cuts])
                    want = [x.clone() for x in xs]
                    for (i, a, k), at in zip(cuts_, offsets):
                        lion_math.apply_update(lion_math.span(want[i], a, k), lion_math.VotedPlanes(sign, zero, at, k),
                                               coefs, False)
                    bits = torch.int32 if pdt == torch.float32 else torch.int16
                    if not all(torch.equal(g.view(bits), w.view(bits)) for g, w in zip(got, want)):
                        return (f"{_name(pdt)} parameters, sizes {CHECK_SIZES} from bit {start}"
                                f"{'' if cuts is None else ', spans'}, weight_decay={wd}")
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class FirstUseCheck:
    """A fused kernel checked on each device at its first use there:
    :meth:`ok` runs :func:`check_apply` once per device and remembers the
    verdict; a mismatch warns once (naming the kernel, the device and the
    case) and the device's verdict stays False."""

    def __init__(self, name: str, candidate: Callable, check: Callable = check_apply, fallback: str = "the torch path"):
        self.name = name
        self.candidate = candidate
        self.check = check  # check_apply, check_direction or a list kernel's check
        self.fallback = fallback  # what DistributedLion runs instead
        self.verdicts: Dict[torch.device, bool] = {}

    def ok(self, device) -> bool:
        device = torch.device(device)
        verdict = self.verdicts.get(device)
        if verdict is None:
            case = self.check(self.candidate, device)
            verdict = self.verdicts[device] = case is None
            if case is not None:
                user_warning.warn(
                    f"lionbit: the fused Lion kernel {self.name} on {device} does not match the torch path "
                    f"bit for bit ({case}); DistributedLion uses {self.fallback} on {device} from now on "
                    f"({ENV}=aten chooses it everywhere, {ENV}=custom skips this check)",
                    RuntimeWarning,
                )
        return verdict


def _lion_apply_device(x, delta, lr, decay) -> None:
    _C.lion_apply_device(x, delta, lr, decay)


def _lion_direction_device(g, m, b1, omb1, b2, omb2, sign, zero, counts, bit_offset, update_momentum,
                           m_out=None) -> None:
    _C.lion_direction_into_device(g, m, b1, omb1, b2, omb2, sign, zero, counts, bit_offset,
                                  update_momentum=update_momentum, m_out=m_out)


def _lion_direction_list_device(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, bit_offsets, update_momentum,
                                starts=None, lengths=None, m_outs=None) -> None:
    _C.lion_direction_list_device(gs, ms, b1, omb1, b2, omb2, sign, zero, counts, bit_offsets,
                                  update_momentum=update_momentum, starts=starts, lengths=lengths, m_outs=m_outs)


def _lion_apply_list_device(xs, deltas, lr, decay) -> None:
    _C.lion_apply_list_device(xs, deltas, lr, decay)


def _lion_apply_planes_list_device(xs, sign, zero, bit_offsets, lr, decay, starts=None, lengths=None) -> None:
    _C.lion_apply_planes_list_device(xs, sign, zero, bit_offsets, lr, decay, starts=starts, lengths=lengths)


#: The first-use checks of ``auto``, by device type (tests add one for "cpu"):
#: the fused apply, and the fused direction (DIRECTION_CHECKS).
CHECKS: Dict[str, FirstUseCheck] = {"cuda": FirstUseCheck("lion_apply_device", _lion_apply_device)}
DIRECTION_CHECKS: Dict[str, FirstUseCheck] = {
    "cuda": FirstUseCheck("lion_direction_into_device", _lion_direction_device, check_direction)
}
#: The list kernels (a launch for many tensors): where one fails its
#: check, the step runs the per-tensor fused kernels (and its votes return
#: Delta as values, not planes).
LIST_CHECKS: Dict[str, tuple] = {
    "cuda": (
        FirstUseCheck("lion_direction_list_device", _lion_direction_list_device, check_direction_list,
                      "the fused kernels tensor by tensor"),
        FirstUseCheck("lion_apply_list_device", _lion_apply_list_device, check_apply_list,
                      "the fused kernels tensor by tensor"),
        FirstUseCheck("lion_apply_planes_list_device", _lion_apply_planes_list_device, check_apply_planes_list,
                      "the fused kernels tensor by tensor"),
    )
}


def fused_lion_allowed(device) -> bool:
    """Whether DistributedLion may run its fused Lion kernels on ``device``
    (where the dtypes allow): not with ``aten``; with ``auto`` where the
    device's first-use check passed (it runs now if it has not)."""
    choice = requested()
    if choice == "aten":
        return False
    kind = torch.device(device).type
    checks = [c for c in (CHECKS.get(kind), DIRECTION_CHECKS.get(kind)) if c is not None]
    return choice == "custom" or all(c.ok(device) for c in checks)


def list_kernels_allowed(device) -> bool:
    """Whether DistributedLion may run the fused kernels of many tensors in
    one call on ``device`` (where it may run the fused kernels at all): on
    the CPU (a loop over the same kernels in C++, checked by the test suite
    as they are) unless ``aten``; on a GPU (one launch for many tensors)
    with ``auto`` where the list kernels' first-use checks passed."""
    choice = requested()
    if choice == "aten":
        return False
    kind = torch.device(device).type
    if kind == "cpu":
        return True
    checks = LIST_CHECKS.get(kind)
    if checks is None:
        return False
    return choice == "custom" or all(c.ok(device) for c in checks)


def has_fused_lion(device) -> bool:
    """Whether this build has fused Lion kernels for ``device``."""
    kind = torch.device(device).type
    return kind == "cpu" or (kind == "cuda" and bool(_C.built_with_cuda))


def kernels(device="cpu") -> dict:
    """Which kernels lionbit runs on ``device`` (a torch.device or a string):
    ``"sign"``, the kernel set of the sign collectives and the packers
    ("simd (avx2)", "aten", "cuda"), and ``"lion"``, DistributedLion's
    arithmetic: "fused" (lionbit's fused kernels, where the dtypes allow)
    or "torch" (plain torch ops). Both follow ``LIONBIT_KERNELS``; on CUDA
    with ``auto`` this runs the device's first-use checks if they have not
    run yet. E.g. ``{"sign": "simd (avx2)", "lion": "fused"}``."""
    device = torch.device(device)
    sign = _C.kernel_set_name(str(device))
    fused = has_fused_lion(device) and fused_lion_allowed(device)
    return {"sign": sign, "lion": "fused" if fused else "torch"}
