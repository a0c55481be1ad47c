"""Run a test function on N real processes, each its own rank.

``run_ranks("module:function", world_size)`` calls ``function(rank,
world_size, **kwargs)`` on every rank of a process group over a FileStore
and returns each rank's return value (JSON).

Most calls run on a *pool*: one set of rank processes per (world size,
backend, process-group timeout, environment), started at the first call that
needs it and kept for the rest of the test session (or until its ranks hold
more than MAX_GROUPS_PER_POOL process groups), so later modules find
it warm (tests/python/conftest.py closes the pools at the session's end). Starting ranks (a process, ``import
torch``, a process group) costs seconds; a case on a warm pool costs what the
case does. Rank processes, pooled or fresh, are forked from a zygote that has
imported torch once (zygote.py; LIONBIT_TEST_ZYGOTE=0 starts each as its own
interpreter). Before each case every rank puts back what a fresh process would
have: the environment, the working directory, the random number generators
(torch, Python, NumPy), torch's default dtype, thread count, grad mode and
deterministic flag, the warning registries, torch.compile's caches and
lionbit's counters; after it, an all-reduce of the case's number checks that
the group is still in step. A case that fails, raises on any rank, hangs,
takes the default group down or leaves it out of step ends its pool; the
next case starts a fresh one.

``case_env`` sets variables in the ranks' environment for one case only,
on the warm ranks: for the variables lionbit reads at each call
(``PER_CALL_ENV``: the chunk size), so a case with its own chunk size needs no
ranks of its own. A variable read once per process (LIONBIT_SIGN_EXCHANGE,
LIONBIT_TRACE, LIONBIT_KERNELS, ...) goes in ``env``, which picks the pool.

Calls with different ``pool`` names never share ranks: for cases that leave
state on the group that is theirs by design (a hierarchy's topology, set up
once per group). A call gets its own fresh processes instead when it expects
errors (a rank may die or raise), runs without a default group
(``backend=None``), passes ``fresh=True``, or when LIONBIT_TEST_FRESH_RANKS=1
(every call fresh: the old way, to rule the pool out when a test fails).

Every process is killed when the deadline passes, so a hang is a test failure
with every rank's output, never a stuck test run; a pooled case whose rank
died (a crash, a sanitizer) fails DEAD_RANK_GRACE seconds later, not at its
deadline. A failure's message carries every rank's output for the failing
case, the error each raised, and what ASan or UBSan reported about it (make
test-sanitize-python: a rank they stop has only its exit status 1 to show).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import zygote

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed at the deadline
    value: Any
    error: Optional[str]  # "ExceptionType: message" raised by the function
    output: str
    sanitizer: str = ""  # what ASan or UBSan reported about the rank, if anything


class RanksFailed(AssertionError):
    pass


#: Variables lionbit reads at each call (backend/sign_common.cpp:
#: requested_chunk_elems), so a case may set them on warm ranks (``case_env``).
PER_CALL_ENV = frozenset({"LIONBIT_CHUNK_ELEMS"})


def rank_env(env: Optional[dict]) -> dict:
    """A rank's environment: this process's, less LOCAL_WORLD_SIZE (Gloo's shared-memory shortcut), with
    this folder on PYTHONPATH, OMP_NUM_THREADS=1 unless set (as torchrun does), and ``env`` on top."""
    penv = dict(os.environ)
    penv.pop("LOCAL_WORLD_SIZE", None)
    penv["PYTHONPATH"] = HERE + os.pathsep + penv.get("PYTHONPATH", "")
    penv.setdefault("OMP_NUM_THREADS", "1")
    if env:
        penv.update(env)
    return penv


_ranks_started = 0  # rank processes started so far (the launch log's "started")


def _spawn(workdir: str, world_size: int, backend: Optional[str], pg_timeout: float, penv: dict,
           extra: dict, pool: bool) -> list:
    global _ranks_started
    _ranks_started += world_size
    procs = []
    for rank in range(world_size):
        spec = dict(extra, rank=rank, world_size=world_size, backend=backend, workdir=workdir,
                    store=os.path.join(workdir, "store"), pg_timeout=pg_timeout, pool=pool)
        log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
        procs.append((start_python([os.path.join(HERE, "harness.py"), json.dumps(spec)], penv, log, pool), log))
    return procs


def start_python(argv: List[str], env: dict, log, stdin_pipe: bool = False):
    """``python argv...`` with env, its output (stdout and stderr) to the
    file log, in a process group of its own: forked from the session's
    zygote (torch imported), or a new interpreter where LIONBIT_TEST_ZYGOTE=0.
    A pipe on its stdin when stdin_pipe, else /dev/null. Returns what
    ``subprocess.Popen`` does (pid, stdin, poll, wait, returncode)."""
    if zygote.enabled():
        return _zygote().spawn(argv, env, log, stdin_pipe)
    return subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


_the_zygote: Optional[zygote.Zygote] = None


def _zygote() -> zygote.Zygote:
    """The session's zygote (zygote.py), started at the first rank; a new one if it has ended."""
    global _the_zygote
    if _the_zygote is None or _the_zygote.proc.poll() is not None:
        _the_zygote = zygote.Zygote(rank_env(None))
    return _the_zygote


def _kill(procs: list) -> None:
    kill([p for p, _ in procs])


def kill(processes: list) -> None:
    """Kills each live process of ``processes`` (start_python's) and its process group, and reaps it."""
    for p in processes:
        if p.poll() is None:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.wait()


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _sanitizer_log_paths() -> List[str]:
    """ASan's and UBSan's log_path prefixes in this environment (make
    test-sanitize-python sets one for both)."""
    paths = [opt[len("log_path="):] for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS")
             for opt in os.environ.get(var, "").split(":") if opt.startswith("log_path=")]
    return list(dict.fromkeys(paths))


def _sanitizer_report(pid: int) -> str:
    """What ASan or UBSan wrote about a rank: a rank a sanitizer stops exits 1
    with its report in <log_path>.<pid>, not in its output."""
    texts = []
    for prefix in _sanitizer_log_paths():
        path = f"{prefix}.{pid}"
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                texts.append(f"\n--- the sanitizer's report, {path} ---\n{f.read()[:6000]}")
    return "".join(texts)


def _report(target: str, world_size: int, results: List[RankResult], what: str) -> RanksFailed:
    report = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}{r.sanitizer}"
                       + (f"\n(it raised {r.error[:1000]})" if r.error else "") for r in results)
    return RanksFailed(f"{target} on {world_size} ranks {what}:\n{report}")


