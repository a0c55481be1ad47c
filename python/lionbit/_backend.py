"""Registration of the "lionbit" backend and the Python face of its collectives."""

import os
import warnings
import weakref
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _C, lion_math, torch_internals, user_warning
from .hierarchy import ensure_hierarchy

BACKEND_NAME = "lionbit"
_OPS = ("vote", "avg", "sum")


_TRANSPORT_ENV = "LIONBIT_CUDA_TRANSPORT"


def cuda_transport() -> str:
    """What carries CUDA tensors: "nccl" (default where NCCL is available) or
    "gloo" (set ``LIONBIT_CUDA_TRANSPORT=gloo``; needed for several ranks on
    one GPU, which NCCL refuses). With Gloo, standard collectives on CUDA
    tensors use Gloo's CUDA support and the sign path stages its packed bits
    (d/8 bytes, not the tensor) through host memory."""
    want = os.environ.get(_TRANSPORT_ENV, "").strip().lower()
    if want not in ("", "nccl", "gloo"):
        raise ValueError(f"lionbit: {_TRANSPORT_ENV}={want!r}; expected 'nccl' or 'gloo'")
    have_nccl = dist.is_nccl_available() and hasattr(dist, "ProcessGroupNCCL")
    if want == "nccl" and not have_nccl:
        raise RuntimeError(f"lionbit: {_TRANSPORT_ENV}=nccl but this torch has no NCCL")
    return want or ("nccl" if have_nccl else "gloo")


def _nccl(prefix: str, store, rank: int, size: int, timeout: timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts.is_high_priority_stream = False
    torch_internals.set_nccl_timeout(opts, timeout)
    return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)


def _create_backend(opts, backend_options=None):
    """torch's extended creator API: ``opts`` holds the store, this rank's
    number in the group and the group's size, its timeout, and its ranks as
    the default group numbers them (``global_ranks_in_group``, empty for the
    default group), by which lionbit's errors name every rank."""
    if backend_options is not None:
        user_warning.warn(
            f"lionbit: pg_options={type(backend_options).__name__} is not used: lionbit configures its inner "
            f"Gloo and NCCL communicators itself (the group's timeout reaches them all)"
        )
    return backend_over(opts.store, opts.group_rank, opts.group_size, opts.timeout, list(opts.global_ranks_in_group))


def backend_over(store, rank: int, size: int, timeout: timedelta, global_ranks: List[int]):
    """A lionbit backend over ``store``: for a new group (the creator) and
    for a group split from another (``dist.split_group``, DeviceMesh;
    LionBitBackend.split calls this)."""
    # Inner communicators from the same store, each under its own key prefix:
    # "forward" carries the standard collectives in the caller's order, "sign"
    # the sign path, which runs on lionbit's worker thread (and always its
    # header round). With CUDA and NCCL, two more: standard collectives on
    # CUDA tensors, and the sign path's data for CUDA tensors.
    forward = dist.ProcessGroupGloo(dist.PrefixStore("lionbit/forward/", store), rank, size, timeout)
    sign = dist.ProcessGroupGloo(dist.PrefixStore("lionbit/sign/", store), rank, size, timeout)
    forward_cuda = sign_cuda = None
    if _C.built_with_cuda and torch.cuda.is_available() and cuda_transport() == "nccl":
        forward_cuda = _nccl("lionbit/forward_cuda/", store, rank, size, timeout)
        sign_cuda = _nccl("lionbit/sign_cuda/", store, rank, size, timeout)
    return _C.LionBitBackend(forward, sign, rank, size, timeout, forward_cuda, sign_cuda, global_ranks=global_ranks)


