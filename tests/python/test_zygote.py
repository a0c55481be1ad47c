"""The test zygote (zygote.py) hands out ranks that are the fresh processes
they stand for: their own argv, environment, working directory, log and
standard input; exit statuses as subprocess reports them; a process group
that os.killpg ends; variables that lionbit reads once per process taken
from the rank's environment, not the zygote's; their own random state."""

import json
import os
import signal
import time

import pytest

import harness
import zygote

RANK = """
import json, os, random, sys, time
what = sys.argv[1]
if what == "describe":
    import lionbit._C
    line = sys.stdin.readline()
    print("to stderr", file=sys.stderr)
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "only": os.environ.get("ONLY_THIS_RANK"),
                      "gone": "PYTHONPATH" in os.environ, "stdin": line.strip(),
                      "isa": lionbit._C.cpu_isa(), "random": random.random(), "pgid": os.getpgid(0) == os.getpid()}))
elif what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "raise":
    raise KeyError("from the rank")
elif what == "sleep":
    import subprocess
    child = subprocess.Popen(["sleep", "300"])
    print(child.pid, flush=True)
    time.sleep(300)
"""


@pytest.fixture(scope="module")
def zyg(tmp_path_factory):
    """The session's zygote, the one the harness's ranks come from."""
    z = harness._zygote()
    assert "PYTHONPATH" in z.env  # harness.rank_env sets it; the ranks below go without
    script = tmp_path_factory.mktemp("zygote") / "rank_script.py"
    script.write_text(RANK)
    return z, str(script)


def _spawn(zyg, tmp_path, args, env=None, pool=False, name="rank"):
    z, script = zyg
    log = open(tmp_path / f"{name}.log", "w+")
    env = dict(env if env is not None else os.environ)
    env.pop("PYTHONPATH", None)
    return z.spawn([script, *args], env, log, pool), log


def _output(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()


def test_a_rank_is_the_process_it_stands_for(zyg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ranks = []
    for k, isa in enumerate(("scalar", "avx2")):
        env = dict(os.environ, ONLY_THIS_RANK=str(k), LIONBIT_ISA=isa)
        ranks.append(_spawn(zyg, tmp_path, ["describe", "x y"], env=env, pool=True, name=f"r{k}"))
    got = []
    for k, (p, log) in enumerate(ranks):
        p.stdin.write(f"line {k}\n".encode())
        p.stdin.flush()
        assert p.wait(timeout=60) == 0, _output(log)
        out = _output(log)
        assert "to stderr" in out
        got.append(json.loads(out.splitlines()[-1]))
    for k, g in enumerate(got):
        assert g["argv"] == ["describe", "x y"] and g["cwd"] == str(tmp_path) and g["pgid"], g
        assert g["only"] == str(k) and not g["gone"] and g["stdin"] == f"line {k}", g
    # LIONBIT_ISA is read once, at the first kernel call: after the fork, from the rank's environment.
    assert got[0]["isa"] == "scalar"
    assert got[1]["isa"] in ("avx2", "scalar")  # scalar where the CPU has no AVX2
    assert got[0]["random"] != got[1]["random"]


@pytest.mark.parametrize("args,code", [(["exit", "0"], 0), (["exit", "3"], 3), (["raise"], 1)])
def test_exit_statuses_are_what_subprocess_reports(zyg, tmp_path, args, code):
    p, log = _spawn(zyg, tmp_path, args)
    assert p.wait(timeout=60) == code, _output(log)
    if code == 1:
        assert "KeyError: 'from the rank'" in _output(log)


def test_killpg_ends_the_rank_and_what_it_started(zyg, tmp_path):
    p, log = _spawn(zyg, tmp_path, ["sleep"])
    deadline = time.monotonic() + 60
    while not _output(log).strip() and time.monotonic() < deadline:
        time.sleep(0.01)
    child = int(_output(log).split()[0])
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while zygote._alive(child) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not zygote._alive(child)


def test_ranks_that_end_at_once_are_all_reported(zyg, tmp_path):
    # Many ranks ending together, some while the zygote is still forking the next: each
    # status reaches the test (a SIGCHLD taken between two checks once left one unreaped).
    ranks = [_spawn(zyg, tmp_path, ["exit", str(k % 5)], name=f"q{k}") for k in range(60)]
    assert [p.wait(timeout=60) for p, _ in ranks] == [k % 5 for k in range(60)]
