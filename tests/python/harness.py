"""Run a test function on N real processes, each its own rank.

``run_ranks("module:function", world_size)`` starts one Python process per
rank (this file as the worker's main), joins them over a FileStore with the
given backend, calls ``function(rank, world_size, **kwargs)`` in each and
returns each rank's return value (JSON). Every process is killed when the
deadline passes, so a hang is a test failure with every rank's output, never
a stuck test run. Its scratch folder (the store, each rank's log and result)
is removed when it returns or raises: a failure's message carries every
rank's output.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed at the deadline
    value: Any
    error: Optional[str]  # "ExceptionType: message" raised by the function
    output: str


class RanksFailed(AssertionError):
    pass


def run_ranks(
    target: str,
    world_size: int,
    *,
    backend: str = "lionbit",
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    kwargs: Optional[dict] = None,
    expect_errors: bool = False,
    env: Optional[dict] = None,
) -> List[RankResult]:
    """Runs target on world_size ranks. Raises RanksFailed if any rank fails
    (unless expect_errors) or any rank is still running at the deadline."""
    workdir = tempfile.mkdtemp(prefix="lionbit-test-")
    procs = []
    try:
        store = os.path.join(workdir, "store")
        penv = dict(os.environ)
        penv.pop("LOCAL_WORLD_SIZE", None)
        penv["PYTHONPATH"] = HERE + os.pathsep + penv.get("PYTHONPATH", "")
        penv.setdefault("OMP_NUM_THREADS", "1")
        if env:
            penv.update(env)
        for rank in range(world_size):
            spec = json.dumps(
                {
                    "target": target,
                    "rank": rank,
                    "world_size": world_size,
                    "backend": backend,
                    "store": store,
                    "pg_timeout": pg_timeout,
                    "kwargs": kwargs or {},
                    "out": os.path.join(workdir, f"rank{rank}.json"),
                }
            )
            log = open(os.path.join(workdir, f"rank{rank}.log"), "w+")
            p = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "harness.py"), spec],
                stdout=log, stderr=subprocess.STDOUT, env=penv, start_new_session=True,
            )
            procs.append((p, log))
        deadline = time.monotonic() + timeout
        hung = False
        for p, _ in procs:
            left = deadline - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.1))
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
            output = log.read()
            log.close()
            value, error = None, None
            out = os.path.join(workdir, f"rank{rank}.json")
            if os.path.exists(out):
                with open(out) as f:
                    rec = json.load(f)
                value, error = rec.get("value"), rec.get("error")
            results.append(RankResult(rank, code, value, error, output))
        bad = [r for r in results if r.returncode is None or (r.returncode != 0 and not expect_errors)]
        if hung or bad:
            report = "\n".join(
                f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-4000:]}" for r in results
            )
            what = f"hung past {timeout:.0f}s" if hung else "failed"
            raise RanksFailed(f"{target} on {world_size} ranks {what}:\n{report}")
        return results
    finally:
        # Nothing of a rank outlives the call, its scratch folder included.
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def values(results: List[RankResult]) -> list:
    return [r.value for r in results]


def _worker(spec: dict) -> int:
    import importlib
    from datetime import timedelta

    import torch.distributed as dist

    module_name, func_name = spec["target"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    rec = {}
    code = 0
    try:
        if spec["backend"]:
            dist.init_process_group(
                spec["backend"],
                init_method="file://" + spec["store"],
                rank=spec["rank"],
                world_size=spec["world_size"],
                timeout=timedelta(seconds=spec["pg_timeout"]),
            )
        rec["value"] = func(spec["rank"], spec["world_size"], **spec["kwargs"])
    except BaseException as err:  # noqa: BLE001 - reported to the test
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(err).__name__}: {err}"
        code = 1
    with open(spec["out"], "w") as f:
        json.dump(rec, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a group whose peer failed may block in its
    # destructor; the test has what it needs.
    os._exit(code)


if __name__ == "__main__":
    sys.exit(_worker(json.loads(sys.argv[1])))
