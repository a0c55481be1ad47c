// Diagnosis only, preloaded: delays every GIL acquisition from C++ code
// (pybind11's gil_scoped_acquire -> PyEval_AcquireThread, e.g. torch freeing
// a tensor's Python twin) on threads other than the main one, widening the
// window between "is the interpreter alive?" and taking the GIL. A thread
// that takes it after finalization began is killed by pthread_exit, which
// aborts through a noexcept destructor ("terminate called without an
// active exception"); see tools/exit_loop.sh for use.
//   gcc -O2 -shared -fPIC -o /tmp/slow_gil.so tools/slow_gil.c -ldl
//   LD_PRELOAD=/tmp/slow_gil.so SLOW_GIL_MS=1 python ...
// SLOW_GIL_MS: the delay (default 30); SLOW_GIL_LOG=1: a line per delayed
// acquisition; SLOW_GIL_LOG=1 SLOW_GIL_BT=1: with its backtrace. Needs a shared libpython.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <execinfo.h>
typedef struct _ts PyThreadState;
static void (*real_acquire)(PyThreadState*);
void PyEval_AcquireThread(PyThreadState* t) {
  if (!real_acquire) real_acquire = dlsym(RTLD_NEXT, "PyEval_AcquireThread");
  if (syscall(SYS_gettid) != getpid()) {
    static int ms = -1;
    if (ms < 0) { const char* e = getenv("SLOW_GIL_MS"); ms = e ? atoi(e) : 30; }
    if (getenv("SLOW_GIL_LOG")) {
      char name[32] = "?";
      FILE* f = fopen("/proc/thread-self/comm", "r");
      if (f) {
        if (!fgets(name, sizeof name, f)) name[0] = 0;
        fclose(f);
      }
      name[strcspn(name, "\n")] = 0;
      fprintf(stderr, "slow_gil: tid %ld (%s) takes the GIL in %d ms\n", (long)syscall(SYS_gettid), name, ms);
      if (getenv("SLOW_GIL_BT")) {
        void* b[24];
        backtrace_symbols_fd(b, backtrace(b, 24), 2);
      }
    }
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
  }
  real_acquire(t);
}