#: Seconds the live ranks of a pooled case get to finish after one died
#: without its result; then they are killed and the case fails at once
#: instead of at its deadline.
DEAD_RANK_GRACE = 20.0


class _Pool:
    """One set of rank processes that runs cases one after another."""

    def __init__(self, world_size: int, backend: str, pg_timeout: float, env: Optional[dict]):
        self.world_size = world_size
        self.workdir = tempfile.mkdtemp(prefix="lionbit-pool-")
        self.procs = _spawn(self.workdir, world_size, backend, pg_timeout, rank_env(env), {}, pool=True)
        self.offsets = [0] * world_size
        self.cases = 0
        self.groups = 0  # the most process groups a rank of the pool holds

    def close(self) -> None:
        _kill(self.procs)
        for _, log in self.procs:
            log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def run(self, target: str, kwargs: dict, timeout: float) -> Tuple[List[RankResult], bool, bool]:
        """Runs one case; returns (results, ok, hung). ok: every rank
        returned and the pool can take the next case."""
        k = self.cases
        self.cases += 1
        line = (json.dumps({"case": k, "target": target, "kwargs": kwargs}) + "\n").encode()
        for p, _ in self.procs:
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it died: seen below
        outs = [os.path.join(self.workdir, f"case{k}.rank{r}.json") for r in range(self.world_size)]
        deadline = time.monotonic() + timeout
        hung = False
        died_at = None  # when a rank was first seen dead without its result
        while True:
            missing = [r for r in range(self.world_size) if not os.path.exists(outs[r])]
            pending = [r for r in missing if self.procs[r][0].poll() is None]
            if not pending:
                break
            now = time.monotonic()
            if now > deadline:
                hung = True
                break
            if died_at is None and len(pending) < len(missing):
                died_at = now
            if died_at is not None and now - died_at > DEAD_RANK_GRACE:
                break  # a pooled rank died (a crash, a sanitizer): the others wait on it for nothing
            time.sleep(0.005)
        if hung or any(not os.path.exists(o) for o in outs):
            _kill(self.procs)  # a rank hung or died: the others are of no more use
        results = []
        ok = not hung
        for r, (p, log) in enumerate(self.procs):
            rec = _read_json(outs[r])
            log.flush()
            log.seek(self.offsets[r])
            output = log.read()
            self.offsets[r] = log.tell()
            if rec and "error" not in rec:
                code = 0
            elif p.poll() is None:
                code = None if hung else 1
            else:
                code = p.returncode if not rec else 1
            ok = ok and bool(rec) and "error" not in rec and not rec.get("spoiled")
            self.groups = max(self.groups, rec.get("groups", 0))
            results.append(RankResult(r, code, rec.get("value"), rec.get("error"), output, _sanitizer_report(p.pid)))
        return results, ok, hung


