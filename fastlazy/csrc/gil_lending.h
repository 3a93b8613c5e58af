// The GIL lent to short jobs beside the user's thread (fastlazy's
// compile_worker.run_beside: a packed program's compile) while the user's
// thread runs a graph's kernels without it.
//
// The GIL has no priorities: a job's Python that takes the GIL when the
// user's thread lets go of it for a run keeps it until the interpreter's
// switch interval (5 ms) forces it out, and the user's thread, its kernels
// done, waits that long.  A job throttled to short slices instead (as the
// compile thread is) stalls a later call with each slice, and its work
// comes late.  So a borrowing thread's profile hook watches two counts the
// executor keeps: while some user thread runs kernels without the GIL the
// job runs on; the moment one of them wants the GIL back the job lets go
// and waits until it has it.  Only while no run is under way does the job
// fall back to a slice of run_ns every run_ns + sleep_us.
#pragma once

#include <Python.h>
#include <frameobject.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include <unistd.h>

namespace fastlazy {

// user threads inside a run that let go of the GIL, and those of them that
// have finished it and wait to take the GIL back
inline std::atomic<int> g_runs_without_gil{0};
inline std::atomic<int> g_waiting_for_gil{0};
// 0: borrowers run unlimited (a thread waits for their jobs, or the
// program exits); else a borrower's slice while no run is under way
inline std::atomic<int64_t> g_lend_run_ns{0};
inline std::atomic<int64_t> g_lend_sleep_us{0};

inline int64_t lend_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Around a run's kernels: the GIL let go, and taken back with the
// borrowers told to let go of it first.
class KernelsWithoutGil {
 public:
  KernelsWithoutGil() {
    g_runs_without_gil.fetch_add(1, std::memory_order_relaxed);
    state_ = PyEval_SaveThread();
  }
  ~KernelsWithoutGil() {
    g_waiting_for_gil.fetch_add(1, std::memory_order_relaxed);
    g_runs_without_gil.fetch_sub(1, std::memory_order_relaxed);
    PyEval_RestoreThread(state_);
    g_waiting_for_gil.fetch_sub(1, std::memory_order_relaxed);
  }
  KernelsWithoutGil(const KernelsWithoutGil&) = delete;
  KernelsWithoutGil& operator=(const KernelsWithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

inline thread_local int64_t t_slice_start_ns = 0;
inline thread_local unsigned t_events = 0;

// The borrower's profile hook (checked every 16 Python calls and returns).
inline int lend_hook(PyObject*, PyFrameObject*, int, PyObject*) {
  if (++t_events & 15) return 0;
  const int64_t run_ns = g_lend_run_ns.load(std::memory_order_relaxed);
  if (run_ns == 0) return 0;
  if (g_waiting_for_gil.load(std::memory_order_relaxed) > 0) {
    PyThreadState* state = PyEval_SaveThread();
    // until the user's thread has it (then taking it back waits for the
    // user's next run, or for the switch interval)
    while (g_waiting_for_gil.load(std::memory_order_relaxed) > 0) usleep(10);
    PyEval_RestoreThread(state);
    t_slice_start_ns = lend_now_ns();
    return 0;
  }
  if (g_runs_without_gil.load(std::memory_order_relaxed) > 0) {
    t_slice_start_ns = lend_now_ns();   // a lent stretch: no slice spent
    return 0;
  }
  const int64_t now = lend_now_ns();
  if (now - t_slice_start_ns < run_ns) return 0;
  PyThreadState* state = PyEval_SaveThread();
  usleep(static_cast<useconds_t>(g_lend_sleep_us.load(std::memory_order_relaxed)));
  PyEval_RestoreThread(state);
  t_slice_start_ns = lend_now_ns();
  return 0;
}

inline void borrow_gil_on_this_thread() {
  t_slice_start_ns = lend_now_ns();
  PyEval_SetProfile(lend_hook, nullptr);
}

inline void set_gil_lending(int64_t run_us, int64_t sleep_us) {
  g_lend_sleep_us.store(run_us > 0 ? sleep_us : 0, std::memory_order_relaxed);
  g_lend_run_ns.store(run_us > 0 ? run_us * 1000 : 0, std::memory_order_relaxed);
}

}  // namespace fastlazy
