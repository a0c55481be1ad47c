"""DistributedLion on FSDP1 (``FullyShardedDataParallel``) models.

``opt.attach(model)`` on an FSDP1 root registers a communication hook
(``register_comm_hook``) on every FSDP instance of the model, each with its
own state object (a :class:`_Unit`) that knows the instance's
``FlatParameter``:

- sharded strategies (``FULL_SHARD``, ``SHARD_GRAD_OP``): FSDP calls
  ``hook(unit, padded_unsharded_grad, sharded_output)``. The padded gradient
  is the local gradient of the flat parameter, padded at the end to N * S
  elements, chunk r (S elements) being rank r's shard. The hook updates the
  unit's full-size local momentum and packs the Lion direction of chunk r at
  bit r * 64 * ceil(S / 64) (padding elements are skipped: no momentum, no
  vote that counts), runs lionbit's sign reduce-scatter (phase 1 of the sign
  all-reduce only: (N - 1)/N * N*S/8 bytes per rank) and keeps Delta of the
  own shard for ``step()`` (and writes it into FSDP's output, so the sharded
  gradient holds Delta, for logging);
- ``NO_SHARD``: FSDP calls ``hook(unit, grad)`` with the whole local
  gradient; the hook runs the sign all-reduce (DDP's path) and keeps Delta
  (also written into the gradient).

``step()`` applies ``x = x * (1 - lr * wd) - lr * Delta`` to each unit's
local flat-parameter shard, parameter by parameter (each original
parameter's hyperparameters come from its optimizer group; with
``use_orig_params=False`` the groups hold the FlatParameters). FSDP's next
all-gather spreads the update.

Momentum: one flat full-size tensor per FSDP instance, in FlatParameter
order (alignment padding included, never touched), kept on the optimizer
(``opt.attachment.units``), not in ``opt.state``; see :func:`local_state_dict`.
"""

from typing import List, Optional

import torch

from . import lion_math, step_vote
from ._backend import backend_for
from .attachment import Attachment
from .fsdp import check_grads_untouched

try:
    import torch.distributed.fsdp._traversal_utils as traversal_utils
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
except ImportError:  # pragma: no cover - optional: a torch without FSDP1
    FSDP = ShardingStrategy = traversal_utils = None

_WHERE = "DistributedLion.attach (FSDP1)"


def is_fsdp1(model) -> bool:
    return FSDP is not None and isinstance(model, FSDP)


class _Unit:
    """The comm-hook state of one FSDP instance: its FlatParameter's layout,
    hyperparameter groups per original parameter and local momentum."""

    def __init__(self, att, module, name: str, segments, numel: int, sharded: bool, group):
        self.att = att
        self.opt = att.opt
        self.module = module
        self.name = name
        self.handle = module._handle
        self.segments = segments  # (offset in the unpadded flat param, numel, optimizer group, fqn)
        self.numel = numel  # unpadded flat numel (alignment padding included)
        self.sharded = sharded
        self.group = group
        self.momentum: Optional[torch.Tensor] = None

    def momentum_tensor(self) -> torch.Tensor:
        if self.momentum is None:
            self.momentum = torch.zeros(self.numel, dtype=self.opt.momentum_dtype)
        return self.momentum

    def where(self) -> str:
        return f"DistributedLion (FSDP1 comm hook of '{self.name or '<root>'}') on rank {self.group.rank()}"


def _fsdp1_hook(unit: _Unit, grad: torch.Tensor, output: Optional[torch.Tensor] = None) -> None:
    with torch.no_grad():
        if output is None:
            _reduce_no_shard(unit, grad)
        else:
            _reduce_sharded(unit, grad, output)


def _check_pending(unit: _Unit) -> None:
    if unit in unit.att.pending:
        raise RuntimeError(
            f"{unit.where()}: the unit was reduced twice before step(): a second synchronized backward would "
            f"advance the momentum twice; for gradient accumulation run all micro-batches but the last "
            f"under model.no_sync()"
        )


def _check_grad(unit: _Unit, grad: torch.Tensor, expect: int) -> None:
    fp = unit.handle.flat_param
    if grad.numel() != expect or grad.dim() != 1:
        raise RuntimeError(
            f"{unit.where()}: FSDP passed a gradient of shape {tuple(grad.shape)}, expected {expect} elements for "
            f"this unit's FlatParameter ({fp._unpadded_unsharded_size.numel()} unpadded): an unsupported FSDP code "
            f"path or torch version (lionbit is tested with torch 2.15)"
        )
    if grad.device.type != "cpu":
        raise RuntimeError(f"{unit.where()}: gradient on {grad.device}; the FSDP1 path supports CPU only")


