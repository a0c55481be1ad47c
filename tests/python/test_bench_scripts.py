"""The benchmark scripts still run against the package as it is: suite 3
(bench/training.py) reaches into DistributedLion's DDP attachment to trace
each bucket's vote and to time the communication alone, and a refactor once
broke both without any test noticing; suite 5 (bench/time_to_target.py)
runs its phases (tuning, the target, steps to it, the link) for every method. Loopback (no namespaces, no root), two
ranks, a few steps: checked for running to the end and reporting what the
docs read from it (bytes, the bucket trace and timeline, identical replicas,
steps to target), never for speed."""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_training_suite_runs_and_reports_the_vote(tmp_path):
    out = tmp_path / "training.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "training.py"), "--loopback", "--ranks", "2",
         "--impls", "no_comm,distlion_vote,distlion_vote_step", "--warmup", "3", "--steps", "1",
         "--comm-repeats", "1", "--json", str(out), "--timeline", str(tmp_path / "timeline")],
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
    # --timeline: every rank's view of one step, each bucket's vote found in LIONBIT_TRACE.
    tl = rows["distlion_vote"]["timeline_ms"]
    assert [r["rank"] for r in tl["ranks"]] == [0, 1]
    for r in tl["ranks"]:
        assert sum(b["numel"] for b in r["buckets"]) == d
        for b in r["buckets"]:
            assert b["hook"] <= b["call"] <= b["header"] <= b["end"] <= r["step_end"], b
        assert r["backward_end"] <= r["step_end"]
    assert all(row["vs_floor_by_step"] is None for row in rows.values())  # only with --interleave


def test_training_suite_interleaves_the_configs_step_by_step(tmp_path):
    """--interleave: every config built first, step i of each taken in turn; each config's ratio to
    the floor step by step; DDP with no communication and DDP with bucket views run beside the vote."""
    out = tmp_path / "training.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    impls = ["no_comm", "ddp_no_comm", "distlion_vote_bv"]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "training.py"), "--loopback", "--ranks", "2", "--interleave",
         "--impls", ",".join(impls), "--warmup", "3", "--steps", "3", "--comm-repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["meta"]["interleave"] is True
    rows = {row["impl"]: row for row in doc["results"]}
    assert set(rows) == set(impls)
    for impl, row in rows.items():
        steps = row["step_s_by_step"]
        assert len(steps) == 3 and all(t > 0 for t in steps), impl
        assert row["vs_floor_by_step"] > 0, impl
        assert statistics.median(steps) == pytest.approx(row["median_s"], rel=0.5), impl
    assert rows["no_comm"]["vs_floor_by_step"] == 1.0
    assert rows["ddp_no_comm"]["bytes_per_rank"] == 0 and rows["ddp_no_comm"]["replicas_identical"] is None
    vote = rows["distlion_vote_bv"]
    d = vote["numel"]
    assert vote["replicas_identical"] is True
    assert d / 8 <= vote["bytes_per_rank"] <= 2 * d / 8, vote["bytes_per_rank"]
    assert vote["sign_allreduce_calls_per_step"] >= 1
    assert "vs floor, step by step" in (tmp_path / "training.md").read_text()


