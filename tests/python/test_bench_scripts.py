"""The benchmark scripts still run against the package as it is: suite 3
(bench/training.py) reaches into DistributedLion's DDP attachment to trace
each bucket's vote and to time the communication alone, and a refactor once
broke both without any test noticing. Loopback (no namespaces, no root), two
ranks, one timed step: checked for running to the end and reporting what
the docs read from it (bytes, the bucket trace, identical replicas), never
for speed."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_training_suite_runs_and_reports_the_vote(tmp_path):
    out = tmp_path / "training.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "training.py"), "--loopback", "--ranks", "2",
         "--impls", "no_comm,distlion_vote,distlion_vote_step", "--warmup", "3", "--steps", "1",
         "--comm-repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["impl"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"no_comm", "distlion_vote", "distlion_vote_step"}
    d = rows["distlion_vote"]["numel"]
    for impl in ("distlion_vote", "distlion_vote_step"):
        row = rows[impl]
        assert row["replicas_identical"] is True, impl
        # The vote's payload: 2(N-1)/N * d/8 bytes at N = 2, plus the tie
        # positions (ties are common at even N): between 1x and 2x.
        assert d / 8 <= row["bytes_per_rank"] <= 2 * d / 8, (impl, row["bytes_per_rank"])
        assert row["comm_alone_s"] > 0, impl
    trace = rows["distlion_vote"]["bucket_trace_ms"]
    assert trace and sum(b["numel"] for b in trace) == d
    assert all(b["hook"] <= b["hook_return"] <= b["done"] for b in trace), trace