_pools: Dict[tuple, _Pool] = {}  # oldest use first
#: Rank processes alive at once, a few hundred MB each: past it the least
#: recently used pool goes. 16 keeps a module that cycles through 2..5 or
#: 1..5 ranks test by test on warm pools (a cap of 3 pools made it start
#: ranks for every call).
MAX_RANKS_ALIVE = 16
#: Process groups a pool's rank may hold before the pool ends (a fresh one
#: costs well under a second). The groups a case makes stay (torch keeps
#: them, and DTensor's caches hand later cases' parameters earlier cases'
#: meshes), and each lionbit group holds two Gloo groups whose I/O threads
#: wake every 10 ms, idle or not (design-notes: "Idle Gloo threads in the
#: test pools"). A named pool keeps its ranks (its cases share the groups
#: they leave, by design).
MAX_GROUPS_PER_POOL = 16


def close_pools() -> None:
    """Ends every pool (tests/python/conftest.py: at the session's end)."""
    while _pools:
        _pools.popitem()[1].close()


def close_zygote() -> None:
    """Ends the zygote (conftest.py: at the session's end, after the pools)."""
    global _the_zygote
    if _the_zygote is not None:
        _the_zygote.close()
        _the_zygote = None


def _run_pooled(target, world_size, backend, timeout, pg_timeout, kwargs, env, tag) -> List[RankResult]:
    key = (world_size, backend, pg_timeout, tuple(sorted((env or {}).items())), tag)
    pool = _pools.pop(key, None)
    if pool is None:
        while _pools and sum(p.world_size for p in _pools.values()) + world_size > MAX_RANKS_ALIVE:
            _pools.pop(next(iter(_pools))).close()
        pool = _Pool(world_size, backend, pg_timeout, env)
    _pools[key] = pool  # now the most recently used
    results, ok, hung = pool.run(target, kwargs, timeout)
    if not ok or (pool.groups > MAX_GROUPS_PER_POOL and not tag):
        _pools.pop(key).close()
    bad = [r for r in results if r.returncode != 0]
    if hung or bad:
        raise _report(target, world_size, results, f"hung past {timeout:.0f}s" if hung else "failed")
    return results