def _pack(unit: _Unit, grad: torch.Tensor, shard: int, shards: int):
    """Direction bits of the unit's local gradient: chunk r of `shard`
    elements at bit r * 64 * ceil(shard / 64). Returns (sign, zero, nans)."""
    opt = unit.opt
    words = (shard + 63) // 64
    sign, zero = opt.voter.shard_planes(shards, shard)  # "l1": the level planes and None
    m = unit.momentum_tensor()
    nans = 0
    for off, numel, group, _ in unit.segments:
        coefs = lion_math.Coefs(group)
        lo, end = off, off + numel
        parts = []
        while lo < end:
            r = lo // shard
            hi = min(end, (r + 1) * shard)
            g, mr = grad[lo:hi], m[lo:hi]
            bit = r * words * 64 + (lo - r * shard)
            if opt.bits:
                parts.append((g, mr, bit))
            else:
                nans += lion_math.direction_into(g, mr, coefs, sign, zero, bit, opt.fused_for(mr, g))
            lo = hi
        if parts:  # one parameter's pieces: its L1 scale over all of them
            nans += lion_math.levels_into(parts, coefs, opt.bits, sign)
    return sign, zero, nans


def _zero_padding(unit: _Unit, delta: torch.Tensor, base: int) -> None:
    """Zeroes Delta wherever the flat elements [base, base + len) are padding."""
    keep = torch.zeros(delta.numel(), dtype=torch.bool)
    for off, numel, _, _ in unit.segments:
        lo, hi = max(off, base), min(off + numel, base + delta.numel())
        if lo < hi:
            keep[lo - base : hi - base] = True
    delta.masked_fill_(~keep, 0)


def _reduce_sharded(unit: _Unit, grad: torch.Tensor, output: torch.Tensor) -> None:
    n, rank = unit.group.size(), unit.group.rank()
    s = output.numel()
    _check_grad(unit, grad, n * s)
    if unit.numel > n * s:
        raise RuntimeError(f"{unit.where()}: {unit.numel} flat elements do not fit {n} shards of {s}")
    _check_pending(unit)
    sign, zero, nans = _pack(unit, grad, s, n)
    delta = torch.empty(s, dtype=unit.opt.voter.delta_dtype)
    unit.opt.voter.reduce_scatter(sign, zero, s, nans, delta, unit.group, "attach (FSDP1 comm hook)")
    _zero_padding(unit, delta, rank * s)
    unit.att.pending[unit] = delta
    output.copy_(delta)


def _reduce_no_shard(unit: _Unit, grad: torch.Tensor) -> None:
    """NO_SHARD is DDP's case: the gradient stays this rank's own (p.grad
    after backward is the local gradient, clipping and logging see it), and
    step() votes the directions of the gradients as they stand then."""
    _check_grad(unit, grad, unit.numel)


def no_shard_entries(att) -> list:
    """The step_vote entries of every NO_SHARD unit with a gradient: one per
    original parameter's segment of the flat parameter."""
    opt = att.opt
    entries = []
    for unit in att.units:
        fp = unit.handle.flat_param
        if unit.sharded or fp.grad is None:
            continue
        g, x, m = fp.grad.view(-1), fp.data.view(-1), unit.momentum_tensor()
        if g.numel() < unit.numel or x.numel() < unit.numel:
            raise RuntimeError(
                f"{unit.where()}: step() found a flat gradient of {g.numel()} elements, expected {unit.numel}"
            )
        for off, numel, group, _ in unit.segments:
            gs, xs, ms = g[off : off + numel], x[off : off + numel], m[off : off + numel]
            entries.append(step_vote.Entry(xs, gs, ms, lion_math.Coefs(group), opt.fused_for(xs, gs)))
    return entries


def fsdp1_step(att) -> None:
    """Applies the sharded units' pending updates."""
    opt = att.opt
    pending, att.pending = att.pending, {}
    check_grads_untouched(pending, lambda unit: unit.handle.flat_param.grad, "FSDP1")
    for unit, delta in pending.items():
        local = unit.handle.flat_param.data
        base = unit.group.rank() * delta.numel() if unit.sharded else 0
        if local.numel() != delta.numel() or not local.is_contiguous():
            raise RuntimeError(
                f"{unit.where()}: step() found the local FlatParameter with {local.numel()} elements, Delta has "
                f"{delta.numel()} (is the model still unsharded, e.g. inside summon_full_params?)"
            )
        for off, numel, group, _ in unit.segments:
            lo, hi = max(off, base), min(off + numel, base + delta.numel())
            if lo >= hi:
                continue
            x, d = local[lo - base : hi - base], delta[lo - base : hi - base]
            lion_math.apply_update(x, d, lion_math.Coefs(group), opt.fused_for(x, d))