def test_time_to_target_quick_path_runs_every_phase(tmp_path):
    """Suite 5's --quick path, every method, on a tiny model and corpus (--tiny) and a few steps,
    two seeds: each phase runs and writes what the summary reads; the summary has a row per
    method; the first seed's steps come from the link phase, AdamW + fp32's from the target's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    out = tmp_path / "ttt"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "time_to_target.py"), "--quick", "--tiny", "--loopback",
         "--steps", "4", "--tune-steps", "2", "--eval-every", "2", "--seeds", "0,1", "--dir", str(out)],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import time_to_target as ttt

    tune = json.loads((out / "tune.json").read_text())["results"]
    assert len(tune) == sum(len(ttt.grid(m)) for m in ttt.METHODS)
    assert {len(ttt.grid(m)) for m in ttt.METHODS} == {4}  # grids of the same size
    target = [r["curve"] for r in json.loads((out / "target.json").read_text())["results"]]
    assert len(target) == 2 and [c[0] for c in target[0]] == [2, 4]
    steps = json.loads((out / "steps-n2.json").read_text())["results"]
    assert sorted(r["method"] for r in steps) == sorted(set(ttt.METHODS) - {"adamw_fp32"})
    assert {r["seed"] for r in steps} == {1}
    link = json.loads((out / "link-n2.json").read_text())["results"]
    assert {r["method"] for r in link} == set(ttt.METHODS) | {"floor"}
    assert {r["seed"] for r in link} == {0}
    a = argparse.Namespace(dir=str(out), links="1gbit", seeds="0,1")
    merged = ttt.Suite(a).steps_results()
    assert sorted((r["method"], r["seed"]) for r in merged) == sorted((m, s) for m in ttt.METHODS for s in (0, 1))
    for rec in steps + link:
        assert rec["seconds_per_step"] > 0 and all(c[3] > 0 for c in rec["curve"]), rec["method"]
    table = (out / "summary.md").read_text()
    for m in ttt.METHODS:
        assert f"| 2 | {m} |" in table, m
    assert "the floor (no communication)" in table
    assert not (out / "levers.json").exists()  # --quick leaves the levers out unless asked
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "time_to_target.py"), "--quick", "--tiny", "--loopback",
         "--steps", "4", "--eval-every", "2", "--dir", str(out), "--only", "levers"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = (out / "summary.md").read_text()
    tuned = {r["method"]: r["hp"] for r in steps}
    levers = {r["lever"]: r for r in json.loads((out / "levers.json").read_text())["results"]}
    assert set(levers) == set(ttt.LEVERS)
    for name, lever in ttt.LEVERS.items():  # each lever is its base method's tuned run with one change
        rec, base = levers[name], tuned[lever["base"]]
        assert rec["method"] == lever["base"] and rec["world_size"] == 2, name
        assert rec["hp"]["lr"] == pytest.approx(base["lr"] * lever.get("lr_scale", 1.0)), name
        assert rec["hp"]["weight_decay"] == base["weight_decay"], name
        assert rec["extra"] == lever.get("kwargs", {}) and rec["batch"] == lever.get("batch", ttt.GLOBAL_BATCH)
        assert f"| {name} |" in table, name

def test_hierarchy_suite_counts_the_bytes_between_nodes(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import netns  # optional: the bench folder, not a package

    ok, why = netns.can_make_namespaces()
    if not ok:
        pytest.skip(f"suite 6 needs network namespaces: {why}")
    out = tmp_path / "hierarchy.json"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "hierarchy.py"), "--numel", "1M", "--warmup", "1",
         "--repeats", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["method"]: row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {"flat", "node", "node_vote"}
    for method, row in rows.items():
        # The wire less the frames' headers is the formula's bytes up to the
        # TCP stack's own extras (ACK options, window updates): within 1.3 %
        # at d = 1M with 5 repeats in docs/hierarchy.md, up to 5 % with 2 here.
        # A loose bound: each node's veth counts only what crosses nodes.
        assert abs(row["payload_vs_formula"] - 1) < 0.15, (method, row)
    for method in ("node", "node_vote"):  # lionbit's counters are exact
        assert rows[method]["counted_bytes_per_node"] == rows[method]["formula_bytes_per_node"], rows[method]
    assert (tmp_path / "hierarchy.md").exists()


_RANK = """
import json, os, sys, time
mode, out = sys.argv[1], sys.argv[2]
facts = {"rank": int(os.environ["RANK"]), "argv": sys.argv[1:], "omp": os.environ.get("OMP_NUM_THREADS"),
         "mine": os.environ.get("ONLY_HERE"), "leads_group": os.getpgid(0) == os.getpid(),
         "dynamo_loaded": "torch._dynamo" in sys.modules}
if mode == "hang" and facts["rank"] == 1:
    os.system(f"exec sleep {os.environ['SLEEPER']} </dev/null >/dev/null 2>&1 &")  # a child in its process group
    time.sleep(600)
if mode == "fail" and facts["rank"] == 1:
    raise ValueError("rank 1 fails")