def register() -> None:
    """Register "lionbit" with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


# -- the sign collectives' entry points ---------------------------------------------
# lionbit._C binds one sign call, LionBitBackend.call(SignRequest): these fill a request under
# the names callers use (what each field means and each payload's layout:
# backend/sign_request.hpp). Methods of the backend class, so every backend object has them.


def _all_reduce_sign(self, tensor, op="vote", tie_break="zero", tie_seed=-1, hierarchy="flat"):
    """In place: the vote / avg / sum of the tensor's signs over the group."""
    return self.call(_C.SignRequest(collective="all_reduce", op=op, tie_break=tie_break, tie_seed=tie_seed,
                                    hierarchy=hierarchy, tensor=tensor))


def _all_reduce_sign_packed(self, sign, zero, numel, nans, out, op="vote", tie_break="zero", tie_seed=-1,
                            hierarchy="flat", out_planes=False, nans_tally=None, agreement=None):
    """The same on direction bits the caller packed; the result into `out` (``out_planes``: the
    vote as a sign plane and a zero plane, one after the other in uint8 `out`). ``nans_tally``: a
    one-element int64 tensor on out's device that the caller's kernels are still adding
    non-finite counts to; the collective adds it to `nans` when it runs (the caller never waits).
    ``agreement``: a ``_C.Agreement``, resolved once every rank's header round agreed (flat), else
    when the call ends."""
    return self.call(_C.SignRequest(collective="all_reduce", op=op, tie_break=tie_break, tie_seed=tie_seed,
                                    hierarchy=hierarchy, sign=sign, zero=zero, numel=numel, nans=nans, out=out,
                                    out_planes=out_planes, nans_tally=nans_tally, agreement=agreement))


def _all_reduce_levels_packed(self, planes, bits, numel, nans, out, tie_break="zero", tie_seed=-1, agreement=None):
    """Lion Cub's L1 aggregation of `bits`-bit levels; the sign of the sum into `out` (``agreement``: as
    all_reduce_sign_packed's)."""
    return self.call(_C.SignRequest(collective="all_reduce", op="l1", tie_break=tie_break, tie_seed=tie_seed,
                                    planes=planes, value_bits=bits, numel=numel, nans=nans, out=out,
                                    agreement=agreement))


def _reduce_scatter_sign_packed(self, sign, zero, shard_numel, nans, out, op="vote", tie_break="zero",
                                tie_seed=-1, hierarchy="flat", out_planes=False, nans_tally=None, agreement=None):
    """The sign reduce-scatter of N packed shards; this rank's shard into `out` (``out_planes``,
    ``nans_tally``, ``agreement``: as all_reduce_sign_packed's, of the shard)."""
    return self.call(_C.SignRequest(collective="reduce_scatter", op=op, tie_break=tie_break, tie_seed=tie_seed,
                                    hierarchy=hierarchy, sign=sign, zero=zero, numel=shard_numel, nans=nans,
                                    out=out, out_planes=out_planes, nans_tally=nans_tally, agreement=agreement))


def _reduce_scatter_levels_packed(self, planes, bits, shard_numel, nans, out, tie_break="zero", tie_seed=-1,
                                  agreement=None):
    """The reduce-scatter of L1 levels; this rank's shard into `out` (``agreement``: as
    all_reduce_sign_packed's)."""
    return self.call(_C.SignRequest(collective="reduce_scatter", op="l1", tie_break=tie_break, tie_seed=tie_seed,
                                    planes=planes, value_bits=bits, numel=shard_numel, nans=nans, out=out,
                                    agreement=agreement))


for _name, _fill in (("all_reduce_sign", _all_reduce_sign), ("all_reduce_sign_packed", _all_reduce_sign_packed),
                     ("all_reduce_levels_packed", _all_reduce_levels_packed),
                     ("reduce_scatter_sign_packed", _reduce_scatter_sign_packed),
                     ("reduce_scatter_levels_packed", _reduce_scatter_levels_packed)):
    setattr(_C.LionBitBackend, _name, _fill)
del _name, _fill


