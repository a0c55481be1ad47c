"""The Lion arithmetic every path of DistributedLion shares (DDP, FSDP2,
FSDP1, a plain module): no process groups here.

Per element, with every float32 operation rounded on its own and no fused
multiply-add (the fused C++ kernels and the torch ops below give the same
bits; the coefficients are computed in float64 and rounded once)::

    c     = fl(fl(b1 * m) + fl((1 - b1) * g))       # direction = sign(c)
    m_new = fl(fl(b2 * m) + fl((1 - b2) * g))
    x_new = fl(fl(x * (1 - lr * wd)) - fl(lr * Delta))

A step is split so that nothing changes before every rank knows the step
is good: :func:`pack_direction` reads g and m and writes only bits (and
counts non-finite directions), the vote runs, then :func:`update_momentum`
and :func:`apply_update` change the state.
"""

import torch

from . import _C


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


class Coefs:
    """A parameter group's hyperparameters: the float64 values of the
    contract (the fused kernels round them to float32) and their float32
    tensors (for the torch path)."""

    def __init__(self, group: dict):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        self.values = (b1, 1.0 - b1, b2, 1.0 - b2, lr, 1.0 - lr * wd)
        self.b1, self.omb1, self.b2, self.omb2, self.lr, self.decay = (_f32(v) for v in self.values)


def plane_bytes(numel: int) -> int:
    return (numel + 63) // 64 * 8


def planes(numel: int, device=None):
    nbytes = plane_bytes(numel)
    return (
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
    )


def device_counts(device):
    """{zeros, non-finite} tallied on a CUDA device by the packing kernels."""
    return torch.zeros(2, dtype=torch.int64, device=device) if device.type == "cuda" else None


def _direction_torch(g, m, k: Coefs):
    return torch.add(torch.mul(m.float(), k.b1), torch.mul(g.float(), k.omb1))


def pack_direction(g, m, k: Coefs, sign, zero, bit_offset: int, fused: bool, counts=None) -> int:
    """ORs the bits of sign(b1 m + (1 - b1) g) into the uint8 planes at
    bit_offset; m is only read. Returns the number of non-finite directions
    (NaN or +-Inf: a non-finite g or m); on CUDA 0, the count is added to
    ``counts[1]`` on the device instead (no host synchronisation)."""
    g = g.reshape(-1)
    if g.is_cuda:
        c = _direction_torch(g, m.reshape(-1), k)
        _C.pack_signs_into_device(c, sign, zero, counts, bit_offset)  # counts[1] += NaNs
        counts[1].add_(torch.isinf(c).sum())
        return 0
    if fused:
        b1, omb1, b2, omb2, _, _ = k.values
        return _C.lion_direction_into(g, m.view(-1), b1, omb1, b2, omb2, sign, zero, bit_offset, update_momentum=False)
    c = _direction_torch(g, m.reshape(-1), k)
    _C.pack_signs_into(c, sign, zero, bit_offset)
    return int((~torch.isfinite(c)).sum())


def update_momentum(g, m, k: Coefs, fused: bool, scratch) -> None:
    """m = fl(fl(b2 m) + fl((1 - b2) g)) in place. ``scratch``: two uint8
    planes of at least plane_bytes(m.numel()) bytes for the fused kernel's
    direction bits (not needed afterwards)."""
    g = g.reshape(-1)
    if fused and not g.is_cuda:
        b1, omb1, b2, omb2, _, _ = k.values
        _C.lion_direction_into(g, m.view(-1), b1, omb1, b2, omb2, scratch[0], scratch[1], 0)
        return
    mv = m.view(-1)
    mv.copy_(torch.add(torch.mul(mv.float(), k.b2), torch.mul(g.float(), k.omb2)))


def apply_update(p, delta, k: Coefs, fused: bool) -> None:
    """x = fl(fl(x * decay) - fl(lr * Delta)), in place."""
    if fused:
        _, _, _, _, lr, decay = k.values
        apply = _C.lion_apply_device if p.is_cuda else _C.lion_apply
        apply(p.view(-1), delta.reshape(-1), lr, decay)
        return
    xf = p.float()
    p.copy_(torch.sub(torch.mul(xf, k.decay), torch.mul(delta.reshape(p.shape).float(), k.lr)))


def direction_into(g, m, k: Coefs, sign, zero, bit_offset: int, fused: bool, counts=None) -> int:
    """Both at once, for the FSDP reduce-scatters (which run in backward and
    keep no gradient for later): packs the direction and updates m. Returns
    the number of non-finite directions (CUDA: added to counts[1])."""
    if fused and not g.is_cuda:
        b1, omb1, b2, omb2, _, _ = k.values
        return _C.lion_direction_into(g.reshape(-1), m.view(-1), b1, omb1, b2, omb2, sign, zero, bit_offset)
    bad = pack_direction(g, m, k, sign, zero, bit_offset, False, counts)
    update_momentum(g, m, k, False, None)
    return bad


def local_vote(sign, zero, numel: int) -> torch.Tensor:
    """Delta of a single rank (no process group): its own direction."""
    shifts = torch.arange(64, dtype=torch.int64, device=sign.device)

    def bits(plane):
        return ((plane.view(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]

    s, z = bits(sign), bits(zero)
    return (s - (1 - s) * (1 - z)).to(torch.bfloat16)
