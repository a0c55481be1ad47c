"""A second buffer for every momentum (``DistributedLion(double_buffer=True)``):
the direction's pass over g and m also writes the next momentum.

A voted step may change the momentum only once every rank has agreed to it
(no direction non-finite anywhere, no GradScaler skip, DDP's votes not
dropped), so with one buffer per momentum it passes over memory seven
times a parameter: the direction reads g and m (2), the momentum update
after the agreement reads g and m again and writes m (3), the parameter
update reads and writes x (2). With a second buffer the direction's pass
writes ``b2 m + (1 - b2) g`` into it (the fused kernels' ``m_out``: the
same bits as the update in place), and the agreement makes it the momentum
by swapping the two buffers' storage: five passes, a fused Lion step's, for
one more momentum's memory. Nothing changes before the agreement, as with
one buffer: a step that is skipped or fails leaves the momentum as it was,
and the second buffer's contents are never read unless the swap follows the
pass that wrote them.

The swap (one C++ call a step, ``Tensor.set_``) keeps every momentum's
tensor object (``opt.state[p]["exp_avg"]`` stays the same object: its
storage changes), so whatever holds the momentum (a plan, a checkpoint's
state dict, the user's own reference) holds the new one. A view made
of a momentum before a step keeps the old storage: read the momentum from
``opt.state`` (or ``state_dict()``) after the step, as torch's optimizers
expect.

The record of which momenta have their next value written is this step's
alone: :meth:`NextMomenta.clear` runs at the end of every step (applied,
skipped or failed), and a momentum packed without its second buffer (the
torch path, a piece of a tensor) is struck off at once.
"""

from typing import Dict, List, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C


def for_optimizer(double_buffer: bool, bits) -> Optional["NextMomenta"]:
    """DistributedLion's second buffers: a :class:`NextMomenta` where
    ``double_buffer``, else None; refused with "l1"'s levels (``bits``)."""
    if not double_buffer:
        return None
    if bits:
        raise ValueError(
            "DistributedLion(double_buffer=True): aggregation 'l1' packs levels, not the fused direction that "
            "writes the next momentum; use double_buffer=False with 'l1'")
    return NextMomenta()


def check_attachment(nexts: Optional["NextMomenta"], kind) -> None:
    """Refuses to attach an optimizer with second buffers (``nexts``) to a
    model whose attachment class ``kind`` does not serve them (FSDP2, FSDP1:
    their steps keep the momentum in pieces of the shards)."""
    if nexts is not None and kind is not None and not kind.serves_next_momenta:
        raise ValueError(
            f"DistributedLion(double_buffer=True).attach: {kind.kind} keeps each rank's momentum in pieces of its "
            f"shards; the second momentum buffer serves plain modules and DDP. Use double_buffer=False")


class NextMomenta:
    """Each momentum's second buffer (made at its first use, dropped with the
    momentum) and which of them hold this step's next momentum."""

    def __init__(self):
        self.spares = WeakIdKeyDictionary()  # momentum -> its second buffer
        self.written: Dict[int, torch.Tensor] = {}  # id -> momentum whose next value its buffer holds

    def spare(self, m: torch.Tensor) -> torch.Tensor:
        """``m``'s second buffer (uninitialized at first)."""
        s = self.spares.get(m)
        if s is None or s.shape != m.shape or s.dtype != m.dtype or s.device != m.device:
            s = self.spares[m] = torch.empty_like(m, memory_format=torch.contiguous_format)
        return s

    def out(self, m: torch.Tensor, start: int, length: int) -> Optional[torch.Tensor]:
        """Where the pass that packs elements [start, start + length) of m
        writes its next momentum: m's second buffer where that is all of a
        contiguous m (recorded as written), else None (m is struck off: its
        momentum is updated after the agreement, as with one buffer)."""
        if start != 0 or length != m.numel() or not m.is_contiguous():
            self.forget(m)
            return None
        self.written[id(m)] = m
        return self.spare(m)

    def forget(self, m: torch.Tensor) -> None:
        """m's next momentum is not (or no longer) in its second buffer."""
        self.written.pop(id(m), None)

    def take(self, momenta: list) -> list:
        """Of a voted step's momentum items ((g, m, coefs, fused), every rank
        having agreed): makes the written ones' second buffers their momenta
        and returns the others, to be updated from g."""
        if not self.written:
            return momenta
        rest, done = [], []
        for item in momenta:
            m = item[1]
            if self.written.pop(id(m), None) is m:
                done.append(m)
            else:
                rest.append(item)
        swap(done, [self.spares[m] for m in done])
        return rest

    def clear(self) -> None:
        """The step is over: no second buffer holds a next momentum any more."""
        self.written.clear()


def swap(ms: List[torch.Tensor], spares: List[torch.Tensor]) -> None:
    """Exchanges the storage of each ``ms[i]`` and ``spares[i]`` (same shape,
    dtype and device, contiguous): each tensor object keeps its identity.
    One call into C++ for the list (``Tensor.set_`` twice a pair, about
    0.5 us; a Python loop takes 1.6)."""
    if ms:
        _C.swap_storages(ms, spares)