def _outside(group) -> bool:
    """True on a rank that ``new_group(ranks=...)`` left out: torch hands it
    ``GroupMember.NON_GROUP_MEMBER`` (an int) in place of a group."""
    return isinstance(group, int) and not isinstance(group, bool) and group == dist.GroupMember.NON_GROUP_MEMBER


def check_group(group, what: str) -> None:
    """``group`` as lionbit takes it: None (the default group) or a
    ProcessGroup that this rank is in; else a clear error naming the rank."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _outside(group):
        raise ValueError(
            f"lionbit.{what} on rank {rank}: argument 'group': this rank is not in the group "
            f"(new_group(ranks=...) returned GroupMember.NON_GROUP_MEMBER on it); use the group on its ranks only"
        )
    raise TypeError(
        f"lionbit.{what} on rank {rank}: argument 'group' must be a torch.distributed.ProcessGroup or None, "
        f"not {type(group).__name__}"
    )


def _skipped_outside(group, what: str) -> bool:
    """A collective called on a rank outside ``group`` does nothing there and
    warns, as torch.distributed's collectives do."""
    if not _outside(group):
        return False
    warnings.warn(f"lionbit.{what} on global rank {dist.get_rank()}, which is not in the given group: nothing done "
                  f"here (as torch.distributed's collectives)", stacklevel=3)
    return True


def backend_for(group: Optional[dist.ProcessGroup], device: torch.device, what: str):
    if not dist.is_initialized():
        raise RuntimeError(
            f"lionbit.{what}: the default process group is not initialized; call "
            f"torch.distributed.init_process_group('lionbit') first"
        )
    check_group(group, what)
    pg = group if group is not None else torch_internals.default_group()
    where = f"lionbit.{what} on rank {dist.get_rank()}"
    try:
        backend = torch_internals.backend_object(pg, device)
    except RuntimeError:
        # A device the group has no backend for (meta, xpu, ...): the CPU
        # backend rejects the tensor with a clear error and tells the peers.
        try:
            backend = torch_internals.backend_object(pg, torch.device("cpu"))
        except RuntimeError as err:
            raise RuntimeError(f"{where}: the group has no backend for device type '{device.type}' ({err})") from None
    if not isinstance(backend, _C.LionBitBackend):
        raise RuntimeError(
            f"{where}: the group's backend for device type '{device.type}' is "
            f"'{_name_of(backend, pg)}', not lionbit; create the group with "
            f"init_process_group('lionbit') or new_group(backend='lionbit')"
        )
    return backend


def _name_of(backend, pg) -> str:
    """The backend's own name ("gloo"); a group with a backend a device type
    ("cpu:gloo,cuda:lionbit") calls itself "custom"."""
    try:
        return str(backend.name())
    except (AttributeError, RuntimeError, TypeError):
        return torch_internals.backend_name(pg)


