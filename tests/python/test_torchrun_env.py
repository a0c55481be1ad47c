"""torchrun_env.py's promises: its ranks see the variables a torchrun
worker sees (checked against a real torchrun launch, so a torch that
changes them shows here), and a launch that fails or hangs fails its test
with every rank's output, never a stuck run."""

import json
import os
import subprocess
import sys
import time

import pytest

import harness
import torchrun_env

DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"env{os.environ['RANK']}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""

#: What differs by design (torchrun_env.py's docstring): the port and the run's id are each
#: launch's own (and no error file is kept for an agent).
OWN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID"}


def _workers_env(tmp_path, launch) -> list:
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    launch(str(script), str(tmp_path))
    return [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(2)]


def test_the_ranks_see_what_torchruns_workers_see(tmp_path):
    env = harness.rank_env(None)  # what both launches start from
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    (tmp_path / "real").mkdir()
    (tmp_path / "forked").mkdir()
    real = _workers_env(tmp_path / "real", lambda *argv: subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node=2", *argv], check=True, capture_output=True, env=env,
        timeout=120))
    forked = _workers_env(tmp_path / "forked", lambda *argv: torchrun_env.run(*argv, ranks=2))
    for rank in range(2):
        set_by_torchrun = {k: v for k, v in real[rank].items() if env.get(k) != v and k != "_"}
        set_by_torchrun.pop("TORCHELASTIC_ERROR_FILE")
        ours = {k: v for k, v in forked[rank].items() if env.get(k) != v and k != "_"}
        assert set(set_by_torchrun) == set(ours), (rank, sorted(set_by_torchrun), sorted(ours))
        differ = {k for k in ours if ours[k] != set_by_torchrun[k]}
        assert differ <= OWN, (rank, {k: (set_by_torchrun[k], ours[k]) for k in differ})


def test_a_rank_that_fails_ends_the_launch_with_every_ranks_output(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nprint('rank', os.environ['RANK'], 'here', flush=True)\n"
                      "sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(AssertionError) as err:
        torchrun_env.run(str(script), ranks=2, timeout=300)
    msg = str(err.value)
    assert "on 1 x 2 ranks: exits [-9, 3]" in msg, msg
    assert "rank 0 here" in msg and "rank 1 here" in msg, msg
    assert time.monotonic() - start < 60  # not the deadline


def test_a_hang_is_killed_at_the_deadline(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(AssertionError) as err:
        torchrun_env.run(str(script), ranks=2, timeout=2)
    assert "on 1 x 2 ranks: hung past 2 s" in str(err.value), str(err.value)
