# lionbit task runner. `make test` and `make demo` do all their own set-up.
#
#   make demo          4 local CPU ranks under torchrun: DDP + DistributedLion training
#   make demo-fsdp     4 ranks: FSDP2 (fully_shard) + DistributedLion, 1-bit reduce-scatter
#   make demo-sign     4 ranks: the sign all-reduce vs an fp32 all-reduce, 16M elements
#   make convergence   DistributedLion vs Lion vs AdamW on the bundled digits
#   make convergence-levers  Lion Cub's levers (tie break, l1 p-bit, momentum sync) against vote, avg,
#                      Lion and AdamW: digits and a byte-level LM, N 4 and 8, two batches each, seeds
#                      0-2 (tools/convergence_levers.py; ~35 min on 2 cores):
#                      docs/benchmarks/convergence_levers.{json,md}
#   make test          C++ tests (ctest) and Python tests (pytest)
#   make lint          ruff over the Python files (tools/lint.sh; .ci/run runs it before make test)
#   make lint-cpp      the C++ format check: clang-format --dry-run --Werror with .clang-format
#   make format-cpp    reformat every tracked C++ file in place with .clang-format
#   make build         (re)build and install the package into the venv (CUDA path: only where a
#                      GPU is, unless LIONBIT_CUDA=AUTO|ON|OFF says otherwise; tools/build.sh)
#   make test-cpp / test-python
#   make test-aten     the Python tests marked `kernels` again with LIONBIT_KERNELS=aten: the sign
#                      collectives and DistributedLion through the device-generic ATen kernel set
#                      (the one a GPU falls back to), bitwise the same results. CI runs it after
#                      make test
#   make test-gpu      the GPU tests (ctest -L gpu, pytest -m gpu); they skip, saying
#                      why, where there is no GPU
#   make gpu-check     the GPU list in one unattended run (tools/gpu_check.py, docs/cuda.md): on a
#                      GPU machine it builds into that machine's python3 for its GPU alone and runs
#                      the GPU tests, the kernel self-check, the GPU benchmarks and the CUDA == CPU
#                      runs; elsewhere the steps that need no GPU. Table last; logs in $OUT or
#                      gpu-check-results/
#   make test-sanitize C++ tests built with ASan + UBSan (build/sanitize), fuzz tests scaled up
#   make test-sanitize-python  the Python tests with the extension built with ASan + UBSan
#   make test-valgrind kernel tests under valgrind memcheck (build/valgrind), 1M-element cases left out
#   make bench         quick benchmark suite (< 10 min; root: emulated 1 and 10 Gbit/s links in network
#                      namespaces, else loopback): suites 2, 1 and 3 (quick); bench/results/*.json, *.md,
#                      *.png; see docs/benchmarks.md
#   make bench-full    the full collectives suite (N 2,4,8; d 1M,16M,64M)
#   make bench-kernels suite 2 alone: CPU kernels (Google Benchmark) against one core's read bandwidth
#   make bench-training suite 3 alone: DDP training step (~26M-parameter LM, N 4, 1 and 10 Gbit/s,
#                      5 warm-up + 20 timed steps per config; ~7 min on 2 cores)
#   make bench-model   suite 4 alone: the cost model (seconds; no build, no root) on bench/results/,
#                      else on docs/benchmarks/: bench/results/cost_model.{json,md,*.png}
#
# The virtual environment lives outside the clone so fresh clones reuse it.
LIONBIT_VENV ?= $(HOME)/.cache/lionbit/venv
TORCH_SPEC   ?= torch==2.15.0
PYTHON       ?= python3
JOBS         ?= $(shell nproc)
PY           := $(LIONBIT_VENV)/bin/python
export LIONBIT_VENV TORCH_SPEC PYTHON
# The CUDA path is built wherever nvcc is (CMake's LIONBIT_CUDA=AUTO): let
# CMake find the toolkit's usual home even when it is not on PATH.
ifeq ($(origin CUDACXX),undefined)
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDACXX := /usr/local/cuda/bin/nvcc
endif
endif