def all_reduce_sign(
    tensor: torch.Tensor,
    op: str = "vote",
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
    *,
    tie_break: str = "zero",
    tie_seed: Optional[int] = None,
    hierarchy: str = "flat",
    topology=None,
):
    """In-place 1-bit sign all-reduce of ``tensor`` over ``group``.

    Every rank hands in a tensor of the same shape and dtype (float32, float16,
    bfloat16, float64 or int8); only its signs (``torch.sign``) matter. The
    result, written back in place and bitwise identical on every rank, is

    - ``"vote"``: ``sign(sum_i sign(x_i))`` (0 on a tie or where all are 0),
    - ``"avg"``: ``sum_i sign(x_i) / N`` (floating dtypes),
    - ``"sum"``: ``sum_i sign(x_i)`` (int8 needs N <= 127).

    ``tie_break`` (vote only) decides where the sum of non-zero signs is 0
    (an even split): ``"zero"`` (default) answers 0; ``"alternate"`` answers
    +1 when ``tie_seed`` is even and -1 when it is odd; ``"random"`` answers
    a pseudo-random sign per element drawn from ``tie_seed`` and the
    element's position (the same on every rank, unbiased per element). An
    element that is 0 on every rank is 0 under every rule. Both keep the
    vote's second phase at 1 bit per element (plus the positions of the
    all-zero elements, when there are any). ``tie_seed``
    must be the same on every rank (checked); default: the call's number on
    this group (pass your step counter for "alternate" when one step makes
    several calls).

    ``hierarchy`` (``"flat"``, ``"node"`` or ``"node_vote"``) runs the call
    over the cluster's nodes (:mod:`lionbit.hierarchy`): ``"node"`` counts
    inside each node first and gives the flat result bit for bit with fewer
    bytes between nodes; ``"node_vote"`` (op "vote") votes the node votes.
    The first such call sets the hierarchy up on every rank (from
    ``topology``, a :class:`lionbit.Topology`, or detected).

    Returns a ``Work`` when ``async_op`` is true (``wait()``, ``get_future()``),
    else None once the result is written. NaN input raises on every rank. On a
    rank outside ``group`` it does nothing, warns and returns None, as
    torch.distributed's collectives do.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"lionbit.all_reduce_sign: argument 'tensor' must be a torch.Tensor, "
            f"not {type(tensor).__name__}"
        )
    if not isinstance(op, str):
        raise TypeError(
            f"lionbit.all_reduce_sign: argument 'op' must be a str ('vote', 'avg' or 'sum'), "
            f"not {type(op).__name__}"
        )
    if _skipped_outside(group, "all_reduce_sign"):
        return None
    backend = backend_for(group, tensor.device, "all_reduce_sign")
    if tie_seed is not None and (isinstance(tie_seed, bool) or not isinstance(tie_seed, int) or tie_seed < 0):
        raise ValueError(f"lionbit.all_reduce_sign: argument 'tie_seed' must be an int >= 0 or None, got {tie_seed!r}")
    if not isinstance(tie_break, str):
        raise TypeError(
            f"lionbit.all_reduce_sign: argument 'tie_break' must be a str ('zero', 'alternate' or 'random'), "
            f"not {type(tie_break).__name__}"
        )
    if not isinstance(hierarchy, str):
        raise TypeError(f"lionbit.all_reduce_sign: argument 'hierarchy' must be a str, not {type(hierarchy).__name__}")
    if hierarchy in ("node", "node_vote"):
        ensure_hierarchy(group, "all_reduce_sign", topology)  # collective, the first time
    work = backend.all_reduce_sign(tensor, op, tie_break, -1 if tie_seed is None else tie_seed, hierarchy)
    # The result replaces the data in place: bump the version counter so that
    # autograd raises if the tensor was saved for a backward pass (c10d's own
    # collectives do not; a silently wrong gradient is worse).
    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)
    if async_op:
        return work
    work.wait()
    return None


def _planes(shards: int, shard_numel: int, device):
    """The reduce-scatter's sign and zero planes on ``device`` (chunk r at lion_math.shard_bit(r, shard_numel))."""
    return lion_math.planes(lion_math.shard_bit(shards, shard_numel), device)


