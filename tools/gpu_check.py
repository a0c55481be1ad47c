"""make gpu-check: the GPU list (../shared/GPU.md, docs/cuda.md) in one unattended run.

On a machine with a GPU (nvidia-smi lists one) it builds lionbit into the
Python given (`--python`, default this one: no venv, nothing downloaded) for
that GPU's architecture only, with every core, and the C++ tree's GPU
targets beside it; then runs, in order, each step with its own time limit, so
that a hang or a failure never stops the rest:

  build        the extension (CUDA path, one architecture) and the C++ GPU targets
  import       lionbit.built_with_cuda, lionbit.kernels("cuda")
  ctest-gpu    every GPU kernel against the CPU kernel, bit for bit (test_cuda_kernels)
  pytest-custom / pytest-aten
               pytest -m gpu with LIONBIT_KERNELS=custom and =aten, each split
               into 4 runs, all 8 side by side with the equality runs
  verdicts     the first-use self-check's verdict for every custom kernel
  bench-kernels  bench/cuda_kernels.cu at 16M and 256M elements against the
               same GPU's device-to-device copy (goal: >= 80 %)
  projection   bench/gpu_step_projection.py on the rates bench-kernels just measured:
               a step of 1.3B / 7B models on 2-64 nodes of 8 GPUs against Lion / AdamW
               with a bf16 all-reduce, PowerSGD and HSDP (lionbit.estimate); without a
               GPU, on the newest committed rates (COMMITTED_RATES)
  lion-step    DistributedLion's local step against torch Lion (foreach ops) and
               the memory-traffic floor, on ~1B parameters in large bf16 matrices
               and a GPT-2-medium-shaped list (goal: <= 1.0x torch Lion on both)
  train-step   a GPT-2-small-shaped model's step in bf16 autocast under DDP and
               FSDP2 with DistributedLion attached, against the same step with
               no communication (goal: <= 1.05x)
  equality     DDP and FSDP2 + DistributedLion on CUDA tensors, 2 ranks on the
               one GPU (Gloo transport), and HSDP on 4 ranks (2 x 2 mesh),
               bitwise equal to the same runs on CPU
  profile      a torch.profiler trace of one DDP + DistributedLion step

Without a GPU it runs what needs none: the GPU targets are compiled (where
nvcc is), the self-check and the equality runs on CPU, and the GPU-only
scripts once on small CPU inputs so they cannot rot; the GPU steps say
"skipped: no GPU". Logs, results.json and summary.md go to --out (default
$OUT, else gpu-check-results/); the table is printed last. Exit status 1 if
any step failed.

    python tools/gpu_check.py [--python PY] [--out DIR] [--budget SECONDS] [--no-build] [--bundle]
                              [--only STEP,STEP,...]

--only runs those steps alone (build and import always run; a step left out
says "skipped: not in --only"): a second call after a fix, within a lent
GPU's few minutes, e.g. --only lion-step,train-step.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The steps, in the order they run (--only picks some; build and import always run).
STEPS = ("build", "import", "ctest-gpu", "pytest-custom", "pytest-aten", "verdicts", "bench-kernels", "projection",
         "lion-step", "train-step", "equality", "profile")
ALWAYS = ("build", "import")
# The newest make gpu-check figures in the tree: the projection's kernel rates where this run has none.
COMMITTED_RATES = os.path.join("docs", "benchmarks", "gpu_check_h200_5.json")


def gpu_test_files() -> list:
    """Every test file with a test marked gpu (the GPU twins of the CPU files' scripts among them),
    relative to the repository's root."""
    folder = os.path.join(ROOT, "tests", "python")
    return sorted(os.path.join("tests", "python", name) for name in os.listdir(folder)
                  if name.startswith("test_") and name.endswith(".py")
                  and "pytest.mark.gpu" in open(os.path.join(folder, name)).read())


class Step:
    """One row of the table: status "passed" / "failed" / "skipped", a key figure."""

    def __init__(self, name, what):
        self.name, self.what = name, what
        self.status, self.figure, self.seconds, self.logs = "skipped", "", 0.0, []

    def as_dict(self):
        return {"step": self.name, "what": self.what, "status": self.status, "figure": self.figure,
                "seconds": round(self.seconds, 1), "logs": self.logs}


class Runner:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.start = time.monotonic()
        self.steps = []
        self.figures = {}
        self.only = None if args.only is None else set(args.only) | set(ALWAYS)

    def wanted(self, name):
        """Whether step ``name`` runs (--only)."""
        return self.only is None or name in self.only

    def left(self):
        return self.args.budget - (time.monotonic() - self.start)

    def run(self, step, name, cmd, timeout, env=None):
        """Runs cmd with its output in logs/<name>.log; returns (rc, output). rc 124: timed out."""
        return self.run_together(step, [(name, cmd, timeout)], env)[0]

    def run_together(self, step, jobs, env=None):
        """Runs the (name, cmd, timeout) jobs at the same time, each logged to logs/<name>.log;
        returns [(rc, output)] in their order (rc 124: stopped at its time limit)."""
        # A segfault prints the Python stack of every thread (the first GPU run's crashed silently).
        # The caller's PYTEST_ADDOPTS is left out: its -q would hide the test ids the steps read.
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", **(env or {}))
        full_env.pop("PYTEST_ADDOPTS", None)
        t0 = time.monotonic()
        running = []
        for name, cmd, timeout in jobs:
            log = os.path.join(self.logs, f"{name}.log")
            step.logs.append(os.path.relpath(log, self.out))
            f = open(log, "w")
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                                    start_new_session=True)
            running.append((proc, f, log, t0 + max(1, min(timeout, self.left()))))
        results = []
        for proc, f, log, deadline in running:
            try:
                rc = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                rc = 124
            f.write(f"\n[exit {rc} after {time.monotonic() - t0:.1f} s{' (time limit)' if rc == 124 else ''}]\n")
            f.close()
            with open(log) as done:
                results.append((rc, done.read()))
        step.seconds += time.monotonic() - t0
        return results

    def step(self, name, what, min_s, fn, step=None):
        if step is None:
            step = Step(name, what)
            self.steps.append(step)
        if not self.wanted(name):
            step.figure = "not in --only"
            return step
        print(f"gpu-check: {name} ({what}) ...", flush=True)
        if self.left() < min_s:
            step.figure = f"out of time ({self.left():.0f} s left of --budget)"
            return step
        try:
            fn(step)
        except Exception as err:  # a bug in this script must not stop the other steps
            step.status, step.figure = "failed", f"gpu_check error: {type(err).__name__}: {err}"
        print(f"gpu-check: {name}: {step.status} {step.figure} ({step.seconds:.0f} s)", flush=True)
        return step

    def steps_side_by_side(self, specs):
        """Runs the steps (name, what, min_s, fn) at the same time, each in a thread; the table keeps
        their order. For steps that time nothing (a CPU run): their processes share the cores."""
        made = [Step(name, what) for name, what, _, _ in specs]
        self.steps += made
        threads = [threading.Thread(target=self.step, args=(*spec, step)) for spec, step in zip(specs, made)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _gpu():
    """The first GPU's name and compute capability from nvidia-smi, or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if not out:
        return None
    name, cap = (s.strip() for s in out[0].rsplit(",", 1))
    return {"name": name, "arch": cap.replace(".", "")}


def _nvcc():
    found = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not found and os.path.exists("/usr/local/cuda/bin/nvcc"):
        found = "/usr/local/cuda/bin/nvcc"
    return found


# Symbols of libstdc++'s compiled parts (locales, iostreams): an extension that
# exports them lets the process's own libstdc++ interpose half of its copy,
# and iostreams crash (the first GPU run: a toolchain that put them into _C).
LIBSTDCXX_PREFIXES = ("_ZNSt6locale", "_ZNKSt6locale", "_ZNSo", "_ZNSi", "_ZNSt8ios_base", "_ZNKSt7num_put",
                      "_ZNSt7num_put", "_ZNKSt7codecvt", "_ZNSt7codecvt", "_ZNSt9basic_ios")


def libstdcxx_exports(shared_object):
    """The libstdc++ locale / iostream symbols `shared_object` defines and exports
    (nm -D), or None where nm is missing."""
    if not shutil.which("nm"):
        return None
    out = subprocess.run(["nm", "-D", "--defined-only", shared_object], capture_output=True, text=True).stdout
    names = (line.split()[-1] for line in out.splitlines() if line.strip())
    return [n for n in names if n.startswith(LIBSTDCXX_PREFIXES)]


def trace_label(name: str) -> str:
    """A bundled trace's short name: train_step_ddp_cuda.trace.json.gz -> ddp,
    lion_step_stack_distlion_bf16_cuda.trace.json.gz -> lion stack distlion_bf16."""
    stem = re.sub(r"_(cuda|cpu)\.trace\.json(\.gz)?$", "", name)
    if stem.startswith("train_step_"):
        return stem[len("train_step_"):]
    if stem.startswith("lion_step_"):
        return "lion " + stem[len("lion_step_"):].replace("_", " ", 1)
    return stem


def _tail(text, lines=3):
    """The last lines of a step's output, without the log's own first and last lines."""
    mine = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.startswith(("$ ", "[exit "))]
    return " | ".join(mine[-lines:])


def _pytest_shards_summary(runs):
    """One line for a kernel choice's runs side by side: pytest's tallies added up (for a run
    stopped at its limit, its -v lines so far), the failures by name."""
    tally, failed, stopped = {}, [], 0
    for rc, text in runs:
        stopped += rc == 124
        for name, verdict in re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M):
            tally[verdict] = tally.get(verdict, 0) + 1
            if verdict in ("FAILED", "ERROR"):
                failed.append(name.split("::")[-1])
    if not tally:
        return " / ".join(_tail(text, 1) for _, text in runs)
    line = (f"{len(runs)} runs: {tally.get('PASSED', 0)} passed, {tally.get('FAILED', 0) + tally.get('ERROR', 0)} "
            f"failed, {tally.get('SKIPPED', 0)} skipped")
    if stopped:
        line += f"; {stopped} stopped at the time limit"
    return line + (f": {', '.join(failed)}" if failed else "")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the Python to build into and run with")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-results"))
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    ap.add_argument("--no-build", action="store_true", help="lionbit is already installed into --python")
    ap.add_argument("--cpp-build", help="a configured C++ build folder that already has the GPU targets "
                    "(make test-cpp's build/cpp): use it, build nothing")
    ap.add_argument("--bundle", action="store_true",
                    help="pack the logs and the steps' JSON into logs.tgz (a lent GPU machine returns 8 files)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    ap.add_argument("--gtest-source", default=os.environ.get("LIONBIT_GTEST_SOURCE_DIR", ""),
                    help="GoogleTest sources, where no GoogleTest is installed")
    ap.add_argument("--only", type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
                    help="run only these steps, comma-separated (build and import always run): a rerun after a "
                         "fix, e.g. lion-step,train-step; steps: " + ", ".join(STEPS))
    args = ap.parse_args(argv)
    if args.only is not None:
        unknown = [n for n in args.only if n not in STEPS]
        if unknown or not args.only:
            ap.error(f"--only: unknown step(s) {unknown or args.only}; the steps are {', '.join(STEPS)}")
    r = Runner(args)
    py = args.python
    gpu = _gpu()
    nvcc = _nvcc()
    arch = gpu["arch"] if gpu else "90"
    cpp_dir = os.path.join(ROOT, "build", f"gpu-check-cpp-{arch}")
    if args.cpp_build:
        cpp_dir = os.path.abspath(args.cpp_build)
    build_env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(args.jobs)}
    if nvcc:
        build_env["CUDACXX"] = nvcc
    no_gpu = "no GPU (nvidia-smi lists none)"
    print(f"gpu-check: {'GPU ' + gpu['name'] + ' (sm_' + arch + ')' if gpu else 'no GPU'}; python {py}; "
          f"nvcc {nvcc or 'none'}; {args.jobs} cores; out {r.out}", flush=True)

    cpp_wanted = r.wanted("ctest-gpu") or r.wanted("bench-kernels")  # the steps that use the C++ GPU targets

    def build(step):
        # The extension (pip, into --python) and the torch-free C++ GPU targets (the kernel
        # tests, the kernel benchmark) build at the same time: each ends on a long nvcc compile.
        jobs, names = [], []
        if not args.no_build:
            names.append("extension")
            jobs.append(("build-extension", [
                py, "-m", "pip", "install", "-v", "--no-build-isolation", "--no-deps", "--no-index",
                "--disable-pip-version-check", "-C", f"cmake.define.LIONBIT_CUDA={'ON' if gpu else 'AUTO'}",
                "-C", f"cmake.define.LIONBIT_CUDA_ARCHS={arch}-real", "-C", f"build-dir=build/gpu-check-{arch}", "."],
                480))
        if nvcc and not args.cpp_build and cpp_wanted:
            configure = ["cmake", "-S", ROOT, "-B", cpp_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                         "-DLIONBIT_BUILD_TESTS=ON", "-DLIONBIT_CUDA=ON", f"-DLIONBIT_CUDA_ARCHS={arch}-real",
                         f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DCMAKE_POLICY_VERSION_MINIMUM=3.5"]
            if args.gtest_source:
                configure.append(f"-DLIONBIT_GTEST_SOURCE_DIR={os.path.abspath(args.gtest_source)}")
            compile_ = ["cmake", "--build", cpp_dir, "-j", str(args.jobs), "--target", "test_cuda_kernels",
                        "lionbit_bench_cuda"]
            names.append(f"C++ GPU targets (sm_{arch})")
            jobs.append(("build-cpp", ["sh", "-c", shlex.join(configure) + " && " + shlex.join(compile_)], 480))
        done = r.run_together(step, jobs, build_env)
        bad = [f"{n}: exit {rc}: {_tail(out)}" for n, (rc, out) in zip(names, done) if rc != 0]
        step.status = "failed" if bad else "passed"
        parts = [] if jobs and not args.no_build else ["extension: installed by make build-tests"]
        parts += [f"{n} built" for n, (rc, _) in zip(names, done) if rc == 0]
        if not nvcc:
            parts.append("C++ GPU targets: no nvcc")
        elif not cpp_wanted:
            parts.append("C++ GPU targets: not needed by --only")
        elif args.cpp_build:
            parts.append(f"C++ GPU targets: {os.path.relpath(cpp_dir, ROOT)}'s")
        step.figure = "; ".join(parts + bad) + (f" in {step.seconds:.0f} s" if jobs else "")

    def import_(step):
        device = "cuda" if gpu else "cpu"
        code = ("import lionbit, json; print(json.dumps({'built_with_cuda': lionbit.built_with_cuda, "
                f"'kernels': lionbit.kernels('{device}'), 'version': lionbit.__version__, "
                "'so': lionbit._C.__file__}))")
        rc, out = r.run(step, "import", [py, "-c", code], timeout=120)
        line = [ln for ln in out.splitlines() if ln.startswith("{")]
        if rc != 0 or not line:
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        facts = json.loads(line[-1])
        r.figures["import"] = facts
        step.figure = f"built_with_cuda={facts['built_with_cuda']} kernels('{device}')={facts['kernels']}"
        step.status = "failed" if gpu and not facts["built_with_cuda"] else "passed"
        leaked = libstdcxx_exports(facts["so"])
        if leaked:
            step.status = "failed"
            step.figure += f"; _C exports {len(leaked)} libstdc++ symbols (e.g. {leaked[0]})"

    def ctest(step):
        binary = os.path.join(cpp_dir, "tests", "cpp", "test_cuda_kernels")
        if not gpu:
            step.figure = no_gpu + (" (test_cuda_kernels compiled)" if os.path.exists(binary) else "")
            return
        rc, out = r.run(step, "ctest-gpu", [binary, "--gtest_brief=1"], timeout=120)
        m = re.findall(r"\[==========\] (\d+) tests? from .* ran", out)
        failed = re.findall(r"\[  FAILED  \] (\d+) tests?", out)
        step.status = "passed" if rc == 0 else "failed"
        step.figure = f"{m[-1] if m else '?'} tests, {failed[-1] if failed else 0} failed" + (
            f" (exit {rc})" if rc else "")

    # The GPU tests are mostly rank processes starting CUDA (25-50 s a multi-rank test on an
    # H100 machine; the second session's two runs, one after the other, each hit their limit), so
    # each kernel choice's tests are split into SHARDS runs and all of them go side by side, with
    # the equality runs beside them (none of them is timed); the later steps report what ran here.
    pytest_runs = {}
    SHARDS = 4

    def pytest_cmd(choice, ids):
        cmd = [py, "-m", "pytest", *ids, "-v", "-ra", "--tb=short", "-p", "no:cacheprovider", "--durations=10"]
        if subprocess.run([py, "-c", "import pytest_timeout"], capture_output=True).returncode == 0:
            cmd.append("--timeout=150")  # a hung test fails alone; the run still ends with its summary
        return ["env", f"LIONBIT_KERNELS={choice}"] + cmd

    def start_gpu_runs(step, limit):
        files = gpu_test_files()
        rc, out = r.run(step, "pytest-collect", [py, "-m", "pytest", *files, "-m", "gpu", "--collect-only", "-q",
                                                 "-p", "no:cacheprovider"], timeout=120)
        ids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith(("$ ", "["))]
        if not ids:  # collection failed: one run per choice reports it
            ids = files + ["-m", "gpu"]
            shards = [ids]
        else:
            shards = [ids[i::SHARDS] for i in range(SHARDS) if ids[i::SHARDS]]
        jobs, keys = [], []
        for choice in (c for c in ("custom", "aten") if r.wanted(f"pytest-{c}")):
            for i, shard in enumerate(shards):
                jobs.append((f"pytest-{choice}-{i + 1}", pytest_cmd(choice, shard), limit))
                keys.append(choice)
        if r.wanted("equality"):
            jobs.append(("equality", [py, "tools/gpu_equality.py", "--devices", "cpu,cuda", "--json",
                                      os.path.join(r.out, "equality.json")], limit))
            keys.append("equality")
        for key, res in zip(keys, r.run_together(step, jobs)):
            pytest_runs.setdefault(key, []).append(res)

    def pytest(choice, limit):
        def fn(step):
            if not gpu:
                step.figure = no_gpu
                return
            if choice not in pytest_runs:
                start_gpu_runs(step, limit)
            runs = pytest_runs[choice]
            step.status = "passed" if all(rc == 0 for rc, _ in runs) else "failed"
            step.figure = _pytest_shards_summary(runs) + (" (ran beside pytest-custom)" if choice == "aten" else "")
        return fn

    def script_with_json(step, name, cmd, timeout, cpu_note):
        """A check script that writes its verdicts to --json: its exit status decides."""
        path = os.path.join(r.out, f"{name}.json")
        rc, out = r.run(step, name, cmd + ["--json", path], timeout=timeout)
        step.status = "passed" if rc == 0 else "failed"
        step.figure = _tail(out, 1) + ("" if gpu else f" ({cpu_note})")
        if os.path.exists(path):
            r.figures[name] = json.load(open(path))

    def verdicts(step):
        script_with_json(step, "verdicts", [py, "tools/kernel_verdicts.py", "--device", "cuda:0" if gpu else "cpu"],
                         180, "CPU: the SIMD set; no GPU")

    def bench_kernels(step):
        binary = os.path.join(cpp_dir, "lionbit_bench_cuda")
        if not gpu:
            step.figure = no_gpu + (" (lionbit_bench_cuda compiled)" if os.path.exists(binary) else "")
            return
        rc, out = r.run(step, "bench-kernels", [binary, str(16 << 20), str(256 << 20)], timeout=180)
        rows = re.findall(r"^(.+?)\s+(\d+)M\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%$", out, re.M)
        table = [{"kernel": k.strip(), "elements_M": int(n), "time_us": float(t), "MB": float(mb),
                  "GBps": float(g), "of_copy_pct": float(p)} for k, n, t, mb, g, p in rows]
        r.figures["bench_kernels"] = table
        # "@bit 1" rows: the kernels' unaligned (ballot) path, shown beside the goal rows
        big = [t for t in table if t["elements_M"] == 256 and not t["kernel"].startswith("memcpy")
               and "@bit" not in t["kernel"]]
        if rc != 0 or not big:
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        low = [t for t in big if t["of_copy_pct"] < 80]
        copy = [t for t in table if t["kernel"].startswith("memcpy") and t["elements_M"] == 256]
        step.status = "passed"
        step.figure = (f"256M: {len(big) - len(low)}/{len(big)} kernels >= 80 % of D2D copy "
                       f"({copy[0]['GBps']:.0f} GB/s)" if copy else "")
        if low:
            step.figure += "; under: " + ", ".join(f"{t['kernel']} {t['of_copy_pct']:.0f}%" for t in low)

    def summarize_traces(step, kind):
        """tools/trace_summary.py over this step's own traces (``kind``_*: lion-step and train-step run
        side by side, so neither reads the other's, which may be half written), merged into the figures'
        trace_summary; returns the step figure's note of where those steps left the device idle."""
        traces = os.path.join(r.out, "traces")
        found = sorted(os.listdir(traces)) if os.path.isdir(traces) else []
        paths = [os.path.join(traces, n) for n in found if n.startswith(kind + "_") and n.endswith(".trace.json.gz")]
        summary_path = os.path.join(r.out, f"trace_summary_{kind}.json")
        cmd = [py, "tools/trace_summary.py", *paths, "--json", summary_path]
        if not paths or r.run(step, f"trace-summary-{kind}", cmd, timeout=60)[0] != 0:
            return ""
        summaries = {os.path.basename(k): v for k, v in json.load(open(summary_path)).items()}
        r.figures.setdefault("trace_summary", {}).update(summaries)
        idle = [f"{trace_label(n)} {v['idle_ms']:.1f}" for n, v in summaries.items() if v["device_events"]]
        return "; device idle ms in the traced step: " + ", ".join(idle) if idle else ""

    def lion_step(step):
        path = os.path.join(r.out, "lion_step.json")
        # each method's profiled step on each list as a Chrome trace (bundled and summarized)
        cmd = [py, "bench/gpu_lion_step.py", "--json", path, "--trace-dir", os.path.join(r.out, "traces")]
        # The larger votes the default may move to once a GPU has checked them bit for bit
        # (test_cuda.py's 2 GiB chunk test): their rows, beside the default's, in lion_step.json.
        cmd += ["--params", "1e9", "--chunks", "29/29,30/30"] if gpu else [
            "--device", "cpu", "--params", "4e6", "--steps", "3", "--gpt2-width", "64", "--chunks", "20/20"]
        rc, out = r.run(step, "lion-step", cmd, timeout=240)
        if rc != 0 or not os.path.exists(path):
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        res = json.load(open(path))
        r.figures["lion_step"] = res
        key, double = "DistributedLion (bf16 momentum)", "DistributedLion (bf16 momentum, double_buffer)"
        parts = []
        for name, fig in res["lists"].items():
            ms, launched = fig["ms_per_step"], fig["launches_per_step"]
            parts.append(f"{name} {fig['params'] / 1e9:.2f}B/{fig['tensors']}: torch Lion "
                         f"{ms['torch Lion (foreach, bf16 momentum)']:.1f} ms, DistributedLion {ms[key]:.1f} ms "
                         f"(host {fig['host_ms_per_step'][key]:.1f}) = "
                         f"{fig['ratio_to_torch'][key]:.2f}x torch, {fig['ratio_to_floor'][key]:.2f}x floor"
                         + (f", {launched[key]} launches" if launched[key] else "")
                         + (f"; double_buffer {ms[double]:.1f} ms = {fig['ratio_to_torch'][double]:.2f}x torch, "
                            f"{fig['ratio_to_floor'][double]:.2f}x floor" if double in ms else ""))
        figure = "; ".join(parts) + summarize_traces(step, "lion_step")
        if gpu:
            step.status, step.figure = "passed", figure
            # Where the time goes, for the next session: a profile of the list furthest from torch Lion.
            worst = max(res["lists"], key=lambda name: res["lists"][name]["ratio_to_torch"][key])
            if res["lists"][worst]["ratio_to_torch"][key] > 1.5 and r.left() > 90:
                r.run(step, "lion-profile", [py, "bench/gpu_lion_step.py", "--lists", worst, "--steps", "3",
                                             "--profile"],
                      timeout=min(120, r.left() - 30))
        else:
            step.figure = no_gpu + f" (the script ran on CPU at {res['params'] / 1e6:.0f}M parameters)"

    def projection(step):
        """bench/gpu_step_projection.py on this run's kernel rates (without a GPU: the newest committed
        ones), the step of 1.3B / 7B models on 2-64 nodes against the other methods (lionbit.estimate)."""
        measured = "bench_kernels" in r.figures  # only where bench-kernels ran on a GPU
        rates = os.path.join(r.out, "kernel_rates.json") if measured else COMMITTED_RATES
        if measured:
            with open(rates, "w") as f:
                json.dump({"gpu": gpu, "figures": {"bench_kernels": r.figures["bench_kernels"]}}, f)
        rc, out = r.run(step, "projection", [py, "bench/gpu_step_projection.py", "--gpu-rates", rates,
                                             "--out", os.path.join(r.out, "projection")], timeout=60)
        if rc != 0:
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        figure = _tail(out, 1)
        if measured:
            step.status, step.figure = "passed", figure
        else:
            step.figure = (no_gpu if not gpu else "no kernel rates in this run") + f" (from {rates}: {figure})"

    def train_step(step):
        path = os.path.join(r.out, "train_step.json")
        # each kind's profiled step as a Chrome trace, for the sessions after this one (bundled)
        cmd = [py, "bench/gpu_train_step.py", "--json", path, "--trace-dir", os.path.join(r.out, "traces")]
        cmd += ["--profile"] if gpu else ["--device", "cpu", "--batch", "2", "--seq", "64", "--width", "48",
                                          "--layers", "2", "--vocab", "512", "--steps", "3"]
        rc, out = r.run(step, "train-step", cmd, timeout=180)
        if rc != 0 or not os.path.exists(path):
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        res = json.load(open(path))
        r.figures["train_step"] = res
        steps = res["results"]
        figure = f"{res['params'] / 1e6:.0f}M, bf16 autocast: floor {steps['floor']['ms_per_step']:.1f} ms; "
        def describe(k, v):
            text = f"{k} {v['ratio_to_floor']:.2f}x (host {v['host_ms_per_step']:.1f} ms)"
            if "ratio_to_plain" in v:  # lionbit's own share: against the same wrapper without it
                text += f" ({v['ratio_to_plain']:.2f}x {k.split('_')[0]}_plain)"
            if v.get("device_busy_ms_per_step") is not None and v.get("host_syncs_per_step") is not None:
                text += f" (device busy {v['device_busy_ms_per_step']:.1f} ms, {v['host_syncs_per_step']} syncs)"
            if "diagnostics_error" in v:
                text += f" (diagnostics failed: {v['diagnostics_error'][:80]})"
            return text + (f" ({v['device_events_per_step']} events)" if v["device_events_per_step"] else "")

        figure += ", ".join(describe(k, v) for k, v in steps.items() if k != "floor")
        # Where each kind's step left the device idle, and what the host did meanwhile (its log).
        figure += summarize_traces(step, "train_step")
        if gpu:
            step.status, step.figure = "passed", figure
        else:
            step.figure = no_gpu + f" (the script ran on CPU at {res['params'] / 1e6:.1f}M parameters)"

    def equality(step):
        if "equality" in pytest_runs:  # it ran beside the GPU tests
            rc, out = pytest_runs["equality"][0]
            path = os.path.join(r.out, "equality.json")
            step.status = "passed" if rc == 0 else "failed"
            step.figure = _tail(out, 1) + (" (ran beside the GPU tests)" if rc != 124 else " (time limit)")
            if os.path.exists(path):
                r.figures["equality"] = json.load(open(path))
            return
        script_with_json(step, "equality", [py, "tools/gpu_equality.py", "--devices", "cpu,cuda" if gpu else "cpu"],
                         300, "the CPU half; CUDA: no GPU")

    def profile(step):
        cmd = [py, "bench/gpu_ddp_profile.py", "--out", r.out]
        cmd += ["--device", "cuda"] if gpu else ["--device", "cpu", "--params", "1e6"]
        rc, out = r.run(step, "profile", cmd, timeout=240)
        top = re.findall(r"^\s*(\S.*?)\s{2,}[\d.]+%", out, re.M)
        if rc != 0:
            step.status, step.figure = "failed", f"exit {rc}: {_tail(out)}"
            return
        figure = "top: " + ", ".join(t.strip()[:40] for t in top[:3])
        if gpu:
            step.status, step.figure = "passed", figure
        else:
            step.figure = no_gpu + " (traced on CPU)"

    r.step("build", "extension + C++ GPU targets, one architecture", 60, build)
    r.step("import", "built_with_cuda, kernels", 10, import_)
    r.step("ctest-gpu", "GPU kernels vs CPU kernels", 20, ctest)
    r.step("pytest-custom", "pytest -m gpu, LIONBIT_KERNELS=custom and aten side by side", 60, pytest("custom", 270))
    r.step("pytest-aten", "pytest -m gpu, LIONBIT_KERNELS=aten", 0, pytest("aten", 270))
    rest = [("verdicts", "first-use self-check, every custom kernel", 10, verdicts),
            ("bench-kernels", "kernels vs D2D copy, 16M / 256M", 20, bench_kernels),
            ("projection", "a step on 2-64 nodes on these kernels (lionbit.estimate)", 5, projection),
            ("lion-step", "DistributedLion vs torch Lion, 1B bf16", 30, lion_step),
            ("train-step", "DDP / FSDP2 + DistributedLion vs no communication, GPT-2-small", 30, train_step),
            ("equality", "DDP / FSDP2 / HSDP on CUDA == on CPU", 30, equality),
            ("profile", "torch.profiler, one DDP step", 20, profile)]
    if gpu:  # one at a time: the benchmarks' timings must not share the machine
        for spec in rest:
            r.step(*spec)
    else:  # nothing is timed: the scripts' CPU runs go side by side
        r.steps_side_by_side(rest)

    total = time.monotonic() - r.start
    result = {"gpu": gpu, "python": py, "nvcc": nvcc, "seconds": round(total, 1),
              "steps": [s.as_dict() for s in r.steps], "figures": r.figures}
    with open(os.path.join(r.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| step | status | s | figure |", "| --- | --- | ---: | --- |"]
    lines += [f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.figure} |" for s in r.steps]
    lines.append(f"\n{'GPU ' + gpu['name'] if gpu else 'no GPU'}; {total:.0f} s in all; logs in {r.out}")
    with open(os.path.join(r.out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if args.bundle:
        import tarfile

        extra = [n for n in ("verdicts.json", "equality.json", "lion_step.json", "train_step.json",
                             "trace_summary_lion_step.json", "trace_summary_train_step.json")
                 if os.path.exists(os.path.join(r.out, n))]
        folders = ["logs"] + [n for n in ("traces",) if os.path.isdir(os.path.join(r.out, n))]
        with tarfile.open(os.path.join(r.out, "logs.tgz"), "w:gz") as tar:
            for name in folders + extra:
                tar.add(os.path.join(r.out, name), arcname=name)
        for name in folders:
            shutil.rmtree(os.path.join(r.out, name))
        for name in extra:
            os.remove(os.path.join(r.out, name))
    print("\n" + "\n".join(lines))
    return 1 if any(s.status == "failed" for s in r.steps) else 0


if __name__ == "__main__":
    sys.exit(main())