def _run_fresh(target, world_size, backend, timeout, pg_timeout, kwargs, expect_errors, env) -> List[RankResult]:
    workdir = tempfile.mkdtemp(prefix="lionbit-test-")
    procs = []
    try:
        procs = _spawn(workdir, world_size, backend, pg_timeout, rank_env(env),
                       {"target": target, "kwargs": kwargs}, pool=False)
        deadline = time.monotonic() + timeout
        hung = False
        for p, _ in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung = True
                break
        results = []
        for rank, (p, log) in enumerate(procs):
            if p.poll() is None:
                hung = True
                os.killpg(p.pid, 9)
                p.wait()
                code = None
            else:
                code = p.returncode
            log.seek(0)
            rec = _read_json(os.path.join(workdir, f"case0.rank{rank}.json"))
            results.append(RankResult(rank, code, rec.get("value"), rec.get("error"), log.read(),
                                      _sanitizer_report(p.pid)))
        bad = [r for r in results if r.returncode is None or (r.returncode != 0 and not expect_errors)]
        if hung or bad:
            raise _report(target, world_size, results, f"hung past {timeout:.0f}s" if hung else "failed")
        return results
    finally:
        # Nothing of a rank outlives the call, its scratch folder included.
        _kill(procs)
        for _, log in procs:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run_ranks(
    target: str,
    world_size: int,
    *,
    backend: Optional[str] = "lionbit",
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    kwargs: Optional[dict] = None,
    expect_errors: bool = False,
    env: Optional[dict] = None,
    fresh: bool = False,
    pool: str = "",
    case_env: Optional[dict] = None,
) -> List[RankResult]:
    """Runs target on world_size ranks. Raises RanksFailed if any rank fails
    (unless expect_errors) or any rank is still running at the deadline
    (timeout seconds, the ranks' start included when they start).
    ``case_env``: variables of PER_CALL_ENV set for this case only."""
    t0, started = time.monotonic(), _ranks_started
    case_env = {k: str(v) for k, v in (case_env or {}).items()}
    if set(case_env) - PER_CALL_ENV:
        raise ValueError(f"case_env {sorted(set(case_env) - PER_CALL_ENV)}: lionbit reads these once per process; "
                         f"pass them in env (case_env takes {sorted(PER_CALL_ENV)})")
    kwargs = dict(kwargs or {})
    if fresh or expect_errors or backend is None or os.environ.get("LIONBIT_TEST_FRESH_RANKS") == "1":
        res = _run_fresh(target, world_size, backend, timeout, pg_timeout, kwargs, expect_errors,
                         {**(env or {}), **case_env})
    else:
        if case_env:
            kwargs["__case_env__"] = case_env
        res = _run_pooled(target, world_size, backend, timeout, pg_timeout, kwargs, env, pool)
    log = os.environ.get("LIONBIT_TEST_LAUNCH_LOG")  # a profile of the calls, one JSON line each
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"target": target, "n": world_size, "s": round(time.monotonic() - t0, 2),
                                "started": _ranks_started - started,  # rank processes this call started
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")
    return res


def values(results: List[RankResult]) -> list:
    return [r.value for r in results]


# --- the rank's side -----------------------------------------------------------------------------

class _FreshState:
    """What a case may change that a fresh process would not have had."""

    def __init__(self):
        import random
        import warnings

        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.streams = (sys.stdout, sys.stderr)
        self.torch_rng = torch.get_rng_state()
        self.py_rng = random.getstate()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.warning_filters = list(warnings.filters)
        self.np_rng = None
        if "numpy" in sys.modules:
            self.np_rng = sys.modules["numpy"].random.get_state()

    def restore(self):
        import random
        import warnings

        import torch

        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.stdout, sys.stderr = self.streams  # a case's redirection must not swallow the next one's traceback
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        if "numpy" in sys.modules:
            np_random = sys.modules["numpy"].random
            if self.np_rng is None:
                self.np_rng = np_random.get_state()
            np_random.set_state(self.np_rng)
        torch.set_default_dtype(self.dtype)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        # Only when a case changed it: the call imports torch._inductor (and under it
        # dynamo, FSDP and DTensor), seconds of CPU a rank that no case needs.
        deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled())
        if deterministic != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        # A warning shown once in an earlier case must show again.
        for mod in list(sys.modules.values()):
            reg = getattr(mod, "__warningregistry__", None)
            if isinstance(reg, dict):
                reg.clear()
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        if "lionbit" in sys.modules and torch.distributed.is_initialized():
            if torch.distributed.get_backend() == "lionbit":
                sys.modules["lionbit"].reset_stats()


