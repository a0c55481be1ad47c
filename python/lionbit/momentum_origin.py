"""Whose momenta a per-rank state dict holds, entry by entry.

A plain module's or a DDP model's ``opt.state_dict()`` holds this rank's
momenta and, under ``"lionbit"``, a record of them: one int64 tensor, this
rank and then, for each momentum, its key, its dtype and a checksum (the sum
of its bits read as integers, wrapping: exact, and the same in any order of
summation, so on any number of threads or devices). A per-rank file carries
the record whole, and its rank's momenta match it.

torch.distributed.checkpoint handed such a dict (``dcp.save({"optim":
opt.state_dict()})``: made by the script, not asked for by DCP, which would
get every rank's momentum as rows) keeps one rank's copy of each entry, and
chooses the rank entry by entry to balance the ranks' writes: the momenta
that come back to every rank are a mix of the ranks', and the record is one
rank's. Checked against the record, the loaded momenta say which of them
are not that rank's (:func:`foreign`).
"""

from typing import List, Optional, Tuple

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


def record(rank: int, state: dict) -> torch.Tensor:
    """``[rank, key, dtype, checksum, key, dtype, checksum, ...]`` for each
    momentum (``"exp_avg"``) of torch's ``state`` (integer keys)."""
    out = [rank]
    for key, st in state.items():
        m = st.get("exp_avg") if isinstance(st, dict) else None
        if isinstance(key, int) and _recordable(m):
            out += [key, _DTYPES.index(m.dtype), checksum(m)]
    return torch.tensor(out, dtype=torch.int64)


def foreign(rec, state: dict) -> Optional[Tuple[int, List, int]]:
    """(the rank the record ``rec`` is of, the keys of the momenta in
    ``state`` that are not that rank's, how many were compared), or None
    where ``rec`` is no record. A momentum the record does not list, or of
    another dtype than it recorded (loaded into a state dict of another
    momentum_dtype), is not compared."""
    if type(rec) is not torch.Tensor or rec.dtype != torch.int64 or rec.dim() != 1 or (rec.numel() - 1) % 3:
        return None
    values = rec.tolist()
    recorded = {key: (dtype, total) for key, dtype, total in zip(values[1::3], values[2::3], values[3::3])}
    others, compared = [], 0
    for key, st in state.items():
        m = st.get("exp_avg") if isinstance(st, dict) else None
        if key not in recorded or not _recordable(m) or _DTYPES.index(m.dtype) != recorded[key][0]:
            continue
        compared += 1
        if checksum(m) != recorded[key][1]:
            others.append(key)
    return values[0], others, compared
