"""Another optimizer stepping the parameters of a model that a
DistributedLion is attached to.

While a DistributedLion is attached to a DDP or FSDP2 model, the model
leaves each rank's own gradient in ``p.grad`` (the 1-bit vote replaces DDP's
all-reduce and FSDP's reduce-scatter). A torch optimizer stepping those
parameters then moves each replica by its own gradient: the replicas drift
apart, silently. Dropping the DistributedLion detaches it
(lionbit.attachment), and a script that means to switch drops it; but a
framework may still hold it (accelerate's Accelerator keeps every optimizer
``prepare`` saw until ``free_memory()``), and then it stays attached.

So while some model is attached, one global step pre-hook
(``torch.optim.optimizer.register_optimizer_step_pre_hook``) refuses such a
step where the attachment's communication left the gradients of the last
backward (``holds_local_gradients``: not where another wrapper of the same
parameters, a new DDP, reduced them), before it changes anything, with the
fix. Every rank runs the same
step, so every rank refuses. Let through: DistributedLion itself (its steps
vote: the ranks' updates are the same), and an optimizer that wraps a
DistributedLion (a Lookahead, a framework's wrapper: it shares its
param_groups or holds it as an attribute), whose step is that one's.
"""

import gc
import types
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: The attachments to models, each with {id(p): weakref to p} of its model's parameters.
_WATCHED: "weakref.WeakKeyDictionary[object, Dict[int, weakref.ref]]" = weakref.WeakKeyDictionary()
_registered_hook = None


def watch(att, params) -> None:
    """Refuses other optimizers' steps of ``params`` (the model's) while
    ``att`` (an attachment to that model) is watched."""
    global _registered_hook
    _WATCHED[att] = {id(p): weakref.ref(p) for p in params}
    if _registered_hook is None:
        _registered_hook = register_optimizer_step_pre_hook(_refuse_other_steps)


def unwatch(att) -> None:
    """``att`` detached: its model's parameters are anyone's again."""
    global _registered_hook
    _WATCHED.pop(att, None)
    if not _WATCHED and _registered_hook is not None:
        _registered_hook.remove()
        _registered_hook = None


def _wraps(opt, lion) -> bool:
    """Whether ``opt`` steps through DistributedLion ``lion`` (a wrapper)."""
    mine = {id(g) for g in lion.param_groups}
    return (opt.param_groups is lion.param_groups or any(id(g) in mine for g in opt.param_groups)
            or any(v is lion for v in vars(opt).values()))


def _refuse_other_steps(opt, args, kwargs) -> None:
    if torch.compiler.is_compiling():  # (a compiled step, torch's recipe for a faster one: not checked)
        return
    from .optim import DistributedLion  # cycle: lionbit.optim imports the attachments, which import this

    if isinstance(opt, DistributedLion):
        return
    for att, params in list(_WATCHED.items()):
        lion = att.opt
        if lion is None or not att.holds_local_gradients() or _wraps(opt, lion):
            continue
        hit = next((p for g in opt.param_groups for p in g["params"]
                    if (r := params.get(id(p))) is not None and r() is p), None)
        if hit is not None:
            raise RuntimeError(_message(opt, att, lion, hit))


def _message(opt, att, lion, p) -> str:
    name = next((n for n, q in att.model.named_parameters() if q is p), "?")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"{type(opt).__name__}.step on rank {rank}: its parameters ({name!r} among them) belong to a {att.kind} "
        f"model that a DistributedLion is attached to, and that DistributedLion is still held (by "
        f"{_holders(lion)}). While it is attached the model leaves each rank's own gradient in p.grad for its "
        f"1-bit vote, so this step would move each replica by its own gradient and the replicas would drift "
        f"apart. Detach it first (lion_opt.detach()), or drop every reference to it (a framework may hold one: "
        f"accelerate's Accelerator keeps each prepared optimizer until accelerator.free_memory()); the model then "
        f"reduces its gradients as {att.kind} does, for any optimizer"
    )


def _holders(lion) -> Optional[str]:
    """The kinds of objects that refer to ``lion`` (the error's hint)."""
    kinds = set()
    for r in gc.get_referrers(lion):
        if isinstance(r, types.FrameType):
            continue
        if isinstance(r, dict):  # an object's attributes: the object
            r = next((o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r), r)
        kinds.add(type(r).__name__)
    return ", ".join(sorted(kinds)[:4]) or "something"