def reduce_scatter_sign(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "vote",
    group: Optional[dist.ProcessGroup] = None,
    *,
    tie_break: str = "zero",
    tie_seed: Optional[int] = None,
    hierarchy: str = "flat",
    topology=None,
) -> None:
    """1-bit sign reduce-scatter: ``input`` holds N * S elements (N chunks of S,
    chunk r for rank r); ``output`` (S elements) receives this rank's chunk of
    vote / avg / sum of ``sign(input)`` over the ranks (see
    :func:`lionbit.all_reduce_sign`, also for ``tie_break`` and
    ``tie_seed``; the random rule's position of element i of chunk r is
    r * 64 * ceil(S / 64) + i, each chunk starting on a 64-bit word). Phase 1
    of the sign all-reduce only: (N - 1)/N * N*S/8 bytes per rank.
    ``hierarchy`` and ``topology``: as for :func:`lionbit.all_reduce_sign`
    ("node": counted inside each node first, the flat result bit for bit)."""
    for name, t in (("output", output), ("input", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"lionbit.reduce_scatter_sign: argument '{name}' must be a torch.Tensor")
    if _skipped_outside(group, "reduce_scatter_sign"):
        return None
    backend = backend_for(group, output.device, "reduce_scatter_sign")
    if not isinstance(hierarchy, str):
        raise TypeError(
            f"lionbit.reduce_scatter_sign: argument 'hierarchy' must be a str, not {type(hierarchy).__name__}"
        )
    if hierarchy in ("node", "node_vote"):
        ensure_hierarchy(group, "reduce_scatter_sign", topology)  # collective, the first time
    n = group.size() if group is not None else dist.get_world_size()
    s = output.numel()
    if input.numel() != n * s:
        # Take part in the header round all the same (the backend rejects the
        # call and tells the peers, who then fail at once).
        try:
            backend.reduce_scatter_sign_packed(*_planes(0, 0, output.device), -1, 0, output.view(-1), op, tie_break)
        except (ValueError, RuntimeError):
            pass
        raise ValueError(
            f"lionbit.reduce_scatter_sign on rank {dist.get_rank()}: argument 'input' has {input.numel()} "
            f"elements; expected world size * output.numel() = {n} * {s}"
        )
    sign, zero = _planes(n, s, output.device)
    flat = input.contiguous().view(-1)
    nans = 0
    for r in range(n):
        _, k = _C.pack_signs_into(flat[r * s : (r + 1) * s], sign, zero, lion_math.shard_bit(r, s))
        nans += k
    out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    seed = -1 if tie_seed is None else int(tie_seed)
    backend.reduce_scatter_sign_packed(sign, zero, s, nans, out.view(-1), op, tie_break, seed, hierarchy).wait()
    if out is not output:
        output.copy_(out)


def _lionbit_backend_any_device(group, what: str):
    """The group's lionbit backend: the CPU one, or, for a group made with
    "cpu:gloo,cuda:lionbit", the CUDA one."""
    try:
        return backend_for(group, torch.device("cpu"), what)
    except RuntimeError:
        if not torch.cuda.is_available():
            raise
        return backend_for(group, torch.device("cuda"), what)


# Momentum-synchronization counters (lionbit.momentum_sync), kept here on the
# Python side, per lionbit backend object: its collectives are standard ones,
# forwarded, which the C++ counters do not see. A backend's Python object
# lives as long as someone holds it; each process group that recorded into it
# holds it (weakly keyed: nothing outlives the group).
_MOMENTUM_SYNC_KEYS = (
    "momentum_sync_calls",
    "momentum_sync_steps",
    "momentum_sync_elements",
    "momentum_sync_bytes_sent",
    "momentum_sync_bytes_received",
)
_momentum_sync_counters = weakref.WeakKeyDictionary()  # lionbit backend -> its counters
_backends_of_groups = weakref.WeakKeyDictionary()  # process group -> {its lionbit backends}


def _momentum_sync_counters_of(backend, group: Optional[dist.ProcessGroup] = None) -> dict:
    counters = _momentum_sync_counters.get(backend)
    if counters is None:
        counters = _momentum_sync_counters[backend] = dict.fromkeys(_MOMENTUM_SYNC_KEYS, 0)
    pg = group if group is not None else torch_internals.default_group()
    _backends_of_groups.setdefault(pg, set()).add(backend)
    return counters


def record_momentum_sync(group, device: torch.device, elements: int, sent: int, received: int, call: bool) -> None:
    """Adds one momentum synchronization's figures to the counters of the
    group's lionbit backend for ``device``."""
    counters = _momentum_sync_counters_of(backend_for(group, device, "stats"), group)
    counters["momentum_sync_calls"] += int(call)
    counters["momentum_sync_elements"] += elements
    counters["momentum_sync_bytes_sent"] += sent
    counters["momentum_sync_bytes_received"] += received


def record_momentum_sync_step(group) -> None:
    """Counts a step of an optimizer with momentum_sync on (the denominator
    of ``momentum_sync_bytes_per_step``). Nothing without a lionbit group."""
    if not dist.is_initialized():
        return
    try:
        backend = _lionbit_backend_any_device(group, "stats")
    except RuntimeError:
        return
    _momentum_sync_counters_of(backend, group)["momentum_sync_steps"] += 1


def stats(group: Optional[dist.ProcessGroup] = None) -> dict:
    """Counters of the group's lionbit backend.

    The sign path: ``bytes_sent`` / ``bytes_received`` (payload bytes of this
    rank, headers included), ``sign_allreduce_calls``, ``elements``, seconds
    spent in ``pack_seconds``, ``comm_seconds``, ``vote_seconds``,
    ``unpack_seconds``, and for votes at even N ``tie_rounds`` (chunks whose
    tie positions took a round of their own) and ``inline_tie_chunks``
    (chunks whose tie plane rode in phase 2 because the previous vote had
    dense ties); at N = 2 ``late_zero_chunks`` (chunks whose signs left
    before the header round that announced zeros in them or in the chunks
    after them, so their zeros followed in a message of their own). Exact
    zeros (and a vote's tie positions) travel as the smallest of a list of
    positions, a list of runs, the runs packed (variable-length gaps and
    lengths with repeats: a dead ReLU unit's zero column costs a few bytes)
    or a plane: ``zero_lists_sent``, ``zero_runs_sent``,
    ``zero_packed_sent``, ``zero_planes_sent`` count the shard messages sent
    in each form, ``zero_bytes_sent`` their bytes (part of ``bytes_sent``).

    Momentum synchronization (``DistributedLion(momentum_sync=...)``; not in
    the figures above): ``momentum_sync_calls`` (synchronizations),
    ``momentum_sync_elements`` (momentum elements averaged, summed over the
    calls), ``momentum_sync_bytes_sent`` / ``momentum_sync_bytes_received``
    (payload bytes this rank sent / received: the bfloat16 all-to-all and
    all-gather send and receive (N - 1)/N of the padded buffer each, so
    2 (N - 1)/N * 2 bytes per element per call, a ring all-reduce's figure),
    ``momentum_sync_steps`` (steps applied by optimizers with momentum_sync
    on) and ``momentum_sync_bytes_per_step`` (bytes sent per such step,
    amortized: sent / steps, 0.0 before the first).

    With a hierarchy (:mod:`lionbit.hierarchy`): ``intra_node_bytes_sent`` /
    ``intra_node_bytes_received`` and ``inter_node_bytes_sent`` /
    ``inter_node_bytes_received``, the payload of the hierarchical calls over
    this rank's node and cross-node communicators (their header round is in
    ``bytes_sent``).
    """
    backend = _lionbit_backend_any_device(group, "stats")
    out = {k: (int(v) if not k.endswith("_seconds") else v) for k, v in backend.stats().items()}
    sync = _momentum_sync_counters.get(backend) or dict.fromkeys(_MOMENTUM_SYNC_KEYS, 0)
    out.update(sync)
    out.update({k: int(v) for k, v in backend.hierarchy_stats().items()})
    steps = sync["momentum_sync_steps"]
    out["momentum_sync_bytes_per_step"] = sync["momentum_sync_bytes_sent"] / steps if steps else 0.0
    return out


def reset_stats(group: Optional[dist.ProcessGroup] = None) -> None:
    """Zero the counters of the group's lionbit backend (the momentum
    synchronization's too)."""
    backend = _lionbit_backend_any_device(group, "reset_stats")
    backend.reset_stats()
    backend.reset_hierarchy_stats()
    counters = _momentum_sync_counters.get(backend)
    if counters is not None:
        for k in counters:
            counters[k] = 0