.PHONY: all setup setup-demo build build-tests lint lint-cpp format-cpp test test-cpp test-python test-aten test-gpu gpu-check test-sanitize test-sanitize-python test-valgrind demo demo-fsdp demo-sign convergence convergence-levers bench bench-full bench-setup bench-kernels bench-training bench-model clean

all: build

# `make demo` sets up only what it needs (torch, the build tools, scikit-learn);
# the tests, lint and benchmarks add the test tools the first time they run.
setup:
	@tools/setup_env.sh

setup-demo:
	@tools/setup_env.sh demo

# pip builds incrementally (tools/build.sh); a no-op rebuild takes seconds. `build` compiles
# the CUDA path only where a GPU is (or LIONBIT_CUDA says so); the tests' build wherever nvcc is.
build: setup-demo
	@tools/build.sh

build-tests: setup
	@tools/build.sh tests

test: test-cpp test-python

# ruff comes from the venv (tools/requirements-dev.txt), clang-format from Debian.
lint: setup
	@tools/lint.sh

lint-cpp:
	@tools/apt_need.sh lint-cpp clang-format
	@tools/lint.sh --cpp

CPP_FILES = git ls-files -z '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh'
format-cpp:
	@tools/apt_need.sh format-cpp clang-format
	@$(CPP_FILES) | xargs -0 clang-format --style=file -i

test-cpp: setup
	@cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DLIONBIT_BUILD_TESTS=ON >/dev/null
	@cmake --build build/cpp -j $(JOBS)
	@ctest --test-dir build/cpp -j $(JOBS) --output-on-failure --timeout 300

# The same C++ tests with AddressSanitizer + UndefinedBehaviorSanitizer; any
# report fails the run (-fno-sanitize-recover). The fuzz tests of what peers
# send (tests/cpp/test_fuzz.cpp) run 10x longer here.
test-sanitize:
	@cmake -S . -B build/sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLIONBIT_BUILD_TESTS=ON -DLIONBIT_SANITIZE=ON -DLIONBIT_CUDA=OFF >/dev/null
	@cmake --build build/sanitize -j $(JOBS)
	@ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:check_initialization_order=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 LIONBIT_FUZZ_ITERS=10 \
	  ctest --test-dir build/sanitize -j $(JOBS) --output-on-failure --timeout 600

# The Python tests with lionbit's extension (the backend, bindings, kernels) built with ASan +
# UBSan: into build/sanitize-python/pkg, first on PYTHONPATH, the runtimes preloaded into the
# venv's Python and every rank it forks. A report anywhere (ranks killed on purpose included)
# leaves a log in build/sanitize-python/ and fails the run; it is printed whether or not a test
# failed too, and a rank a sanitizer stopped shows it in its test's failure. CPU path only; left
# out: make gpu-check's test, which configures the C++ GPU targets (nvcc's cicc segfaults with the
# runtimes preloaded) and runs what the other tests run.
SANITIZE_PY := $(CURDIR)/build/sanitize-python
test-sanitize-python: setup
	@rm -rf $(SANITIZE_PY)/pkg $(SANITIZE_PY)/report.*
	@$(PY) -m pip install -q --no-build-isolation --no-deps --disable-pip-version-check --target $(SANITIZE_PY)/pkg \
	  -C cmake.define.LIONBIT_CUDA=OFF -C cmake.define.LIONBIT_TEST_HOOKS=ON -C cmake.define.LIONBIT_SANITIZE=ON \
	  -C build-dir=$(SANITIZE_PY)/build .
	@PYTHONPATH=$(SANITIZE_PY)/pkg LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:log_path=$(SANITIZE_PY)/report \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(SANITIZE_PY)/report LIONBIT_EXPECT_CUDA=0 \
	  $(PY) -m pytest tests/python -q -ra -p no:cacheprovider --ignore=tests/python/test_gpu_check.py; \
	  rc=$$?; if ls $(SANITIZE_PY)/report.* >/dev/null 2>&1; then head -50 $(SANITIZE_PY)/report.*; exit 1; fi; exit $$rc

# The kernel tests under valgrind memcheck (tools/valgrind_tests.sh).
test-valgrind:
	@command -v valgrind >/dev/null || tools/apt_need.sh test-valgrind valgrind
	@cmake -S . -B build/valgrind -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLIONBIT_BUILD_TESTS=ON -DLIONBIT_CUDA=OFF >/dev/null
	@cmake --build build/valgrind -j $(JOBS)
	@tools/valgrind_tests.sh build/valgrind