class FSDP1Attachment(Attachment):
    """An FSDP1 model's attachment: a comm hook with one :class:`_Unit` per
    FSDP instance; the sharded units' pending updates."""

    kind = "FSDP1"

    @staticmethod
    def accepts(model) -> bool:
        return is_fsdp1(model)

    def __init__(self, opt, model, overlap: bool = True):
        super().__init__(opt, None)
        self.model = model
        self.pending = {}  # sharded unit -> Delta of its local flat shard, pending step()
        self.units, self.states, group = _units(self, opt, model)
        self.group = opt.group if opt.group is not None else group
        # torch's own checks (root, hybrid, one hook), then one state object per instance.
        model.register_comm_hook(self.units[0], _fsdp1_hook)
        by_module = {u.module: u for u in self.units}
        for state in self.states:
            if state._comm_hook is not _fsdp1_hook:
                raise RuntimeError(f"{_WHERE}: register_comm_hook did not reach every FSDP instance")
            state._comm_hook_state = by_module.get(state)

    def is_attached_to(self, model) -> bool:
        return model is self.model

    def detach(self) -> None:
        for state in self.states:
            state._comm_hook = state._comm_hook_state = None  # FSDP's own reduce-scatter again
        self.pending = {}

    def step(self, grad_scaler=None, abstain: bool = False) -> bool:
        if grad_scaler is not None:
            raise RuntimeError(
                "DistributedLion.step (FSDP1): GradScaler is not supported with FSDP: the 1-bit reduce-scatter "
                "computes the Lion update during backward, from the still-scaled gradients. Use bfloat16 mixed "
                "precision instead (torch.autocast with dtype=torch.bfloat16), which needs no loss scaling"
            )
        fsdp1_step(self)
        entries = no_shard_entries(self)
        return step_vote.voted_step(self.opt, None, lambda: self.vote(entries), self.group, abstain)

    def momenta(self):
        out = []
        for unit in self.units:
            m = unit.momentum_tensor()
            out += [m[off : off + numel] for off, numel, _, _ in unit.segments]
        return out

    def local_state_dict(self) -> dict:
        return local_state_dict(self)

    def load_local_state_dict(self, state_dict: dict) -> None:
        load_local_state_dict(self, state_dict)


def _units(att, opt, model):
    """Checks an FSDP1 model; returns (its units, its FSDP states, its process group)."""
    try:
        states = traversal_utils._get_fsdp_states(model)
    except (ImportError, AttributeError) as err:
        raise NotImplementedError(
            f"{_WHERE}: this torch {torch.__version__} lacks the FSDP1 internals lionbit uses ({err}); "
            f"lionbit is tested with torch 2.15"
        ) from None
    if not model.check_is_root():
        raise ValueError(f"{_WHERE}: attach the root FullyShardedDataParallel instance, not a nested one")
    # module names without FSDP's wrapper prefixes ("b", not "_fsdp_wrapped_module.b")
    names = {
        m: n.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "") for n, m in model.named_modules()
    }
    known = opt.param_group_of()
    units: List[_Unit] = []
    covered = set()
    group0 = None
    for state in states:
        if not isinstance(state, FSDP):
            raise NotImplementedError(
                f"{_WHERE}: composable FSDP1 states are not supported, only FullyShardedDataParallel modules"
            )
        name = names.get(state, "?")
        label = f"FSDP instance '{name or '<root>'}'"
        strategy = state.sharding_strategy
        if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            raise NotImplementedError(
                f"{_WHERE}: {label} uses sharding_strategy={strategy.name}; hybrid sharding is not supported "
                f"(FULL_SHARD, SHARD_GRAD_OP and NO_SHARD are)"
            )
        if state._comm_hook is not None:
            raise RuntimeError(
                f"{_WHERE}: {label} already has a communication hook"
                + (" (this model is already attached to a DistributedLion)" if state._comm_hook is _fsdp1_hook else "")
            )
        if state.cpu_offload is not None and state.cpu_offload.offload_params:
            raise NotImplementedError(f"{_WHERE}: {label}: CPUOffload(offload_params=True) is not supported")
        mp = state.mixed_precision
        if mp is not None and any(
            getattr(mp, k, None) is not None for k in ("param_dtype", "reduce_dtype", "buffer_dtype")
        ):
            raise NotImplementedError(
                f"{_WHERE}: {label}: FSDP1 MixedPrecision is not supported by lionbit's FSDP1 path "
                f"(use FSDP2's MixedPrecisionPolicy, or float32 parameters)"
            )
        if group0 is None:
            group0 = state.process_group
        elif state.process_group is not group0:
            raise NotImplementedError(f"{_WHERE}: {label} uses another process group than the root")
        handle = state._handle
        if handle is None:
            continue
        fp = handle.flat_param
        if fp.device.type != "cpu":
            raise NotImplementedError(
                f"{_WHERE}: {label} has parameters on {fp.device}; the FSDP1 path supports CPU only"
            )
        use_orig = handle._use_orig_params
        if use_orig and fp._params is None:
            raise RuntimeError(
                f"{_WHERE}: {label}: use_orig_params=True but the FlatParameter keeps no original parameters"
            )
        prefix = f"{name}." if name else ""
        segments = []
        off, i = 0, 0
        for numel, padding in zip(fp._numels_with_padding, fp._is_padding_mask):
            if not padding:
                fqn = prefix + fp._fqns[i]
                owner = fp._params[i] if use_orig else fp
                if owner.requires_grad:
                    group = known.get(owner)
                    if group is None:
                        raise ValueError(
                            f"{_WHERE}: the FSDP model's parameter '{fqn}' "
                            + ("" if use_orig else f"(in the FlatParameter of {label}) ")
                            + "is not in this optimizer; it would be voted with no momentum or hyperparameters"
                        )
                    covered.add(owner)
                    segments.append((off, numel, group, fqn))
                i += 1
            off += numel
        if off != fp._unpadded_unsharded_size.numel():
            raise RuntimeError(
                f"{_WHERE}: {label}: FlatParameter layout covers {off} elements, "
                f"its size is {fp._unpadded_unsharded_size}"
            )
        units.append(_Unit(att, state, name, segments, off, strategy != ShardingStrategy.NO_SHARD, state.process_group))
    if not units:
        raise ValueError(f"{_WHERE}: the model has no parameters managed by FSDP")
    stray = [p for p in known if p not in covered]
    if stray:
        raise ValueError(
            f"{_WHERE}: {len(stray)} of this optimizer's parameters are not managed by the FSDP model "
            f"(with use_orig_params=False pass model.parameters(), the FlatParameters)"
        )
    backend_for(group0, torch.device("cpu"), "attach (FSDP1)")  # a lionbit group, or a clear error
    return units, states, group0


