"""A script's ranks as torchrun's workers, forked from the test zygote.

``run(script, *args, ranks=2, nodes=1)`` runs ``script`` on ``nodes`` x
``ranks`` processes, each with the variables torchrun's agent gives a worker
(RANK, LOCAL_RANK, GROUP_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, ...,
MASTER_ADDR and MASTER_PORT: torch's LocalElasticAgent._start_workers), and
returns their output (stdout and stderr, rank 0's first). It is for tests of
what a script does between its first and last line (an example's training,
figures and checkpoints); what torchrun itself does (its agent's store,
restarts, signals, several agents' rendezvous) stays with the tests that
launch torchrun: test_ddp_and_launch.py, test_readme.py, test_topology.py,
and one launch of each kind in test_examples.py.

Why: a torchrun launch costs about 4.5 s around the script's own work on
the 2-core machines this project is tested on (its agent imports torch, 2
s; the rendezvous, 0.5 s; each worker imports torch again, 1.4 s, and tears
the interpreter down, 0.6 s), and an example trains an epoch in 0.2 s.
Forked ranks (harness.start_python) skip all but the script.

The store is the test process's, as the agent's is under torchrun
(TORCHELASTIC_USE_AGENT_STORE=True: every rank a client of the store at
MASTER_ADDR:MASTER_PORT), started on a port the kernel picks, so no other
process can take the port first. What a script can see differ
(test_torchrun_env.py holds the list against a real launch): the port and
run id, and no TORCHELASTIC_ERROR_FILE (torch's ``@record`` then prints a
rank's error rather than filing it for the agent).
"""

import contextlib
import dataclasses
import os
import tempfile
import time
from typing import Optional

import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig

import harness


def _signals_to_handle() -> dict:
    """TORCHELASTIC_SIGNALS_TO_HANDLE as torchrun exports it by default, where this torch's
    launcher has the setting (LaunchConfig.signals_to_handle: torch 2.15 has it; older
    launchers may not, and then export nothing)."""
    fields = dataclasses.fields(LaunchConfig)
    default = next((f.default for f in fields if f.name == "signals_to_handle"), None)
    return {} if default is None else {"TORCHELASTIC_SIGNALS_TO_HANDLE": default}


def worker_env(rank: int, ranks: int, nodes: int, port: int) -> dict:
    """What torchrun's agent sets for global rank ``rank`` of ``nodes`` x ``ranks``."""
    node, world = rank // ranks, ranks * nodes
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % ranks), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(ranks), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "localhost",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **_signals_to_handle()}


def run(script: str, *args: str, ranks: int = 2, nodes: int = 1, env: Optional[dict] = None,
        cwd: Optional[str] = None, timeout: float = 300) -> str:
    """Runs ``python script args...`` on nodes x ranks ranks, in cwd (else
    this process's working directory); returns their output, rank by rank.
    Any rank's nonzero exit, or the deadline (every rank then killed), fails
    the test with every rank's output."""
    base = harness.rank_env(env)
    store = dist.TCPStore("localhost", 0, ranks * nodes, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="lionbit-torchrun-env-") as d:
        logs = [open(os.path.join(d, f"rank{r}.log"), "w+") for r in range(ranks * nodes)]
        with contextlib.chdir(cwd or os.getcwd()):
            procs = [harness.start_python([script, *args], {**base, **worker_env(r, ranks, nodes, store.port)}, log)
                     for r, log in enumerate(logs)]
        deadline, hung = time.monotonic() + timeout, False
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    time.sleep(2)  # the others' last words, then they go (torchrun too stops the rest)
                    break
                if time.monotonic() > deadline:
                    hung = True
                    break
                time.sleep(0.01)
        finally:
            harness.kill(procs)
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    codes = [p.poll() for p in procs]
    if hung or codes != [0] * len(procs):
        what = f"hung past {timeout:.0f} s" if hung else f"exits {codes}"
        raise AssertionError(f"{os.path.basename(script)} {' '.join(args)} on {nodes} x {ranks} ranks: {what}\n"
                             + "\n".join(f"--- rank {r} ---\n{o[-3000:]}" for r, o in enumerate(outs)))
    return "".join(outs).replace("\r", "\n")
