"""Helpers for training frameworks that wrap the model in DDP themselves.

lionbit does not depend on any framework: this module imports none at import
time; ``HFAttachCallback`` imports ``transformers`` when first used.

Hugging Face ``transformers.Trainer`` wraps the model in DDP inside
``train()`` (through accelerate) and hands its callbacks the unwrapped model,
so a callback needs the Trainer to reach the DDP model::

    from lionbit.integrations import HFAttachCallback

    dist.init_process_group("lionbit")   # before TrainingArguments: on CPU accelerate picks gloo itself
    args = TrainingArguments(..., use_cpu=True)   # on CPU; without it accelerate sets up no DDP
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      optimizer_cls_and_kwargs=(lionbit.DistributedLion, {"lr": 3e-4}))
    trainer.add_callback(HFAttachCallback(trainer))
    trainer.train()

PyTorch Lightning and ``accelerate.Accelerator`` need no helper (see README):
Lightning calls ``configure_optimizers`` after wrapping the model in DDP, so
``return lionbit.DistributedLion(...).attach(self.trainer.model, overlap=False)`` works
there; with accelerate, attach the optimizer you created (not the
``AcceleratedOptimizer``) to the model ``accelerator.prepare`` returned.
"""

import weakref

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import fsdp, fsdp1, torch_internals
from .optim import DistributedLion

__all__ = ["HFAttachCallback", "distributed_lions"]  # noqa: F822  (HFAttachCallback: module __getattr__)


def distributed_lions(optimizer) -> list:
    """The DistributedLion optimizers inside ``optimizer``, looking through
    the wrappers frameworks put around an optimizer (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``)."""
    found, todo, seen = [], [optimizer], set()
    while todo:
        opt = todo.pop()
        if opt is None or id(opt) in seen:
            continue
        seen.add(id(opt))
        if isinstance(opt, DistributedLion):
            found.append(opt)
            continue
        for name in ("optimizer", "_optimizer"):
            inner = getattr(opt, name, None)
            if inner is not None and inner is not opt:
                todo.append(inner)
    return found


def _unwrap_compiled(model):
    """torch.compile wraps the DDP model in an OptimizedModule: look inside."""
    return torch_internals.compiled_inner(model)


def _is_data_parallel(model) -> bool:
    return isinstance(model, DistributedDataParallel) or fsdp.is_fsdp2(model) or fsdp1.is_fsdp1(model)


def _make_hf_callback():
    import transformers  # optional: lionbit depends on no framework


    class HFAttachCallback(transformers.TrainerCallback):
        """Attaches the Trainer's DistributedLion to the model the Trainer
        wrapped in DDP (``trainer.model_wrapped``) when training begins, so
        that DDP all-reduces no gradient. Works whether you passed the
        optimizer (``optimizers=(opt, None)``) or let the Trainer create it
        (``optimizer_cls_and_kwargs=(lionbit.DistributedLion, {...})``).
        Calling ``train()`` again on the same Trainer is fine.

        ``overlap`` is passed to ``attach``. It is False by default: the
        Trainer changes every gradient in place between backward and step,
        even with ``max_grad_norm=0`` (it then measures the norm with
        ``clip_grad_norm_(params, inf)``, which multiplies by 1.0), so votes
        started during backward would always be dropped."""

        def __init__(self, trainer, overlap: bool = False):
            super().__init__()
            self.trainer = trainer
            self.overlap = overlap
            self._attached = weakref.WeakKeyDictionary()  # DistributedLion -> the model it was attached to

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            trainer = self.trainer
            lions = distributed_lions(optimizer if optimizer is not None else trainer.optimizer)
            if not lions:
                raise ValueError(
                    f"lionbit HFAttachCallback: the Trainer's optimizer is {type(optimizer).__name__}, not a "
                    f"lionbit.DistributedLion; pass optimizers=(lionbit.DistributedLion(...), None) or "
                    f"optimizer_cls_and_kwargs=(lionbit.DistributedLion, {{...}}) to the Trainer"
                )
            model = _unwrap_compiled(trainer.model_wrapped)
            if dist.is_initialized() and dist.get_world_size() > 1 and not _is_data_parallel(model):
                kind = getattr(trainer.accelerator, "distributed_type", "?")
                fix = (  # accelerate set up for several processes, and the model prepared without DDP:
                    "The Trainer prepared the model for evaluation first (evaluate() or predict() before train() "
                    "leaves it unwrapped for training too, with transformers 5.23 and accelerate 1.15): train "
                    "before evaluating, or train with a new Trainer" if "MULTI" in str(kind) else
                    "On CPU pass TrainingArguments(use_cpu=True); call torch.distributed.init_process_group("
                    "'lionbit') before creating the TrainingArguments")
                raise RuntimeError(
                    f"lionbit HFAttachCallback on rank {dist.get_rank()}: torch.distributed has "
                    f"{dist.get_world_size()} ranks but the Trainer did not wrap the model for distributed training "
                    f"(accelerate's distributed type is {kind}), so every rank would train on all the data. {fix}"
                )
            for lion in lions:
                if self._attached.get(lion) is model:
                    continue
                lion.attach(model, overlap=self.overlap)
                self._attached[lion] = model
            return control

    HFAttachCallback.__module__, HFAttachCallback.__qualname__ = __name__, "HFAttachCallback"
    return HFAttachCallback


def __getattr__(name):
    # PEP 562: build the transformers-based class on first use only.
    if name == "HFAttachCallback":
        cls = _make_hf_callback()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
