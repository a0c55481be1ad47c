"""DistributedLion: Lion whose updates are voted across ranks with 1 bit each.

Per step on rank i (Distributed Lion, Liu et al. 2024; Lion Cub, Ishikawa et
al. 2024)::

    delta_i = sign(b1 * m_i + (1 - b1) * g_i)       # local direction, 1 bit
    m_i     = b2 * m_i + (1 - b2) * g_i             # momentum stays local
    Delta   = vote(delta_1 .. delta_N)  (or avg)    # lionbit's sign all-reduce
    x       = x * (1 - lr * wd) - lr * Delta        # same on every rank

No gradient is ever all-reduced. The arithmetic contract, shared by the fused
C++ kernels and the plain torch path (and checked bit for bit by the tests),
is float32 with every operation rounded on its own and no fused
multiply-add, with b1, 1 - b1, b2, 1 - b2, lr and 1 - lr * wd each computed
in float64 and rounded once to float32:

    c     = fl(fl(b1 * m) + fl((1 - b1) * g))       # delta = sign(c)
    m_new = fl(fl(b2 * m) + fl((1 - b2) * g))
    x_new = fl(fl(x * (1 - lr * wd)) - fl(lr * Delta))

(bfloat16 / float16 values are widened exactly and rounded to nearest even
when stored).
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import _C
from . import fsdp as _fsdp
from . import fsdp1 as _fsdp1
from ._backend import _backend_for

_AGGREGATIONS = ("vote", "avg")


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


class _Coefs:
    """A group's hyperparameters: the float64 values of the contract (the
    fused kernels round them to float32) and their float32 tensors (for the
    torch path)."""

    def __init__(self, group: dict):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        self.values = (b1, 1.0 - b1, b2, 1.0 - b2, lr, 1.0 - lr * wd)
        self.b1, self.omb1, self.b2, self.omb2, self.lr, self.decay = (_f32(v) for v in self.values)


def direction_into(g, m, coefs: _Coefs, sign, zero, bit_offset: int, fused: bool, counts=None) -> int:
    """Updates momentum m in place and packs sign(b1 m + (1 - b1) g) into the
    uint8 bit-planes sign / zero at bit_offset. Returns the number of NaNs
    (CUDA: 0; the kernels add the zero / NaN tallies to ``counts`` on the
    device instead, without a host synchronisation)."""
    if g.is_cuda:
        if fused:
            b1, omb1, b2, omb2, _, _ = coefs.values
            _C.lion_direction_into_device(g.reshape(-1), m.view(-1), b1, omb1, b2, omb2, sign, zero, counts, bit_offset)
            return 0
        gf, mf = g.float(), m.float()
        c = torch.add(torch.mul(mf, coefs.b1), torch.mul(gf, coefs.omb1))
        m.copy_(torch.add(torch.mul(mf, coefs.b2), torch.mul(gf, coefs.omb2)))
        _C.pack_signs_into_device(c.reshape(-1), sign, zero, counts, bit_offset)
        return 0
    if fused:
        b1, omb1, b2, omb2, _, _ = coefs.values
        return _C.lion_direction_into(g.reshape(-1), m.view(-1), b1, omb1, b2, omb2, sign, zero, bit_offset)
    gf, mf = g.float(), m.float()
    c = torch.add(torch.mul(mf, coefs.b1), torch.mul(gf, coefs.omb1))
    m.copy_(torch.add(torch.mul(mf, coefs.b2), torch.mul(gf, coefs.omb2)))
    _, nans = _C.pack_signs_into(c.reshape(-1), sign, zero, bit_offset)
    return nans


def apply_update(p, delta, coefs: _Coefs, fused: bool) -> None:
    """x = fl(fl(x * decay) - fl(lr * Delta)), in place."""
    if fused:
        _, _, _, _, lr, decay = coefs.values
        apply = _C.lion_apply_device if p.is_cuda else _C.lion_apply
        apply(p.view(-1), delta.reshape(-1), lr, decay)
        return
    xf = p.float()
    p.copy_(torch.sub(torch.mul(xf, coefs.decay), torch.mul(delta.reshape(p.shape).float(), coefs.lr)))


def _plane_bytes(numel: int) -> int:
    return (numel + 63) // 64 * 8


def _planes(numel: int, device=None):
    nbytes = _plane_bytes(numel)
    return (
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
        torch.zeros(nbytes, dtype=torch.uint8, device=device),
    )


def _counts(device):
    """{zeros, NaNs} tallied on a CUDA device by the packing kernels."""
    return torch.zeros(2, dtype=torch.int64, device=device) if device.type == "cuda" else None


def _local_vote(sign, zero, numel: int) -> torch.Tensor:
    """Delta of a single rank (no process group): its own direction."""
    shifts = torch.arange(64, dtype=torch.int64, device=sign.device)

    def bits(plane):
        return ((plane.view(torch.int64).unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]

    s, z = bits(sign), bits(zero)
    return (s - (1 - s) * (1 - z)).to(torch.bfloat16)


class DistributedLion(torch.optim.Optimizer):
    """Lion with 1-bit majority-vote (or average) updates across ranks.

    Args:
        params: parameters or parameter groups (each group may set its own
            ``lr``, ``betas`` and ``weight_decay``).
        lr: learning rate (Lion wants 3-10x smaller than AdamW).
        betas: (b1, b2): b1 mixes the gradient into the update direction, b2
            is the momentum's decay.
        weight_decay: decoupled weight decay (x *= 1 - lr * wd each step).
        aggregation: "vote" (sign of the sum of directions, 0 on a tie) or
            "avg" (their mean).
        group: the process group (a lionbit one); default: the default group,
            or the DDP model's group after :meth:`attach`.
        momentum_dtype: torch.float32 (default) or torch.bfloat16 (halves the
            momentum's memory; every step rounds it to bfloat16).
        fused: use the fused C++ kernels (one pass over g and m writing the
            new m and the packed direction; one pass applying the update).
            None (default): wherever the dtypes allow; False: plain torch
            ops. Both give bitwise the same result.

    Without a process group (``torch.distributed`` not initialized) it is
    single-process Lion. With a plain module, ``step()`` runs the vote itself,
    one collective per step for all parameters. With DDP, call
    ``attach(ddp_model)``: the vote then runs in DDP's communication hook,
    overlapping backward, and ``step()`` only applies it.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas=(0.9, 0.99),
        weight_decay: float = 0.0,
        aggregation: str = "vote",
        group: Optional[dist.ProcessGroup] = None,
        momentum_dtype: Optional[torch.dtype] = None,
        fused: Optional[bool] = None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"DistributedLion: argument 'lr' must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"DistributedLion: argument 'betas' must be two values in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"DistributedLion: argument 'weight_decay' must be >= 0, got {weight_decay}")
        if aggregation not in _AGGREGATIONS:
            raise ValueError(f"DistributedLion: argument 'aggregation' must be 'vote' or 'avg', got {aggregation!r}")
        if momentum_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"DistributedLion: argument 'momentum_dtype' must be torch.float32 or torch.bfloat16, got {momentum_dtype}"
            )
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.aggregation = aggregation
        self.group = group
        self.momentum_dtype = momentum_dtype or torch.float32
        self.fused = fused
        self._ddp = None  # the DDP model after attach()
        self._ddp_planes = {}  # DDP bucket index -> its (sign, zero) planes, kept across steps
        self._fsdp_params = None  # sharded parameter -> FSDPParam after attach(fsdp2 model)
        self._fsdp_delta = {}  # sharded parameter -> Delta of the local shard, pending step()
        self._fsdp1_units = None  # FSDP1 comm-hook states (one per FSDP instance) after attach(fsdp1 model)
        self._fsdp1_delta = {}  # FSDP1 unit -> Delta of its local flat shard, pending step()

    # -- state -------------------------------------------------------------
    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype, memory_format=torch.contiguous_format)
        return state["exp_avg"]

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        # torch casts loaded state to each parameter's dtype; the momentum
        # keeps its own.
        for state in self.state.values():
            if "exp_avg" in state and state["exp_avg"].dtype != self.momentum_dtype:
                state["exp_avg"] = state["exp_avg"].to(self.momentum_dtype)

    def _fused_for(self, p: torch.Tensor, g: torch.Tensor) -> bool:
        ok = (
            p.is_contiguous()
            and g.is_contiguous()
            and _C.lion_fused_supported(p.dtype, g.dtype, self.momentum_dtype)
        )
        if self.fused and not ok:
            raise ValueError(
                f"DistributedLion(fused=True): no fused kernel for parameter {p.dtype}, gradient {g.dtype}, "
                f"momentum {self.momentum_dtype} (contiguous float32/bfloat16/float16 parameters and gradients, "
                f"float32/bfloat16 momentum)"
            )
        return ok if self.fused is None else bool(self.fused)

    def _group_of(self) -> Dict[torch.Tensor, dict]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def _check_param(self, p: torch.Tensor, where: str) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"DistributedLion.{where}: sparse gradients are not supported")
        if p.device.type == "cuda" and not _C.built_with_cuda:
            raise RuntimeError(
                f"DistributedLion.{where}: parameters on {p.device}, but this build of lionbit has no CUDA path "
                f"(rebuild it where nvcc and a CUDA build of torch are present)"
            )
        if p.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"DistributedLion.{where}: parameters on {p.device} are not supported (CPU and CUDA are)")

    # -- the collective ------------------------------------------------------
    def _vote(self, sign, zero, numel: int, nans: int, out: torch.Tensor, group, where: str, counts=None):
        if group is None and not dist.is_initialized():
            if counts is not None:
                nans = int(counts[1].item())
            if nans:
                raise RuntimeError(f"DistributedLion.{where}: the update direction contains NaN")
            out.copy_(_local_vote(sign, zero, numel))
            fut = torch.futures.Future(devices=[out.device] if out.is_cuda else None)
            fut.set_result([out])
            return fut
        backend = _backend_for(group, out.device, where)
        if out.is_cuda:
            work = backend.all_reduce_sign_packed_device(sign, zero, counts, numel, out, self.aggregation)
        else:
            work = backend.all_reduce_sign_packed(sign, zero, numel, nans, out, self.aggregation)
        return work.get_future()

    # -- plain module ------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fsdp1_units is not None:
            # The FSDP1 comm hooks already voted: apply Delta to the local flat shards.
            _fsdp1.fsdp1_step(self)
            return loss
        items = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not items and not self._fsdp_delta:
            return loss
        if self._fsdp_params is not None:
            # The FSDP reduce-scatter already voted: apply Delta to the local shards.
            _fsdp.fsdp_step(self)
            return loss
        for p, _ in items:
            self._check_param(p, "step")
        device = items[0][0].device
        if self._ddp is None and any(p.device != device for p, _ in items):
            devices = sorted({str(p.device) for p, _ in items})
            raise RuntimeError(
                f"DistributedLion.step: parameters on several devices ({', '.join(devices)}); one step votes "
                f"all of them in one collective, so they must share a device (use one optimizer per device)"
            )
        if self._ddp is not None:
            # The hook already voted: p.grad holds Delta.
            for p, g in items:
                apply_update(p, p.grad, _Coefs(g), self._fused_for(p, p.grad))
            return loss
        total = sum(p.numel() for p, _ in items)
        sign, zero = _planes(total, device)
        counts = _counts(device)
        nans, off = 0, 0
        for p, g in items:
            grad = p.grad.contiguous()
            nans += direction_into(
                grad, self._momentum(p), _Coefs(g), sign, zero, off, self._fused_for(p, grad), counts
            )
            off += p.numel()
        # Delta: -1/0/+1 is exact in bfloat16 (half float32's memory); an
        # average k/N is rounded to float32, the update's arithmetic type.
        out = torch.empty(total, dtype=torch.bfloat16 if self.aggregation == "vote" else torch.float32, device=device)
        self._vote(sign, zero, total, nans, out, self.group, "step", counts).wait()
        off = 0
        for p, g in items:
            delta = out[off : off + p.numel()]
            apply_update(p, delta, _Coefs(g), self._fused_for(p, delta))
            off += p.numel()
        return loss

    # -- DDP ----------------------------------------------------------------
    def attach(self, model):
        """Route this optimizer's updates through the model's communication.

        ``DistributedDataParallel``: registers a comm hook that turns each
        bucket's gradients into direction bits, votes them with the 1-bit
        sign all-reduce (no gradient all-reduce at all) and hands DDP the
        voted update as the bucket's value; ``step()`` then applies it. A
        plain module needs no attach. Returns self.
        """
        from torch.nn.parallel import DistributedDataParallel as DDP

        if self._ddp is not None or self._fsdp_params is not None or self._fsdp1_units is not None:
            if isinstance(model, DDP) or _fsdp.is_fsdp2(model) or _fsdp1.is_fsdp1(model):
                raise RuntimeError("DistributedLion.attach: this optimizer is already attached to a model")
        if isinstance(model, DDP):
            known = self._group_of()
            missing = [n for n, p in model.module.named_parameters() if p.requires_grad and p not in known]
            if missing:
                raise ValueError(
                    f"DistributedLion.attach: the DDP model's parameters {missing[:5]} are not in this optimizer; "
                    f"DDP would vote them with no momentum or hyperparameters"
                )
            if self.group is None:
                self.group = model.process_group
            _backend_for(self.group, next(model.parameters()).device, "attach")  # a lionbit group, or a clear error
            model.register_comm_hook(self, _ddp_hook)
            self._ddp = model
            return self
        if _fsdp.is_fsdp2(model):
            if self._ddp is not None or self._fsdp_params is not None:
                raise RuntimeError("DistributedLion.attach: this optimizer is already attached to a model")
            _fsdp.attach_fsdp2(self, model)
            return self
        if _fsdp1.is_fsdp1(model):
            _fsdp1.attach_fsdp1(self, model)
            return self
        if _fsdp._fsdp2_modules(model):
            raise ValueError(
                "DistributedLion.attach: the model contains fully_shard-ed submodules but is not itself "
                "fully_shard-ed; call fully_shard on the root module too and attach the root"
            )
        return self

    # -- FSDP2 checkpoints ------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """For torch.distributed.checkpoint with an FSDP2 model (after
        attach): each rank's full-size momentum as one DTensor of shape
        (N, *param_shape), sharded on dim 0, keyed by parameter name; see
        lionbit.fsdp.sharded_state_dict."""
        return _fsdp.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: dict) -> None:
        """Restores what sharded_state_dict() gave (after dcp.load into it)."""
        _fsdp.load_sharded_state_dict(self, state_dict)

    # -- FSDP1 checkpoints (per-rank files) ---------------------------------
    def local_state_dict(self) -> dict:
        """This rank's state with an FSDP1 model (after attach), for a
        per-rank file: each FSDP instance's full-size flat momentum and the
        hyperparameters; see lionbit.fsdp1.local_state_dict."""
        return _fsdp1.local_state_dict(self)

    def load_local_state_dict(self, state_dict: dict) -> None:
        """Restores what local_state_dict() gave on this rank."""
        _fsdp1.load_local_state_dict(self, state_dict)

    def _fsdp_reduce(self, layout, inp, out, group, fqns, where):
        _fsdp.fsdp_reduce(self, layout, inp, out, group, fqns, where)


def _ddp_hook(opt: DistributedLion, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: local gradients -> direction bits -> vote -> Delta."""
    with torch.no_grad():
        buffer = bucket.buffer()
        params, grads = bucket.parameters(), bucket.gradients()
        total = buffer.numel()
        groups = opt._group_of()
        # The bit-planes of this bucket are kept across steps (zeroed here: the
        # direction kernels OR bits in at parameter boundaries). The previous
        # step's vote on them is done: DDP waits for every bucket's future
        # before backward returns.
        planes = opt._ddp_planes.get(bucket.index())
        if planes is None or planes[0].numel() != _plane_bytes(total) or planes[0].device != buffer.device:
            # (DDP rebuilds its buckets after the first step: sizes change once.)
            planes = opt._ddp_planes[bucket.index()] = _planes(total, buffer.device)
        else:
            planes[0].zero_()
            planes[1].zero_()
        sign, zero = planes
        counts = _counts(buffer.device)
        nans, off = 0, 0
        for p, g in zip(params, grads):
            opt._check_param(p, "attach (DDP hook)")
            nans += direction_into(
                g, opt._momentum(p), _Coefs(groups[p]), sign, zero, off, opt._fused_for(p, g), counts
            )
            off += g.numel()
        if off != total:
            raise RuntimeError(f"DistributedLion: DDP bucket holds {total} elements, its gradients {off}")
        # The vote is unpacked straight into the bucket's buffer, as DDP's own
        # all-reduce works in place: its gradients are spent (packed above),
        # and a fresh output per bucket cost lionbit's unpack ~3x its time in
        # page faults (docs/benchmarks.md, suite 3).
        out = buffer
        fut = opt._vote(sign, zero, total, nans, out, opt.group, "attach (DDP hook)", counts)
        return fut.then(lambda f: f.value()[0])
