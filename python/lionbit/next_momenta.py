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

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _C, torch_internals


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
    model whose attachment class ``kind`` does not serve them (FSDP1: its
    momenta are views of one flat buffer a unit, which a swap of storage
    would strand)."""
    if nexts is not None and kind is not None and not kind.serves_next_momenta:
        raise ValueError(
            f"DistributedLion(double_buffer=True).attach: {kind.kind} keeps each unit's momenta as views of one flat "
            f"buffer; the second momentum buffers serve plain modules, DDP and FSDP2 / HSDP. Use double_buffer=False")


class NextMomenta:
    """Each momentum's second buffer (made at its first use, dropped with the
    momentum) and which of them hold this step's next momentum: the spans
    (start, length) of each that the step's passes wrote. A momentum may come
    as a flat view of itself (FSDP2's step) and in spans (FSDP2's chunks):
    its buffer is swapped in only where the spans written tile all of it."""

    def __init__(self):
        self.spares = WeakIdKeyDictionary()  # momentum -> its second buffer
        # id -> (momentum, the spans of it whose next value its buffer holds)
        self.written: Dict[int, Tuple[torch.Tensor, Set[Tuple[int, int]]]] = {}

    def spare(self, m: torch.Tensor) -> torch.Tensor:
        """``m``'s second buffer (uninitialized at first)."""
        s = self.spares.get(m)
        if s is None or s.shape != m.shape or s.dtype != m.dtype or s.device != m.device:
            s = self.spares[m] = torch.empty_like(m, memory_format=torch.contiguous_format)
        return s

    def out(self, m: torch.Tensor, start: int, length: int) -> Optional[torch.Tensor]:
        """Where the pass that packs elements [start, start + length) of m (a
        momentum, or a flat view of all of one) writes their next momentum:
        the second buffer, in m's shape (the span recorded as written; all
        of m starts the record again), or None where m is not all of a
        contiguous momentum (struck off: its momentum is updated after the
        agreement, as with one buffer)."""
        root = torch_internals.view_base(m)
        if not (root.is_contiguous() and m.is_contiguous() and m.numel() == root.numel()
                and m.data_ptr() == root.data_ptr()):
            self.forget(m)
            return None
        entry = self.written.get(id(root))
        if entry is None or entry[0] is not root or (start == 0 and length == m.numel()):
            entry = self.written[id(root)] = (root, set())
        entry[1].add((start, length))
        return self.spare(root).view(m.shape)

    def forget(self, m: torch.Tensor) -> None:
        """m's next momentum is not (or no longer) in its second buffer."""
        self.written.pop(id(torch_internals.view_base(m)), None)

    def take(self, momenta: list) -> list:
        """Of a voted step's momentum items ((g, m, coefs, fused), every rank
        having agreed): makes the second buffers written all over their
        momenta and returns the others, to be updated from g."""
        if not self.written:
            return momenta
        rest, done = [], []
        for item in momenta:
            root = torch_internals.view_base(item[1])
            entry = self.written.pop(id(root), None)
            if entry is not None and entry[0] is root and tiles(entry[1], root.numel()):
                done.append(root)
            else:
                rest.append(item)
        swap(done, [self.spares[m] for m in done])
        return rest

    def clear(self) -> None:
        """The step is over: no second buffer holds a next momentum any more."""
        self.written.clear()


def tiles(spans, numel: int) -> bool:
    """Whether the spans (start, length) cover [0, numel) once each."""
    at = 0
    for start, length in sorted(spans):
        if start != at:
            return False
        at += length
    return at == numel


def swap(ms: List[torch.Tensor], spares: List[torch.Tensor]) -> None:
    """Exchanges the storage of each ``ms[i]`` and ``spares[i]`` (same shape,
    dtype and device, contiguous): each tensor object keeps its identity.
    One call into C++ for the list (``Tensor.set_`` twice a pair, about
    0.5 us; a Python loop takes 1.6)."""
    if ms:
        _C.swap_storages(ms, spares)
