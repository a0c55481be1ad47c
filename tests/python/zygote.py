"""Rank processes forked from one that has already imported torch.

A rank started as a new interpreter first pays ``import torch``: 4-5 s of
CPU on the 2-core machines this project is tested on, for each of the
hundred-odd ranks a ``make test`` starts, and nearly 3 s more for
torch._dynamo, which the first torch optimizer (``Optimizer.add_param_group``)
or DistributedDataParallel a rank builds imports. The zygote is one process
per test session that imports these (torch, torch.distributed, torch._dynamo
and, under it, FSDP and DTensor; torch's autoload imports lionbit, whose
Python package and extension read no variable at import) and then forks a
rank for each request, with the rank's own argv, environment, working
directory, log file and standard input.

A forked rank is the fresh process it stands for: lionbit and torch read
their variables (LIONBIT_KERNELS, LIONBIT_TRACE, OMP_NUM_THREADS, ...) at
first use, which comes after the fork; the zygote has created no thread (it
runs with OMP_NUM_THREADS=1 unless told otherwise, like the ranks), touched no
device and made no group; Python reseeds ``random`` in the child. What a
fork cannot give: a different PYTHONPATH at interpreter start (every rank
gets the zygote's sys.path), variables read while torch imports, and a rank
without the modules above (a test of what ``import lionbit`` or a step
imports runs its own interpreter, as test_package_shape does).

``Zygote.spawn`` returns a ``ForkedRank``: the part of ``subprocess.Popen``
that harness.py uses (pid, stdin, poll, wait, returncode). The rank leads a
process group of its own (os.killpg ends it and what it started); the zygote
reaps it and leaves its exit status where ``poll`` finds it.
LIONBIT_TEST_ZYGOTE=0 starts every rank as its own interpreter instead.
"""

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

_SELF = os.path.abspath(__file__)


def enabled() -> bool:
    return os.environ.get("LIONBIT_TEST_ZYGOTE", "1") != "0"


class ForkedRank:
    """A rank forked by the zygote, seen from the test process."""

    def __init__(self, pid: int, stdin, exit_path: str, zygote: "Zygote"):
        self.pid = pid
        self.stdin = stdin
        self.returncode: Optional[int] = None
        self._exit_path = exit_path
        self._zygote = zygote

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            if os.path.exists(self._exit_path):
                with open(self._exit_path) as f:
                    self.returncode = int(f.read())
            elif self._zygote.proc.poll() is not None and not _alive(self.pid):
                self.returncode = -signal.SIGKILL  # nobody left to reap it and say how it ended
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Zygote:
    """The test process's side: starts the zygote and asks it for ranks."""

    def __init__(self, env: dict):
        self.workdir = tempfile.mkdtemp(prefix="lionbit-zygote-")
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = open(os.path.join(self.workdir, "zygote.log"), "w+")
        self.env = dict(env)
        self.proc = subprocess.Popen([sys.executable, _SELF, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        theirs.close()
        self._sock.settimeout(180)
        if self._recv() != b"ready":
            self._fail("did not start")
        self._requests = 0

    def _recv(self) -> bytes:
        try:
            return self._sock.recv(64)
        except OSError:
            return b""

    def _fail(self, what: str):
        self._stop()  # then its output is complete
        self._log.seek(0)
        output = self._log.read()[-4000:]
        self.close()
        raise RuntimeError(f"the test zygote {what}: {output}")

    def spawn(self, argv: List[str], env: dict, log, pool: bool) -> ForkedRank:
        """Forks a rank running ``python argv...`` with env, the current
        working directory, stdout and stderr to log, and a pipe on stdin
        when pool (else /dev/null)."""
        k = self._requests
        self._requests += 1
        req_path = os.path.join(self.workdir, f"req{k}.json")
        exit_path = os.path.join(self.workdir, f"exit{k}")
        with open(req_path, "w") as f:
            json.dump({"argv": argv, "env": env, "cwd": os.getcwd(), "exit": exit_path}, f)
        if pool:
            r, w = os.pipe()
            stdin = os.fdopen(w, "wb")
        else:
            r, stdin = os.open(os.devnull, os.O_RDONLY), None
        try:
            socket.send_fds(self._sock, [req_path.encode()], [log.fileno(), r])
        except OSError:
            self._fail("is gone")
        finally:
            os.close(r)
        reply = self._recv()
        if not reply.isdigit():
            self._fail(f"answered {reply!r} to a request for {argv}")
        return ForkedRank(int(reply), stdin, exit_path, self)

    def _stop(self) -> None:
        self._sock.close()  # the zygote ends at the end of its socket
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self._stop()
        self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


# --- the zygote's side ---------------------------------------------------------------------------

def _become_rank(req: dict, fds: list, sock: socket.socket) -> None:
    """In the forked child: the rank's process as if it had been started
    with ``python argv...``. Never returns."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass  # the zygote made it the leader first
        log_fd, stdin_fd = fds
        os.dup2(stdin_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(stdin_fd)
        os.close(log_fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = list(req["argv"])
        script = os.path.abspath(sys.argv[0])
        sys.path[0] = os.path.dirname(script)
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the rank's log, like an uncaught error
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve(fd: int) -> None:
    import torch  # noqa: F401 - what every rank imports first
    import torch._dynamo  # noqa: F401 - what the first optimizer or DDP a rank builds imports: 2.7 s more
    import torch.distributed  # noqa: F401

    sock = socket.socket(fileno=fd)
    exits = {}  # pid -> where to write its exit status

    def reap() -> None:
        while exits:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            path = exits.pop(pid, None)
            if path is None:
                continue
            with open(path + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".tmp", path)

    # SIGCHLD wakes the loop through a pipe that the signal's C handler writes, never a Python
    # handler: a signal that lands between a handler's last check and the blocking receive would
    # leave a rank unreaped until the next request, and the test waiting on it, forever.
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sock.send(b"ready")
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 4096)  # what is left over wakes the next select
            except BlockingIOError:
                pass
            reap()
        if sock not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 4096, 2)
        except OSError:
            break
        if not msg:
            break  # the test process closed its end: the session is over
        with open(msg.decode()) as f:
            req = json.load(f)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)
            _become_rank(req, fds, sock)
        try:
            os.setpgid(pid, pid)  # before its pid is handed out: killpg finds the group at once
        except OSError:
            pass  # the child did it first, or has ended
        exits[pid] = req["exit"]  # reaped only in this loop, so never before it is here
        for x in fds:
            os.close(x)
        sock.send(str(pid).encode())
    reap()
    os._exit(0)  # no interpreter teardown: seconds with torch and dynamo loaded, and nothing to save


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