test-python: build-tests
	@$(PY) -m pytest tests/python -q -ra

# The files marked `kernels` (pytestmark): the sign collectives' orchestration, every wire format
# and every lever, DistributedLion's update path. The rest (launch, frameworks, checkpoints, faults,
# docs) run no kernel that these do not.
test-aten: build-tests
	@LIONBIT_KERNELS=aten $(PY) -m pytest tests/python -q -ra -m kernels

test-gpu: build-tests
	@cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DLIONBIT_BUILD_TESTS=ON >/dev/null
	@cmake --build build/cpp -j $(JOBS)
	@ctest --test-dir build/cpp -L gpu --output-on-failure --timeout 600
	@$(PY) -m pytest tests/python -m gpu -v -ra

# With a GPU: no venv (the machine's own python3 and torch; nothing downloaded). Without one: the
# tests' build, then the steps that need no GPU.
gpu-check:
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	  $(PYTHON) tools/gpu_check.py --python $(PYTHON) $(GPU_CHECK_ARGS); \
	else \
	  $(MAKE) --no-print-directory build-tests && $(PY) tools/gpu_check.py --no-build $(GPU_CHECK_ARGS); \
	fi

TORCHRUN := env -u LOCAL_WORLD_SIZE $(LIONBIT_VENV)/bin/torchrun --standalone --nproc-per-node 4

demo: build
	@$(TORCHRUN) examples/ddp_train.py

demo-fsdp: build
	@$(TORCHRUN) examples/fsdp_train.py

demo-sign: build
	@$(TORCHRUN) examples/sign_allreduce_demo.py

convergence: build
	@$(TORCHRUN) examples/convergence_digits.py

# One torchrun per (task, N, batch), each under env -u LOCAL_WORLD_SIZE OMP_NUM_THREADS=1;
# LEVERS_ARGS passes options through (e.g. LEVERS_ARGS=--resume after an interruption).
convergence-levers: build
	@$(PY) tools/convergence_levers.py $(LEVERS_ARGS)

bench-setup: setup build
	@tools/setup_bench.sh

bench-kernels: bench-setup
	@cmake -S . -B build/bench -G Ninja -DCMAKE_BUILD_TYPE=Release -DLIONBIT_BUILD_TESTS=ON -DLIONBIT_BUILD_EXTENSION=OFF -DLIONBIT_CUDA=OFF >/dev/null
	@cmake --build build/bench -j $(JOBS) --target lionbit_bench_cpu
	@mkdir -p bench/results
	@build/bench/lionbit_bench_cpu --benchmark_min_time=0.5 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
	  --benchmark_out=bench/results/cpu_kernels.json --benchmark_out_format=json
	@$(PY) bench/report.py --kernels bench/results/cpu_kernels.json

bench: bench-kernels
	@$(PY) bench/collectives.py --quick --json bench/results/collectives.json
	@$(PY) bench/training.py --quick --json bench/results/training.json
	@$(MAKE) --no-print-directory bench-model

# Suite 4 needs only Python's standard library (matplotlib for its plots): no build, no
# set-up. Its inputs: the fresh suite-2 and suite-1 files in bench/results/ when there are,
# else the committed ones in docs/benchmarks/.
bench-model:
	@k=bench/results/cpu_kernels.json; [ -f $$k ] || k=docs/benchmarks/cpu_kernels.json; \
	  c=$$(ls bench/results/collectives*.json 2>/dev/null); [ -n "$$c" ] || c=$$(ls docs/benchmarks/collectives*.json); \
	  py=$(PY); [ -x "$$py" ] || py=$(PYTHON); \
	  echo "bench-model: $$k, "$$c; \
	  $$py bench/cost_model.py --kernels $$k --collectives $$c --json bench/results/cost_model.json

bench-full: bench-setup
	@$(PY) bench/collectives.py --json bench/results/collectives-full.json

bench-training: bench-setup
	@$(PY) bench/training.py --json bench/results/training.json

clean:
	rm -rf build
