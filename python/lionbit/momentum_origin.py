"""Whose momenta a per-rank state dict holds, entry by entry.

A plain module's or a DDP model's ``opt.state_dict()`` holds this rank's
momenta and, under ``"lionbit"``, a record of them: one int64 tensor, this
rank and then, for each parameter, its key, its momentum's dtype (-1: none
yet) and a checksum (the sum of its bits read as integers, wrapping: exact,
and the same in any order of summation, so on any number of threads or
devices). A per-rank file carries the record whole, and its rank's momenta
match it. The record's size follows the parameters, not which of them have
a momentum yet, so a fresh optimizer's matches a trained one's.

torch.distributed.checkpoint handed such a dict (``dcp.save({"optim":
opt.state_dict()})``: made by the script, not asked for by DCP, which would
get every rank's momentum as rows) keeps one rank's copy of each entry, and
chooses the rank entry by entry to balance the ranks' writes: the momenta
that come back to every rank are a mix of the ranks', and the record is one
rank's. Checked against the record, the loaded momenta say which of them
are not that rank's (:func:`foreign`). A dict made from an optimizer that
has no momenta yet (a fresh one, before ``dcp.load``) has no entries for DCP
to fill: the record it gets back lists momenta that the state lacks.
"""

from typing import List, NamedTuple, Optional

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _recordable(m) -> bool:
    return type(m) is torch.Tensor and m.dtype in _DTYPES  # (not a DTensor's rows: those say whose they are)


def checksum(m: torch.Tensor) -> int:
    """The sum of m's elements' bits as integers, modulo 2^32 (2^64 for
    float64); read in place (two 16-bit elements as one 32-bit integer
    where they can be)."""
    flat = m.detach().reshape(-1)
    if flat.element_size() == 2 and flat.numel() % 2 == 0 and flat.storage_offset() % 2 == 0:
        flat = flat.view(torch.int32)
    bits = flat.view(_INTS[flat.element_size()])
    return int(bits.sum(dtype=torch.int64 if bits.element_size() == 8 else torch.int32))


def _momentum(state: dict, key):
    st = state.get(key)
    return st.get("exp_avg") if isinstance(st, dict) else None


def record(rank: int, state_dict: dict) -> torch.Tensor:
    """``[rank, key, dtype, checksum, key, dtype, checksum, ...]`` for each
    parameter of torch's state dict (integer keys, in ``param_groups``
    order): its momentum's (``"exp_avg"``) dtype and checksum, or -1 and 0
    where it has none."""
    out = [rank]
    for key in (k for g in state_dict["param_groups"] for k in g["params"] if isinstance(k, int)):
        m = _momentum(state_dict["state"], key)
        out += [key, _DTYPES.index(m.dtype), checksum(m)] if _recordable(m) else [key, -1, 0]
    return torch.tensor(out, dtype=torch.int64)


def holds_momenta(state: dict) -> bool:
    """Whether torch's ``state`` holds any momentum (``"exp_avg"``)."""
    return any(isinstance(st, dict) and isinstance(st.get("exp_avg"), torch.Tensor) for st in state.values())


class Origin(NamedTuple):
    """What a state dict's momenta are, against its record."""

    rank: int  #: the rank the record is of
    others: List  #: keys of the momenta that are not that rank's
    compared: int  #: how many momenta were compared
    missing: List  #: keys the record lists a momentum for that the state lacks
    recorded: int  #: how many momenta the record lists


def foreign(rec, state: dict) -> Optional[Origin]:
    """The momenta in ``state`` against the record ``rec``, or None where
    ``rec`` is no record. A momentum of another dtype than recorded (loaded
    into a state dict of another momentum_dtype) is not compared."""
    if type(rec) is not torch.Tensor or rec.dtype != torch.int64 or rec.dim() != 1 or (rec.numel() - 1) % 3:
        return None
    values = rec.tolist()
    others, compared, missing, recorded = [], 0, [], 0
    for key, dtype, total in zip(values[1::3], values[2::3], values[3::3]):
        m = _momentum(state, key)
        if dtype < 0:
            continue  # (none when recorded)
        recorded += 1
        if m is None:
            missing.append(key)
        elif _recordable(m) and _DTYPES.index(m.dtype) == dtype:
            compared += 1
            if checksum(m) != total:
                others.append(key)
    return Origin(values[0], others, compared, missing, recorded)
