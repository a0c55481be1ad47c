"""`make gpu-check` in its CPU mode (tools/gpu_check.py), so that the GPU list
cannot rot between the rare sessions that have a GPU: every step that needs
none runs (the self-check of the SIMD set against ATen, the CPU half of the
DDP / FSDP2 equality runs), and every GPU-only script runs once on small CPU
inputs; the GPU steps say "skipped" with the reason. It reuses the tests'
builds (the installed package, make test-cpp's build/cpp with the CUDA
targets where nvcc is)."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import lionbit

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
GPU_STEPS = ("ctest-gpu", "pytest-custom", "pytest-aten", "bench-kernels", "projection", "lion-step", "train-step",
             "profile")


def _gpu_check_module():
    """tools/gpu_check.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _has_gpu():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.startswith("GPU")


def test_gpu_check_cpu_mode(tmp_path):
    if _has_gpu():
        pytest.skip("a GPU is here: make gpu-check runs its GPU mode (minutes), not this test")
    cpp = os.path.join(ROOT, "build", "cpp")
    args = [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--no-build", "--out", str(tmp_path)]
    if os.path.exists(os.path.join(cpp, "CMakeCache.txt")):
        args += ["--cpp-build", cpp]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_WORLD_SIZE", None)
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    steps = {s["step"]: s for s in res["steps"]}
    assert list(steps) == ["build", "import", "ctest-gpu", "pytest-custom", "pytest-aten", "verdicts",
                           "bench-kernels", "projection", "lion-step", "train-step", "equality", "profile"]
    assert tuple(steps) == _gpu_check_module().STEPS  # what --only names
    for name in GPU_STEPS:
        assert steps[name]["status"] == "skipped" and "no GPU" in steps[name]["figure"], steps[name]
    for name in ("build", "import", "verdicts", "equality"):
        assert steps[name]["status"] == "passed", steps[name]
    # The checks that ran on CPU, read from their own JSON.
    verdicts = res["figures"]["verdicts"]["verdicts"]
    assert {"pack", "count_code", "vote", "unpack", "lion_apply"} <= set(verdicts)
    assert set(verdicts.values()) == {"ok"}, verdicts
    checks = res["figures"]["equality"]["checks"]
    assert checks["cpu vote: ddp == fsdp2"] and checks["the runs moved the parameters"], checks
    assert all(checks.values()) and len(checks) >= 10, checks
    # The GPU-only scripts ran on CPU and wrote what the GPU run reads.
    lion = json.loads((tmp_path / "lion_step.json").read_text())
    assert lion["ms_per_step"]["DistributedLion (bf16 momentum)"] > 0
    assert lion["lists"]["stack"]["ms_per_step"]["DistributedLion (bf16 momentum, double_buffer)"] > 0
    assert set(lion["lists"]) == {"stack", "gpt2-medium"} and lion["lists"]["gpt2-medium"]["tensors"] == 292
    assert lion["lists"]["stack"]["floor_ms"] > 0
    train = json.loads((tmp_path / "train_step.json").read_text())
    assert set(train["results"]) == {"floor", "ddp_plain", "ddp", "ddp_at_step", "fsdp2_plain", "fsdp2"}
    # lionbit's own share: each wrapper against itself without lionbit.
    assert all(train["results"][k]["ratio_to_plain"] > 0 for k in ("ddp", "ddp_at_step", "fsdp2")), train["results"]
    assert "x ddp_plain)" in steps["train-step"]["figure"] or "no GPU" in steps["train-step"]["figure"]
    # Each kind's profiled step as a Chrome trace, for a session without a GPU to read, and
    # each Lion step's method on each list.
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    lion_traces = [f"lion_step_{name}_{m}_cpu.trace.json.gz" for name in ("stack", "gpt2-medium")
                   for m in ("torch", "distlion_bf16", "distlion_bf16_db", "distlion_fp32", "distlion_unfused")]
    assert traces == sorted([f"train_step_{k}_cpu.trace.json.gz" for k in train["results"]] + lion_traces), traces
    with gzip.open(tmp_path / "traces" / "train_step_fsdp2_cpu.trace.json.gz") as f:
        assert "Optimizer.step#DistributedLion.step" in f.read().decode()
    with gzip.open(tmp_path / "traces" / "lion_step_gpt2-medium_distlion_bf16_cpu.trace.json.gz") as f:
        assert "Optimizer.step#DistributedLion.step" in f.read().decode()
    gpu_check = _gpu_check_module()
    assert [gpu_check.trace_label(n) for n in (traces[0], lion_traces[1])] == [
        "lion gpt2-medium distlion_bf16", "lion stack distlion_bf16"]
    summaries = res["figures"]["trace_summary"]  # tools/trace_summary.py over them (no device events here)
    assert set(summaries) == set(traces) and all(s["host_events"] > 0 for s in summaries.values()), summaries
    assert checks["cpu hsdp vote: ranks agree"] and checks["hsdp: the runs moved the parameters"], checks
    assert (tmp_path / "ddp_step_cpu.txt").read_text().count("lionbit") >= 1
    assert (tmp_path / "ddp_step_cpu.trace.json.gz").stat().st_size > 0
    # The projection ran on the committed rates: 2 models x 4 links x 3 cluster sizes.
    proj = json.loads((tmp_path / "projection" / "gpu_step_projection.json").read_text())
    assert len(proj["rows"]) == 24 and "24 cases" in steps["projection"]["figure"], steps["projection"]
    # The table comes last, one row per step.
    table = r.stdout.strip().splitlines()
    assert table[-1].startswith("no GPU;") and sum(line.startswith("| ") for line in table[-16:]) == 14


def test_gpu_check_runs_every_file_with_a_gpu_test():
    """Its pytest steps collect `-m gpu` from every file that has such a test,
    not a list that a new GPU twin can miss (test_fsdp_plan's and
    test_fsdp1_plan's once were)."""
    files = _gpu_check_module().gpu_test_files()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # `make test PYTEST_ADDOPTS=-q`: -qq
    r = subprocess.run([sys.executable, "-m", "pytest", os.path.join("tests", "python"), "-m", "gpu",
                        "--collect-only", "-q", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    marked = sorted({line.split("::")[0] for line in r.stdout.splitlines() if "::" in line})
    assert marked and files == marked, (files, marked, r.stdout[-2000:])
    for twin in ("test_fsdp_plan.py", "test_fsdp1_plan.py", "test_step_plan.py", "test_examples.py"):
        assert os.path.join("tests", "python", twin) in files


def test_gpu_check_only_runs_the_steps_named(tmp_path):
    """--only (a rerun after a fix, within a lent GPU's few minutes): build and import and the
    steps named run, every other step is in the table as skipped, "not in --only"; a name that
    is not a step is refused before anything runs, naming the option and the steps."""
    if _has_gpu():
        pytest.skip("a GPU is here: --only would run the named GPU steps (minutes)")
    script = os.path.join(ROOT, "tools", "gpu_check.py")
    r = subprocess.run([sys.executable, script, "--no-build", "--out", str(tmp_path), "--only", "verdicts, projection"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    steps = {s["step"]: s for s in res["steps"]}
    assert tuple(steps) == _gpu_check_module().STEPS
    for name in ("build", "import", "verdicts"):
        assert steps[name]["status"] == "passed", steps[name]
    assert "24 cases" in steps["projection"]["figure"], steps["projection"]
    assert set(res["figures"]) == {"import", "verdicts"}, res["figures"].keys()
    left_out = [n for n in steps if n not in ("build", "import", "verdicts", "projection")]
    for name in left_out:
        assert steps[name]["status"] == "skipped" and steps[name]["figure"] == "not in --only", steps[name]
        assert not os.path.exists(tmp_path / "logs" / f"{name}.log"), name
    bad = subprocess.run([sys.executable, script, "--no-build", "--out", str(tmp_path / "bad"), "--only",
                          "lion-step,lion_step"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--only: unknown step(s) ['lion_step']" in bad.stderr, bad.stderr
    assert "lion-step, train-step" in bad.stderr and not (tmp_path / "bad" / "results.json").exists()


def test_projection_reads_the_rates_gpu_check_writes(tmp_path):
    """With a GPU, gpu_check hands the projection this run's kernel rows as {"gpu", "figures":
    {"bench_kernels"}}: the script reads that file and names the GPU."""
    gpu_check = _gpu_check_module()
    committed = json.loads(open(os.path.join(ROOT, gpu_check.COMMITTED_RATES)).read())
    rates = tmp_path / "kernel_rates.json"
    rates.write_text(json.dumps({"gpu": {"name": "Test GPU 9000"},
                                 "figures": {"bench_kernels": committed["figures"]["bench_kernels"]}}))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_step_projection.py"), "--gpu-rates",
                        str(rates), "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("on Test GPU 9000's kernels, 24 cases: Lion + bf16 all-reduce / DistributedLion "), last


def test_extension_exports_no_libstdcxx():
    """lionbit._C keeps whatever a toolchain links into it statically private
    (bindings/CMakeLists.txt: --exclude-libs): the first GPU run crashed in
    every sign collective because _C exported libstdc++'s locale symbols."""
    gpu_check = _gpu_check_module()
    leaked = gpu_check.libstdcxx_exports(lionbit._C.__file__)
    if leaked is None:
        pytest.skip("no nm on this machine")
    assert leaked == []


def test_trace_summary_finds_the_gaps_and_who_made_them(tmp_path):
    """tools/trace_summary.py on a GPU step's trace (made up here: a CPU run has no device
    events): the device's busy ms counts overlapping kernels once, the idle gaps are the
    complement within the step, each gap names the host work under it (a sync on the main
    thread, the vote on lionbit's worker), and the sync calls are counted."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import trace_summary

    def ev(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}

    events = [
        ev("cpu_op", "aten::mm", 0, 50),
        ev("cuda_runtime", "cudaLaunchKernel", 10, 5),
        ev("kernel", "gemm", 20, 1000, tid=7),
        ev("kernel", "gemm_b", 500, 1000, tid=8),  # another stream, overlapping: counted once
        ev("cuda_runtime", "cudaStreamSynchronize", 1500, 3000),  # main thread waits...
        ev("user_annotation", "lionbit::issue", 1600, 2600, tid=2),  # ...on the worker's vote
        ev("kernel", "vote", 4500, 200, tid=7),
        ev("cpu_op", "Optimizer.step#DistributedLion.step", 4700, 1300),
        ev("gpu_memcpy", "Memcpy DtoH", 6000, 100, tid=7),
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "M", "name": "process_name"}]}, f)
    s = trace_summary.summarize(trace_summary._events(str(path)), gaps=5, min_gap_ms=0.2)
    assert s["span_ms"] == pytest.approx(6.1) and s["busy_ms"] == pytest.approx(1.78)
    assert s["idle_ms"] == pytest.approx(6.1 - 1.78)
    assert [round(g["ms"], 2) for g in s["gaps"]] == [3.0, 1.3]  # 1.5-4.5 ms and 4.7-6.0 ms (the 20 us lead: too short)
    first = s["gaps"][0]["host"]
    assert first[0] == {"name": "cudaStreamSynchronize", "tid": 1, "ms": pytest.approx(3.0)}
    assert first[1] == {"name": "lionbit::issue", "tid": 2, "ms": pytest.approx(2.6)}
    assert s["gaps"][1]["host"][0]["name"] == "Optimizer.step#DistributedLion.step"
    assert s["syncs"] == {"cudaStreamSynchronize": {"calls": 1, "ms": pytest.approx(3.0)}}
    assert "gap of 3.00 ms" in trace_summary.describe(s)
