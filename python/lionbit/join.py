"""DistributedLion under torch's ``Join`` (uneven inputs across ranks).

``with Join([model, opt]):`` lets ranks run out of data at different
times. A rank that has run out keeps shadowing the others' steps: in each of
their steps it abstains (its direction counts as 0 in the vote, its
momentum stays as it is) and applies the voted update like every rank, so
the replicas stay identical.
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


class LionJoinHook(JoinHook):
    """Runs, on a rank that has joined, the step its peers are taking."""

    def __init__(self, opt, shadow_step):
        self.opt = opt
        self.shadow_step = shadow_step

    def main_hook(self) -> None:
        self.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        pass
