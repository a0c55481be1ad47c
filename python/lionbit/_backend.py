"""Registration of the "lionbit" backend and the Python face of its collectives."""

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from . import _C

BACKEND_NAME = "lionbit"
_OPS = ("vote", "avg", "sum")


def _create_backend(store, rank: int, size: int, timeout: timedelta):
    # Two inner Gloo communicators from the same store: one carries the
    # standard collectives in the caller's order, the other the sign path,
    # which runs on lionbit's worker thread. Separate key prefixes keep their
    # rendezvous apart.
    forward = dist.ProcessGroupGloo(dist.PrefixStore("lionbit/forward/", store), rank, size, timeout)
    sign = dist.ProcessGroupGloo(dist.PrefixStore("lionbit/sign/", store), rank, size, timeout)
    return _C.LionBitBackend(forward, sign, rank, size, timeout)


def register() -> None:
    """Register "lionbit" with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, devices=["cpu", "cuda"])


def _backend_for(group: Optional[dist.ProcessGroup], device: torch.device, what: str):
    if not dist.is_initialized():
        raise RuntimeError(
            f"lionbit.{what}: the default process group is not initialized; call "
            f"torch.distributed.init_process_group('lionbit') first"
        )
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    where = f"lionbit.{what} on rank {pg.rank()}"
    try:
        backend = pg._get_backend(device)
    except RuntimeError:
        # A device the group has no backend for (meta, xpu, ...): the CPU
        # backend rejects the tensor with a clear error and tells the peers.
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except RuntimeError as err:
            raise RuntimeError(f"{where}: the group has no backend for device type '{device.type}' ({err})") from None
    if not isinstance(backend, _C.LionBitBackend):
        raise RuntimeError(
            f"{where}: the group's backend for device type '{device.type}' is "
            f"'{pg._get_backend_name()}', not lionbit; create the group with "
            f"init_process_group('lionbit') or new_group(backend='lionbit')"
        )
    return backend


def all_reduce_sign(
    tensor: torch.Tensor,
    op: str = "vote",
    group: Optional[dist.ProcessGroup] = None,
    async_op: bool = False,
):
    """In-place 1-bit sign all-reduce of ``tensor`` over ``group``.

    Every rank hands in a tensor of the same shape and dtype (float32, float16,
    bfloat16, float64 or int8); only its signs (``torch.sign``) matter. The
    result, written back in place and bitwise identical on every rank, is

    - ``"vote"``: ``sign(sum_i sign(x_i))`` (0 on a tie or where all are 0),
    - ``"avg"``: ``sum_i sign(x_i) / N`` (floating dtypes),
    - ``"sum"``: ``sum_i sign(x_i)`` (int8 needs N <= 127).

    Returns a ``Work`` when ``async_op`` is true (``wait()``, ``get_future()``),
    else None once the result is written. NaN input raises on every rank.
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
    backend = _backend_for(group, tensor.device, "all_reduce_sign")
    work = backend.all_reduce_sign(tensor, op)
    # The result replaces the data in place: bump the version counter so that
    # autograd raises if the tensor was saved for a backward pass (c10d's own
    # collectives do not; a silently wrong gradient is worse).
    if not tensor.is_inference():
        torch.autograd.graph.increment_version(tensor)
    if async_op:
        return work
    work.wait()
    return None


def stats(group: Optional[dist.ProcessGroup] = None) -> dict:
    """Counters of the group's lionbit backend (sign path only).

    ``bytes_sent`` / ``bytes_received`` (payload bytes of this rank, headers
    included), ``sign_allreduce_calls``, ``elements``, and seconds spent in
    ``pack_seconds``, ``comm_seconds``, ``vote_seconds``, ``unpack_seconds``.
    """
    raw = _backend_for(group, torch.device("cpu"), "stats").stats()
    return {k: (int(v) if not k.endswith("_seconds") else v) for k, v in raw.items()}


def reset_stats(group: Optional[dist.ProcessGroup] = None) -> None:
    """Zero the counters of the group's lionbit backend."""
    _backend_for(group, torch.device("cpu"), "reset_stats").reset_stats()