if mode == "exit" and facts["rank"] == 1:
    sys.exit(3)
import torch
facts["threads"] = torch.get_num_threads()
with open(f"{out}.{facts['rank']}", "w") as f:
    json.dump(facts, f)
if facts["rank"] == 0:
    time.sleep(0.5)
    with open(out, "w") as f:
        json.dump([json.load(open(f"{out}.{r}")) for r in (0, 1)], f)
"""

_LAUNCHER = """
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import collectives

def command(pid):
    # /proc, not ps(1): under make test-sanitize-python ps inherits the
    # preloaded ASan runtime, and ps deadlocked in it.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\\0")[:-1]
    except OSError:
        return None

def main():
    rank, out = sys.argv[2], sys.argv[3]
    os.environ.update(OMP_NUM_THREADS="1", ONLY_HERE="yes")
    report = {"ok": collectives.launch(None, 2, [sys.executable, rank, "ok", out], out, 120)}
    del os.environ["ONLY_HERE"]
    report["second"] = collectives.launch(None, 2, [sys.executable, rank, "ok", out + "2"], out + "2", 120)
    for mode in ("fail", "exit"):
        try:
            collectives.launch(None, 2, [sys.executable, rank, mode, out], out, 120)
        except RuntimeError as err:
            report[mode] = str(err)
    start = time.monotonic()
    try:
        collectives.launch(None, 2, [sys.executable, rank, "hang", out], out, 2)
    except subprocess.TimeoutExpired:
        report["hang_s"] = time.monotonic() - start
    time.sleep(0.5)
    sleeper = ["sleep", os.environ["SLEEPER"]]
    report["sleepers"] = [pid for pid in os.listdir("/proc") if pid.isdigit() and command(pid) == sleeper]
    print(json.dumps(report))

if __name__ == "__main__":
    main()
"""


def test_loopback_ranks_are_forked_with_their_own_argv_environment_and_session(tmp_path):
    """collectives.launch on loopback (every bench script's ranks here) forks
    each rank from a process that has imported torch (bench/rank_fork.py):
    each rank has its own argv and environment (as the launcher's os.environ
    stands at each launch), leads its process group, and its failure, exit
    status or hang reaches the launcher (a hang ends at the timeout with the
    rank's own children). LIONBIT_BENCH_FORK=0 (fresh interpreters, as in
    network namespaces) passes the same checks but dynamo_loaded: run by hand."""
    (tmp_path / "rank.py").write_text(_RANK)
    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import rank_fork

    forked = rank_fork.forkable([sys.executable, str(tmp_path / "rank.py")])
    env = dict(os.environ, SLEEPER=f"{600 + random.random():.9f}")  # this run's, not a concurrent run's
    env.pop("OMP_NUM_THREADS", None)
    r = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), os.path.join(ROOT, "bench"),
                        str(tmp_path / "rank.py"), str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout.splitlines()[-1])
    for launch, mine in (("ok", "yes"), ("second", None)):
        ranks = report[launch]
        assert [f["rank"] for f in ranks] == [0, 1], launch
        for f in ranks:
            assert f["argv"][0] == "ok" and f["omp"] == "1" and f["threads"] == 1 and f["mine"] == mine, (launch, f)
            assert f["leads_group"], (launch, f)
            assert f["dynamo_loaded"] == forked, (launch, f)  # forked: torch came with the fork
    assert "exit codes [0, 1]" in report["fail"] and "ValueError: rank 1 fails" in r.stderr
    assert "exit codes [0, 3]" in report["exit"]
    assert 1.5 < report["hang_s"] < 60 and report["sleepers"] == []


def test_train_step_device_busy_is_the_union_of_its_events():
    """gpu_train_step's "busy ms": overlapping device events (two streams) count once, gaps not at all."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from gpu_train_step import union_ms

    assert union_ms([]) == 0.0
    assert union_ms([(30.0, 40.0), (0.0, 10.0), (5.0, 20.0), (6.0, 8.0)]) == pytest.approx(0.030)
    assert union_ms([(0.0, 1000.0), (100.0, 200.0)]) == pytest.approx(1.0)