def _call(spec: dict, rank: int, world_size: int) -> dict:
    import importlib

    module_name, func_name = spec["target"].split(":")
    kwargs = dict(spec["kwargs"])
    os.environ.update(kwargs.pop("__case_env__", {}))  # the pool's restore() takes it away after the case
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        return {"value": func(rank, world_size, **kwargs)}
    except BaseException as err:  # noqa: BLE001 - reported to the test
        import traceback

        traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}"}


def _in_step(k: int, n: int) -> bool:
    """Whether the default group is still in step after case k: a case that
    left a collective unmatched on some rank (an error path) would pair it
    with this all-reduce and spoil the next case's result."""
    import torch
    import torch.distributed as dist

    try:
        t = torch.tensor([k + 1, -(k + 1)], dtype=torch.int64)
        dist.all_reduce(t)
        if t.tolist() != [n * (k + 1), -n * (k + 1)]:
            return False
        if dist.get_backend() == "lionbit":  # the sign path has a communicator of its own
            # A tie-free vote: it also clears the tie-plane hint a case's dense ties leave
            # for the next vote, as in a fresh process.
            s = torch.ones(8)
            sys.modules["lionbit"].all_reduce_sign(s, "vote")
            return s.tolist() == [1.0] * 8
        return True
    except Exception:  # noqa: BLE001 - a broken group is the answer
        return False


def _group_count() -> int:
    """The process groups this rank holds, the default one included."""
    import torch.distributed.distributed_c10d as c10d

    return len(c10d._world.pg_map)


def _write(path: str, rec: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f)
    os.replace(path + ".tmp", path)  # the driver never sees half a file


def _worker(spec: dict) -> int:
    import faulthandler
    from datetime import timedelta

    import torch.distributed as dist

    # A rank that dies of SIGSEGV, SIGBUS or SIGABRT prints every thread's Python stack to its log, which
    # the test's report shows (a torch 2.11 run once lost a rank to SIGSEGV with nothing to go on).
    faulthandler.enable()
    rank, n = spec["rank"], spec["world_size"]
    out = lambda k: os.path.join(spec["workdir"], f"case{k}.rank{rank}.json")  # noqa: E731
    # Every rank has imported torch before any makes the group: on a busy
    # machine one rank's start can lag its peers' by more than a short
    # pg_timeout (test_errors' 4 s), which is the group's timeout, not a
    # budget for starting processes. (A peer that never gets here, dead at
    # import, leaves the wait after 120 s and the group's own timeout reports it.)
    ready = lambda r: os.path.join(spec["workdir"], f"ready.rank{r}")  # noqa: E731
    open(ready(rank), "w").close()
    start = time.monotonic()
    while not all(os.path.exists(ready(r)) for r in range(n)) and time.monotonic() - start < 120:
        time.sleep(0.01)
    try:
        if spec["backend"]:
            dist.init_process_group(spec["backend"], init_method="file://" + spec["store"], rank=rank,
                                    world_size=n, timeout=timedelta(seconds=spec["pg_timeout"]))
    except BaseException as err:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        _write(out(0), {"error": f"{type(err).__name__}: {err}"})
        sys.stdout.flush()
        os._exit(1)
    if not spec["pool"]:
        rec = _call(spec, rank, n)
        sys.stdout.flush()
        sys.stderr.flush()
        _write(out(0), rec)
        # Skip interpreter teardown: a group whose peer failed may block in its
        # destructor; the test has what it needs.
        os._exit(1 if "error" in rec else 0)
    fresh = _FreshState()
    world = dist.group.WORLD
    for line in sys.stdin:
        case = json.loads(line)
        fresh.restore()
        rec = _call(case, rank, n)
        fresh.restore()  # what the case set (LIONBIT_TRACE, say) must not reach the check
        rec["spoiled"] = not dist.is_initialized() or dist.group.WORLD is not world or not _in_step(case["case"], n)
        rec["groups"] = _group_count()
        sys.stdout.flush()
        sys.stderr.flush()
        _write(out(case["case"]), rec)
        if "error" in rec or rec["spoiled"]:
            break
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_worker(json.loads(sys.argv[1])))
