"""DistributedLion under torch's ``Join`` (uneven inputs across ranks).

``with Join([model, opt]):`` lets ranks run out of data at different
times. A rank that has run out keeps shadowing the others' steps: in each of
their steps it abstains (its direction counts as 0 in the vote, its
momentum stays as it is) and applies the voted update like every rank, so
the replicas stay identical.

Under DDP the model comes first: DDP tells the Join in its forward that a
rank is still training, and its join hook shadows the forward and the
backward (lionbit's comm hook abstains there, lionbit.ddp); the
optimizer's join hook then shadows the step, once per synchronized
backward of the peers (accumulation under ``no_sync()`` works; two
synchronized backwards before one step do not). ``Join([opt, model])`` and
``Join([opt])`` of an optimizer attached to DDP raise when the Join is made
(DDP's shadow would not line up with its peers' forward); ``model.join()``
(or ``Join([model])``) alone fails at the first shadowed backward, on every
rank, naming the fix.
"""

import torch
from torch.distributed.algorithms.join import Join, JoinHook


def notify(opt) -> None:
    """At the start of step(): tell the Join context (if the optimizer is
    its first joinable) that this rank has not joined yet."""
    Join.notify_join_context(opt)


def device_of(opt) -> torch.device:
    for g in opt.param_groups:
        for p in g["params"]:
            return p.device
    return torch.device("cpu")


class ModelJoin:
    """Whether the optimizer attached to a DDP model is in the Join the model
    is in now. A Join makes every joinable's hook, then sets each one's
    config (torch's ``_join_config``) in the Join's order: in
    ``Join([model, opt])`` the optimizer's config is set after the model's,
    so it sees the model's new one; in ``Join([opt, model])`` or
    ``Join([opt])`` it still sees the old one."""

    def __init__(self, model):
        self.model = model
        self.before = None  # the model's config when a Join holding the optimizer was begun
        self.config = None  # the model's config of the last Join holding both, the model first

    def model_config(self):
        return getattr(self.model, "_join_config", None)

    def hook_made(self) -> None:
        self.before = self.model_config()

    def configured(self, config) -> None:
        if not config.enable:
            return
        now = self.model_config()
        if now is self.before:
            raise ValueError(
                "DistributedLion: under DistributedDataParallel the Join must hold the model first and then the "
                "optimizer: `with Join([model, opt]):` (DDP tells the Join in its forward that a rank is still "
                "training and shadows the forward and backward; the optimizer's hook shadows the step after them). "
                "Join([opt, model]) and Join([opt]) cannot line up with the peers' forward"
            )
        self.config = now

    def includes_optimizer(self) -> bool:
        return self.config is not None and self.model_config() is self.config


class LionJoinHook(JoinHook):
    """Runs, on a rank that has joined, the step its peers are taking."""

    def __init__(self, opt, shadow_step):
        self.opt = opt
        self.shadow_step = shadow_step

    def main_hook(self) -> None:
        # Under DDP a round is one forward of the peers; they step only
        # after a synchronized backward (not after one under no_sync()).
        if self.opt.attachment.join_step_due():
            self.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        pass