# -- checkpoints --------------------------------------------------------------


def local_state_dict(att) -> dict:
    """This rank's optimizer state for a per-rank file: the momentum of each
    FSDP instance (flat, full-size), keyed by the instance's module name,
    and the hyperparameters of every group."""
    opt = att.opt
    if att.pending:
        raise RuntimeError(
            "DistributedLion.local_state_dict: an update is pending (backward ran, step() did not); "
            "checkpoint after step()"
        )
    g = att.units[0].group
    return {
        "momentum": {u.name: u.momentum_tensor().clone() for u in att.units},
        "param_groups": [{k: v for k, v in grp.items() if k != "params"} for grp in opt.param_groups],
        "aggregation": opt.aggregation,
        "rank": g.rank(),
        "world_size": g.size(),
    }


def load_local_state_dict(att, sd: dict) -> None:
    where = "DistributedLion.load_local_state_dict"
    opt = att.opt
    g = att.units[0].group
    if (sd.get("rank"), sd.get("world_size")) != (g.rank(), g.size()):
        raise ValueError(
            f"{where} on rank {g.rank()}: the file holds rank {sd.get('rank')} of {sd.get('world_size')}, "
            f"this is rank {g.rank()} of {g.size()} (each rank loads its own file; same world size)"
        )
    if sd.get("aggregation") != opt.aggregation:
        raise ValueError(
            f"{where}: the checkpoint used aggregation={sd.get('aggregation')!r}, this optimizer {opt.aggregation!r}"
        )
    if len(sd["param_groups"]) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the checkpoint has {len(sd['param_groups'])} parameter groups, "
            f"this optimizer {len(opt.param_groups)}"
        )
    units = {u.name: u for u in att.units}
    if set(sd["momentum"]) != set(units):
        raise ValueError(
            f"{where}: the checkpoint's FSDP instances {sorted(sd['momentum'])} "
            f"differ from the model's {sorted(units)}"
        )
    for name, m in sd["momentum"].items():
        u = units[name]
        if m.numel() != u.numel:
            raise ValueError(
                f"{where}: momentum of FSDP instance '{name}' has {m.numel()} elements, expected {u.numel}"
            )
        u.momentum_tensor().copy_(m.reshape(-1))
    for mine, saved in zip(opt.param_groups, sd["param_groups"]):
        for k, v in saved.items():
            mine[k] = tuple(v) if k == "betas" else v
    att.pending = {}
