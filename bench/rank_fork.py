"""Loopback ranks forked from a process that has imported torch.

A bench script's ranks on loopback (``collectives.launch`` without a cluster)
are its own script run again with ``--worker``. Started as fresh
interpreters, each pays torch's import and torch._dynamo's (every torch
optimizer imports it at its first ``add_param_group``): 4.0 s of CPU a rank
on a Zen 4 EPYC, 6.9 s on a Zen 3, and an interpreter's teardown with dynamo
loaded at the end. Here Python's fork server (``multiprocessing``,
"forkserver": one process that imports torch once, started at the first
rank) forks each rank; the rank takes its argv and environment, gets a
session of its own (as ``start_new_session`` gives a ``Popen``), runs the
script as ``__main__`` and ends with ``os._exit`` (no teardown). torch and
lionbit read their variables (OMP_NUM_THREADS, LIONBIT_*) at first use,
after the fork, so a rank's environment is its own. As for any
multiprocessing child, each rank first imports the launching script as
``__mp_main__``: a script that launches ranks keeps its work under
``if __name__ == "__main__":`` (every bench script does).

The ranks in network namespaces (``ip netns exec``) stay fresh interpreters;
``LIONBIT_BENCH_FORK=0`` makes loopback ranks fresh interpreters too.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback

#: What the fork server imports before it forks a rank.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]

# The server starts at the first rank forked, not here.
_FORKSERVER = multiprocessing.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(PRELOAD)


def forkable(argv: list) -> bool:
    """Whether ``argv`` (a rank's command) can be a forked rank: this
    interpreter running a Python script, and not turned off."""
    return (os.environ.get("LIONBIT_BENCH_FORK", "1") != "0" and len(argv) >= 2 and argv[0] == sys.executable
            and argv[1].endswith(".py"))


def _run(argv: list, env: dict) -> None:
    """The forked rank: ``argv[1]`` as ``__main__`` with ``argv[1:]`` and ``env``."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv[1:])
    code = 1
    try:
        runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (printed, as an interpreter would, and the rank fails)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedRank:
    """One rank forked from the fork server: the part of ``subprocess.Popen``
    that ``collectives.launch`` uses (pid, wait, poll, returncode)."""

    def __init__(self, argv: list, env: dict):
        self.args = argv
        self._process = _FORKSERVER.Process(target=_run, args=(argv, env))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def start(argv: list, env: dict):
    """Rank ``argv`` with ``env``: forked (:func:`forkable`) or a fresh
    interpreter, either in a session of its own (``os.killpg(rank.pid, 9)``
    ends it and what it started)."""
    if forkable(argv):
        return ForkedRank(argv, env)
    return subprocess.Popen(argv, env=env, start_new_session=True)


def kill(rank) -> None:
    """Ends ``rank``'s process group (its own process, if it has not made
    its session yet) and waits for it."""
    try:
        os.killpg(rank.pid, 9)
    except ProcessLookupError:
        try:
            os.kill(rank.pid, 9)
        except ProcessLookupError:
            pass
    rank.wait()
