// The GIL lent to fastlazy's background threads (compile_worker's: the
// compile thread, and the thread for short jobs beside the user's) while
// the user's thread runs a graph's kernels without it.
//
// The GIL has no priorities: a background thread's Python that takes the
// GIL when the user's thread lets go of it for a run keeps it until the
// interpreter's switch interval (5 ms) forces it out, and the user's
// thread, its kernels done, waits that long.  A thread throttled to short
// slices instead stalls a later call with each slice, and its work comes
// late.  So a borrowing thread's profile hook watches two counts the
// executor keeps: while some user thread runs kernels without the GIL the
// borrower runs on; the moment one of them wants the GIL back it lets go
// and waits until that thread has it.  Only while no run is under way
// does it fall back to its own slice: run_us of every run_us + sleep_us.
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
// false: borrowers run unlimited (a thread waits for their work, or the
// program exits)
inline std::atomic<bool> g_lending{false};

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

// the borrowing thread's slice while no run is under way
inline thread_local int64_t t_run_ns = 0;
inline thread_local unsigned t_sleep_us = 0;
inline thread_local int64_t t_slice_start_ns = 0;
inline thread_local unsigned t_events = 0;

// The borrower's profile hook (checked every 16 Python calls and returns).
inline int lend_hook(PyObject*, PyFrameObject*, int, PyObject*) {
  if (++t_events & 15) return 0;
  if (!g_lending.load(std::memory_order_relaxed)) return 0;
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
  if (now - t_slice_start_ns < t_run_ns) return 0;
  PyThreadState* state = PyEval_SaveThread();
  usleep(t_sleep_us);
  PyEval_RestoreThread(state);
  t_slice_start_ns = lend_now_ns();
  return 0;
}

inline void borrow_gil_on_this_thread(int64_t run_us, int64_t sleep_us) {
  t_run_ns = run_us * 1000;
  t_sleep_us = static_cast<unsigned>(sleep_us);
  t_slice_start_ns = lend_now_ns();
  PyEval_SetProfile(lend_hook, nullptr);
}

inline void set_gil_lending(bool on) { g_lending.store(on, std::memory_order_relaxed); }

}  // namespace fastlazy
