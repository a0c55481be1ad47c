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

import logging
import warnings
from typing import Dict, Optional

import torch
import torch.distributed as dist

from . import _C, fsdp as _fsdp, fsdp1 as _fsdp1, lion_math, momentum_sync as _momentum_sync, step_vote
from ._backend import _backend_for
from .ddp import attach_ddp

log = logging.getLogger("lionbit")

# GradScaler passes itself to an optimizer whose step() takes grad_scaler= and
# warns that it will stop doing so; DistributedLion needs it (to make every
# rank's scaler back off alike), and the warning tells a user nothing to do.
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)

_AGGREGATIONS = ("vote", "avg", "l1")
_TIE_BREAKS = ("zero", "alternate", "random")


class DistributedLion(torch.optim.Optimizer):
    """Lion with 1-bit majority-vote (or average) updates across ranks.

    Args:
        params: parameters or parameter groups (each group may set its own
            ``lr``, ``betas`` and ``weight_decay``).
        lr: learning rate (Lion wants 3-10x smaller than AdamW).
        betas: (b1, b2): b1 mixes the gradient into the update direction, b2
            is the momentum's decay.
        weight_decay: decoupled weight decay (x *= 1 - lr * wd each step).
        aggregation: "vote" (sign of the sum of directions), "avg" (their
            mean) or "l1" (Lion Cub's p-bit aggregation: each rank sends its
            pre-sign update quantized to ``bits`` bits with L1 scaling per
            parameter tensor; the update is the sign of their sum).
        bits: with ``aggregation="l1"``, bits per value, 2 to 8 (default 4):
            values in [-(2^(bits-1) - 1), 2^(bits-1) - 1] at any world size.
        tie_break: what a vote (or "l1") gives where the ranks' sum is 0:
            "zero" (default: 0, Distributed Lion's sign(0)), "alternate"
            (+1 on even steps, -1 on odd ones, by the optimizer's step
            counter) or "random" (a pseudo-random sign per element, the same
            on every rank). Both non-zero rules keep phase 2 at exactly 1 bit.
        momentum_sync: None (default: momenta stay local), an int k (after
            every k-th step the ranks' momenta are averaged, bitwise the same
            on every rank: an all-to-all and an all-gather in bfloat16 over
            the forwarded transport, 2 (N - 1)/N * 2 bytes per momentum
            element and rank; see lionbit.momentum_sync) or a callable
            ``step -> bool``, the same on every rank (for example
            :class:`lionbit.ExponentialSync`). ``lionbit.stats()`` counts
            the bytes (``momentum_sync_*``).
        group: the process group (a lionbit one); default: the default group,
            or the DDP model's group after :meth:`attach`.
        momentum_dtype: torch.float32 (default) or torch.bfloat16 (halves the
            momentum's memory; every step rounds it to bfloat16).
        fused: use the fused C++ kernels (one pass over g and m writing the
            new m and the packed direction; one pass applying the update).
            None (default): wherever the dtypes allow; False: plain torch
            ops. Both give bitwise the same result.

    Without a process group (``torch.distributed`` not initialized) it is
    single-process Lion. With a plain module, ``step()`` votes the directions
    itself. With DDP, call ``attach(ddp_model)``: DDP then all-reduces no
    gradient, ``p.grad`` after backward is each rank's own gradient, and
    ``step()`` votes the directions of the gradients as they stand (after
    clipping or unscaling); the vote starts during backward where that is
    exact (lionbit.ddp). ``torch.amp.GradScaler`` is supported: an inf/NaN on
    any rank skips the step on every rank.
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
        *,
        bits: Optional[int] = None,
        tie_break: str = "zero",
        momentum_sync=None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"DistributedLion: argument 'lr' must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"DistributedLion: argument 'betas' must be two values in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"DistributedLion: argument 'weight_decay' must be >= 0, got {weight_decay}")
        if aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"DistributedLion: argument 'aggregation' must be 'vote', 'avg' or 'l1', got {aggregation!r}"
            )
        if bits is not None and aggregation != "l1":
            raise ValueError(
                f"DistributedLion: argument 'bits' applies to aggregation='l1' only (got bits={bits!r} with "
                f"aggregation={aggregation!r})"
            )
        if aggregation == "l1":
            bits = 4 if bits is None else bits
            if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
                raise ValueError(f"DistributedLion: argument 'bits' must be an int from 2 to 8, got {bits!r}")
        if tie_break not in _TIE_BREAKS:
            raise ValueError(
                f"DistributedLion: argument 'tie_break' must be 'zero', 'alternate' or 'random', got {tie_break!r}"
            )
        if tie_break != "zero" and aggregation == "avg":
            raise ValueError(
                f"DistributedLion: argument 'tie_break'={tie_break!r} applies to aggregation 'vote' or 'l1'; "
                f"'avg' has no ties"
            )
        if momentum_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"DistributedLion: argument 'momentum_dtype' must be torch.float32 or torch.bfloat16, "
                f"got {momentum_dtype}"
            )
        sync = _momentum_sync.schedule(momentum_sync)  # validates
        # "step": the steps this optimizer applied (skipped ones not counted),
        # kept in every parameter group so that it travels in every kind of
        # checkpoint; the tie rule and the momentum sync follow it.
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, step=0))
        self.aggregation = aggregation
        self.bits = bits
        self.tie_break = tie_break
        self.momentum_sync = momentum_sync
        self._sync_schedule = sync
        self.group = group
        self.momentum_dtype = momentum_dtype or torch.float32
        self.fused = fused
        self._ddp = None  # the DDP model after attach()
        self._fsdp_params = None  # sharded parameter -> FSDPParam after attach(fsdp2 model)
        self._fsdp_delta = {}  # sharded parameter -> Delta of the local shard, pending step()
        self._fsdp1_units = None  # FSDP1 comm-hook states (one per FSDP instance) after attach(fsdp1 model)
        self._fsdp1_delta = {}  # FSDP1 unit -> Delta of its local flat shard, pending step()

    # -- the step counter ----------------------------------------------------
    @property
    def steps_taken(self) -> int:
        """Steps applied so far (a skipped step is not counted); the same on
        every rank. The "alternate" tie rule and the momentum sync follow it."""
        return max((int(g.get("step", 0)) for g in self.param_groups), default=0)

    def _advance(self) -> None:
        """After a step was applied on every rank: count it, then synchronize
        the momenta if the schedule says so."""
        n = self.steps_taken + 1
        for g in self.param_groups:
            g["step"] = n
        self._tie_calls = 0
        _momentum_sync.after_step(self, n)

    # -- state -------------------------------------------------------------
    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, dtype=self.momentum_dtype, memory_format=torch.contiguous_format)
        return state["exp_avg"]

    def state_dict(self):
        """torch's optimizer state dict, plus which rank's momentum it holds
        (``"lionbit": {"rank", "world_size"}``): each rank's momentum is its
        own, so an exact resume loads each rank's own file."""
        if self._fsdp_params is not None:  # FSDP2: every rank's momentum (lionbit.fsdp.state_dict)
            return _fsdp.state_dict(self)
        sd = super().state_dict()
        if dist.is_initialized():
            sd["lionbit"] = {"rank": dist.get_rank(self.group), "world_size": dist.get_world_size(self.group)}
        return sd

    def load_state_dict(self, state_dict):
        if self._fsdp_params is not None:
            return _fsdp.load_state_dict(self, state_dict)
        state_dict = dict(state_dict)
        saved = state_dict.pop("lionbit", None)
        if saved is not None and dist.is_initialized():
            rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
            if (saved.get("rank"), saved.get("world_size")) != (rank, size):
                warnings.warn(
                    f"DistributedLion.load_state_dict on rank {rank}: this state dict holds the momentum of rank "
                    f"{saved.get('rank')} of {saved.get('world_size')}, so this rank continues from that rank's "
                    f"momentum, not its own (when every rank loads rank 0's file, every rank starts with the same "
                    f"momentum: a momentum synchronization; training goes on, but not bitwise as without the "
                    f"restart). For an exact resume save each rank's own: torch.save(opt.state_dict(), "
                    f"f'opt.rank{{dist.get_rank()}}.pt') on every rank, and load each rank's file",
                    stacklevel=2,
                )
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
        if p.device.type == "cuda" and self.aggregation == "l1":
            raise RuntimeError(
                f"DistributedLion.{where}: aggregation='l1' runs on CPU parameters in this release (its level "
                f"kernels have no CUDA version yet); use aggregation='vote' (tie_break='alternate' or 'random' keep "
                f"it at 1 bit) on the GPU"
            )
        if p.device.type not in ("cpu", "cuda"):
            raise RuntimeError(
                f"DistributedLion.{where}: parameters on {p.device} are not supported (CPU and CUDA are)"
            )

    # -- the collective ------------------------------------------------------
    def _delta_dtype(self) -> torch.dtype:
        """Delta's dtype: bfloat16 holds -1, 0, +1 exactly; avg needs more."""
        return torch.float32 if self.aggregation == "avg" else torch.bfloat16

    def _next_tie_seed(self) -> int:
        """The tie rule's seed of the step's next collective: "alternate"
        follows the step counter; "random" draws from the step and the
        collective's number within the step (both the same on every rank:
        every rank issues the same collectives in the same order; the number
        restarts at every step, so a resumed run draws the same signs)."""
        index = getattr(self, "_tie_calls", 0)
        self._tie_calls = index + 1
        if self.tie_break == "alternate":
            return self.steps_taken
        if self.tie_break == "random":
            return (self.steps_taken << 20) + index
        return -1

    def _reduce_scatter(self, backend, sign, zero, shard_numel: int, nans: int, delta: torch.Tensor) -> None:
        """The FSDP2 / FSDP1 reduce-scatter of this optimizer's aggregation
        (``zero`` is None for "l1"), its tie rule's seed drawn here; waits."""
        seed = self._next_tie_seed()
        if self.bits:
            work = backend.reduce_scatter_levels_packed(sign, self.bits, shard_numel, nans, delta, self.tie_break, seed)
        else:
            work = backend.reduce_scatter_sign_packed(
                sign, zero, shard_numel, nans, delta, self.aggregation, self.tie_break, seed
            )
        work.wait()

    def _vote(self, sign, zero, numel: int, nans: int, out: torch.Tensor, group, where: str, counts=None):
        seed = self._next_tie_seed()
        if group is None and not dist.is_initialized():
            if counts is not None:
                nans = int(counts[1].item())
            fut = torch.futures.Future(devices=[out.device] if out.is_cuda else None)
            if nans:
                # The same words as the header round's, so that callers treat both alike.
                fut.set_exception(ValueError(f"DistributedLion.{where}: input contains NaN on rank(s) [0]"))
                return fut
            out.copy_(lion_math.local_vote(sign, zero, numel, self.bits, self.tie_break, max(seed, 0)))
            fut.set_result([out])
            return fut
        backend = _backend_for(group, out.device, where)
        if self.aggregation == "l1":
            work = backend.all_reduce_levels_packed(sign, self.bits, numel, nans, out, self.tie_break, seed)
        elif out.is_cuda:
            work = backend.all_reduce_sign_packed_device(
                sign, zero, counts, numel, out, self.aggregation, self.tie_break, seed
            )
        else:
            work = backend.all_reduce_sign_packed(sign, zero, numel, nans, out, self.aggregation, self.tie_break, seed)
        return work.get_future()

    # -- step ----------------------------------------------------------------
    #: torch.amp.GradScaler hands this optimizer the step (and itself): the
    #: inf/NaN decision is taken jointly by all ranks, see step().
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One Lion step from the gradients as they stand now (after any
        clipping or unscaling). With ``torch.amp.GradScaler`` (which passes
        itself as ``grad_scaler``) the gradients are unscaled first (unless
        ``scaler.unscale_(opt)`` already did); an inf/NaN on any rank makes
        every rank skip the step, changing nothing, and every rank's scaler
        backs off. Without a scaler an inf/NaN gradient on any rank raises
        on every rank, again before anything changed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                "DistributedLion.step: this torch's GradScaler set optimizer.grad_scale / found_inf instead of "
                "passing grad_scaler=; lionbit does not support that protocol yet (the step would use scaled "
                "gradients)"
            )
        if self._fsdp1_units is not None or self._fsdp_params is not None:
            applied = self._fsdp_step(grad_scaler)
            if self._fsdp_params is not None:
                if applied:
                    self._advance()
                return loss
        found = None
        if grad_scaler is not None:
            found = self._unscale(grad_scaler)
        try:
            if self._ddp is not None:
                entries, deltas, scratch = self._ddp.step("step", scaled=grad_scaler is not None)
            elif self._fsdp1_units is not None:
                entries, deltas, scratch = self._vote_entries(_fsdp1.no_shard_entries(self))
            else:
                entries, deltas, scratch = self._plain_votes()
        except step_vote.NonFinite as bad:
            if found is None:
                raise RuntimeError(
                    f"DistributedLion.step on rank {dist.get_rank(self.group) if dist.is_initialized() else 0}: "
                    f"non-finite gradient (inf or NaN) on rank(s) {bad.ranks}; no parameter or momentum changed on "
                    f"any rank. With float16 autocast use torch.amp.GradScaler, which skips such steps"
                ) from None
            for t in found.values():
                t.fill_(1.0)  # every rank's scaler backs off alike
            self._tie_calls = 0
            log.info("lionbit: DistributedLion skipped a step: inf/NaN gradient on rank(s) %s", bad.ranks)
            return loss
        step_vote.update(entries, deltas, scratch)
        self._advance()
        return loss

    def _unscale(self, scaler) -> dict:
        """Unscales the gradients in place (as GradScaler.unscale_ does) unless
        the user already did; returns the scaler's per-device found_inf
        tensors, which its update() reads."""
        from torch.amp.grad_scaler import OptState

        state = scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            scaler.unscale_(self)
        return scaler._found_inf_per_device(self)

    def _plain_votes(self):
        if not getattr(self, "_checked_unattached", False):
            self._checked_unattached = True
            self._warn_if_ddp_unattached()
        return self._vote_entries(step_vote.step_entries(self, self.param_groups))

    def _warn_if_ddp_unattached(self) -> None:
        """Once, at the first step: a DDP model holding these parameters but
        not attached all-reduces every gradient in fp32 before the vote."""
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        import gc

        from torch.nn.parallel import DistributedDataParallel as DDP

        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for obj in gc.get_objects():
            if isinstance(obj, DDP) and any(id(p) in mine for p in obj.parameters()):
                warnings.warn(
                    f"DistributedLion.step on rank {dist.get_rank(self.group)}: these parameters belong to a "
                    f"DistributedDataParallel model that was not attached, so DDP all-reduces every gradient in "
                    f"fp32 and the 1-bit vote runs on top of it: all the cost, none of the saving. Call "
                    f"opt.attach(ddp_model) once after creating both",
                    stacklevel=3,
                )
                return

    def _vote_entries(self, entries):
        if not entries:
            return [], [], None
        device = entries[0].param.device
        if any(e.param.device != device for e in entries):
            devices = sorted({str(e.param.device) for e in entries})
            raise RuntimeError(
                f"DistributedLion.step: parameters on several devices ({', '.join(devices)}); one step votes "
                f"all of them together, so they must share a device (use one optimizer per device)"
            )
        if not hasattr(self, "_step_buffers"):
            self._step_buffers = step_vote.VoteBuffers()
        deltas = step_vote.vote_chunks(self, entries, self.group, "step", self._step_buffers)
        return entries, deltas, self._step_buffers.scratch

    def _fsdp_step(self, grad_scaler) -> None:
        kind = "FSDP1" if self._fsdp1_units is not None else "FSDP2"
        if grad_scaler is not None:
            raise RuntimeError(
                f"DistributedLion.step ({kind}): GradScaler is not supported with FSDP: the 1-bit reduce-scatter "
                f"computes the Lion update during backward, from the still-scaled gradients. Use bfloat16 mixed "
                f"precision instead (FSDP2: MixedPrecisionPolicy(param_dtype=torch.bfloat16); or torch.autocast "
                f"with dtype=torch.bfloat16), which needs no loss scaling"
            )
        if self._fsdp1_units is not None:
            _fsdp1.fsdp1_step(self)
            return True
        return _fsdp.fsdp_step(self)

    # -- DDP ----------------------------------------------------------------
    def attach(self, model, overlap: bool = True):
        """Route this optimizer's updates through the model's communication.

        ``DistributedDataParallel``: registers a comm hook; DDP then
        all-reduces no gradient, ``p.grad`` keeps each rank's own gradient,
        and ``step()`` votes the Lion directions with 1 bit per parameter.
        ``overlap=True`` (default) starts the vote during backward where that
        is exact (see lionbit.ddp); ``overlap=False`` votes at ``step()``.
        FSDP2 / FSDP1 models: the 1-bit reduce-scatter (lionbit.fsdp,
        lionbit.fsdp1). A plain module needs no attach. Returns self.
        """
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = getattr(model, "_orig_mod", model)  # torch.compile(ddp_model): attach the DDP model inside
        if self._ddp is not None or self._fsdp_params is not None or self._fsdp1_units is not None:
            if isinstance(model, DDP) or _fsdp.is_fsdp2(model) or _fsdp1.is_fsdp1(model):
                raise RuntimeError("DistributedLion.attach: this optimizer is already attached to a model")
        if isinstance(model, DDP):
            self._ddp = attach_ddp(self, model, bool(overlap))
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
