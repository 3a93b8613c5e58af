"""The one background thread that runs compilers (inductor), so that no
user call waits for one; and a second one for short jobs beside the user's
(run_beside), which must not queue behind a compile.

One thread, because inductor's compile path is not made for concurrent use
and because one core of compile work at a time is what a user's program can
spare.  The thread lowers its own scheduling priority (Linux: per-thread
niceness, inherited by the C++ compiler processes inductor starts), so the
user's thread keeps its core; the GIL is still shared, which is why the
thread also limits its own duty cycle (see _work).

At interpreter exit the compiles still queued are dropped (a program that
ends must not wait for compiles nobody will use), the work the thread waits
on elsewhere is ended first (the compile process is killed: at_close), and
a compile running on the thread itself is waited for: interrupting a
compiler mid-way can abort the process.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import queue
import threading
import time

import torch

from fastlazy import _core, compile_log, step_executor

NICENESS = 10           # added to the thread's priority value (lower priority)
# the compile thread's duty cycle: it runs at most RUN_US of every
# RUN_US + SLEEP_US microseconds.  Measured on W4's cold processes (2 cores,
# the user's loop calling without pause): at 1000/1000 the user's calls
# during a compile took 1.6-1.9x their time on the fast tier alone (ViT
# 2.4 ms against 1.3 ms; resnet18 18 ms against 11 ms); at 200/1000 they
# take 1.0-1.2x (1.45 ms, 12.3 ms), and the first 100 calls end 24-32 %
# sooner.  The price: the compile takes longer while the user's thread is
# busy (ViT's graph promoted after 57 s of calls instead of 29 s); a
# program that waits (tiering.wait, exit) lifts the limit.  That duty cycle
# now holds only while no graph run of the user's has let go of the GIL:
# during one the thread borrows the GIL and gives it back as the run ends
# (_hold_this_thread).  In cold processes calling without pause for 40 s,
# against the duty cycle alone: ViT's plain program on probation at 7.0 s
# instead of 10.4-12.3 s, its frozen one in use at 12.8-13.1 s instead of
# 24-32 s, 3-10 % more calls in the 40 s; resnet18's frozen program in use
# at 13.8 s instead of after the 40 s, 21 % more calls; BERT's plain
# program at 7.0-7.5 s instead of 10.2-11.8 s, 0-2 % more calls, though
# its calls while the frozen program compiled took 8-13 % longer.
RUN_US, SLEEP_US = 200, 1000
# a job beside the user's (run_beside) borrows the GIL while the user's
# graph runs let go of it (csrc/gil_lending.h); while none is under way it
# runs RUN_US of every RUN_US + LENT_SLEEP_US: a job's Python is short, and
# its slices stalled the user's next calls (ViT's calls 3-14)
LENT_SLEEP_US = 5000

_queue: queue.SimpleQueue = queue.SimpleQueue()
_at_close: list = []
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
_closing = False


def forget_after_fork():
    """In a forked child the compile thread is gone (fork copies only the
    forking thread), and the queue and locks may be in its mid-use state:
    new ones, and a new thread at the next submit."""
    global _queue, _thread, _start_lock, _waiting_lock, _waiting
    global _beside_queue, _beside_thread
    _queue, _thread = queue.SimpleQueue(), None
    _beside_queue, _beside_thread = queue.SimpleQueue(), None
    _start_lock, _waiting_lock, _waiting = threading.Lock(), threading.Lock(), 0
    _beside.clear()             # (their thread stayed behind too)


def submit(fn, *args) -> concurrent.futures.Future:
    """Run fn(*args) on the compile thread; its Future."""
    future = concurrent.futures.Future()
    _ensure_thread()
    _queue.put((future, fn, args))
    return future


# the jobs run_beside queued that have not finished
_beside: set = set()
_beside_queue: queue.SimpleQueue = queue.SimpleQueue()
_beside_thread: threading.Thread | None = None


def run_beside(fn, *args) -> concurrent.futures.Future:
    """Run fn(*args) soon on the thread for short jobs beside the user's,
    of lowered priority as the compile thread is, but not behind its
    compiles: for a short job (packed_convs: a packed program's compile,
    oneDNN's weight reorders and timings, which let go of the GIL), which
    queued behind a compile would come long after it could have served
    (resnet18's reorders and packed program's compile on the compile
    thread took 40 calls' time).  The job's Python borrows the GIL while
    the user's graph runs let go of it (_hold_this_thread): unlimited, it
    held the GIL past the run's end and the user's thread waited for all
    of it (1.3 ms of ViT's second call); throttled to slices, each slice
    stalled a later call and the packing came 20 calls later."""
    future = concurrent.futures.Future()
    _beside.add(future)
    future.add_done_callback(_beside.discard)
    start_beside()
    _beside_queue.put((future, fn, args, torch.get_num_threads()))
    return future


def start_beside() -> None:
    """Start run_beside's thread, if it is not running (fastlazy.enable
    starts it: a thread's start cost the calling thread 0.1-0.3 ms, which
    a graph's second call paid when each job started one)."""
    _start_once("_beside_thread", _work_beside, "fastlazy-beside", _finish_beside)


def _work_beside():
    _lower_priority()
    _hold_this_thread(LENT_SLEEP_US, throttle_without_runs=False)
    while True:
        future, fn, args, threads = _beside_queue.get()
        if fn is _stop:
            return
        if _closing:
            future.cancel()
            continue
        # the job runs on as many intra-op threads as the user's thread had
        # when it queued the job (a thread's count is its own, set from
        # torch's at the thread's first parallel op only)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if future.set_running_or_notify_cancel():
            _run(future, fn, args)
        # (the job's arguments, a model's parameters among them, are not
        # kept alive until the next job)
        del future, fn, args


def _finish_beside():
    """At exit: drop the jobs still queued and wait for the one under way
    (milliseconds; one inside oneDNN while the interpreter tears C++
    state down could abort the process)."""
    global _closing
    _closing = True
    thread = _beside_thread
    if thread is not None and thread.is_alive():
        _beside_queue.put((None, _stop, (), 0))
        _set_limits(False)
        thread.join()


def idle(timeout: float | None = None) -> bool:
    """Wait until every submitted compile, and every job run beside, has
    finished (tiering.wait: tests and benchmarks); False if `timeout`
    passed first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    done = submit(lambda: None)
    # the caller blocks meanwhile: nothing to leave the core and GIL for
    with unthrottled():
        try:
            done.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        # a finished job leaves _beside in its done-callback, which runs
        # after the waiters are woken: judge by the futures' state, not by
        # the set's emptiness; and a job may queue another beside it
        while True:
            pending = [f for f in list(_beside) if not f.done()]
            if not pending:
                return True
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if concurrent.futures.wait(pending, left).not_done:
                return False


_waiting = 0                    # threads inside unthrottled()
_waiting_lock = threading.Lock()


@contextlib.contextmanager
def unthrottled():
    """The compile thread runs at full speed while a thread waits for it
    inside this block: for the compiles to finish, or for a lock the
    compile thread holds (fx_threads' trace lock), which it would otherwise
    hold through its sleeps."""
    global _waiting
    with _waiting_lock:
        _waiting += 1
        _set_limits(False)
    try:
        yield
    finally:
        with _waiting_lock:
            _waiting -= 1
            if not _waiting and not _closing:
                _set_limits(True)


def closing() -> bool:
    """The program is exiting: a job made of several compiles stops
    after the one under way."""
    return _closing


def at_close(fn) -> None:
    """Have fn() run first when the program exits, before the compile under
    way is waited for: fn ends work the compile thread waits on outside
    this process (a compile in the compile process, which may take
    minutes), so that the program does not wait for it."""
    _at_close.append(fn)


def on_compile_thread() -> bool:
    return threading.current_thread() is _thread


def _ensure_thread():
    _start_once("_thread", _work, "fastlazy-compile", _finish)


def _start_once(variable, work, name, finish):
    """Start the daemon thread this module keeps in the global `variable`,
    running work(), if it is not running; finish() runs at exit, from
    threading's exit hook, which runs before atexit handlers: the compile
    ends before inductor's own exit handlers shut its worker pools down."""
    if globals()[variable] is not None:
        return
    with _start_lock:
        if globals()[variable] is None:
            getattr(threading, "_register_atexit", atexit.register)(finish)
            thread = globals()[variable] = threading.Thread(target=work, name=name, daemon=True)
            thread.start()


def _set_limits(on):
    """The background threads' limits (_hold_this_thread) on, or off (a
    thread waits for their work, or the program exits)."""
    _core.set_throttle(RUN_US if on else 0, SLEEP_US)
    module = step_executor.extension()
    if module is not None:
        module.set_gil_lending(on)


def _hold_this_thread(sleep_us, throttle_without_runs):
    """This thread takes the GIL while the user's graph runs let go of it,
    lets go of it the moment a run ends, and otherwise runs RUN_US of every
    RUN_US + sleep_us (csrc/gil_lending.h), unless a thread waits for the
    background work (unthrottled).  Without the step executor's extension,
    which counts the runs, no run lends the GIL: the thread is throttled
    to RUN_US of every RUN_US + SLEEP_US (csrc/throttle.pxi) where
    `throttle_without_runs`, else runs as it is."""
    with _waiting_lock:
        if not _waiting and not _closing:
            _set_limits(True)
    module = step_executor.extension()
    if module is not None:
        module.borrow_gil_on_this_thread(RUN_US, sleep_us)
    elif throttle_without_runs:
        _core.throttle_this_thread()


def _lower_priority():
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + NICENESS)
    except (AttributeError, OSError):     # not Linux, or not permitted: run as is
        pass


def _work():
    _lower_priority()
    # The GIL has no priorities: a compiler's Python would take half of the
    # user's thread's time, in stalls of up to the switch interval (5 ms).
    # So the compile thread borrows the GIL the user's graph runs lend it,
    # and otherwise runs RUN_US, then sleeps SLEEP_US without it.
    _hold_this_thread(SLEEP_US, throttle_without_runs=True)
    while True:
        future, fn, args = _queue.get()
        if fn is _stop:
            return
        if _closing or not future.set_running_or_notify_cancel():
            continue
        _run(future, fn, args)


def _run(future, fn, args):
    """fn(*args) on this thread, its result or exception in `future`
    (running), what torch logs meanwhile kept from the user's stderr."""
    compile_log.quiet_this_thread()
    try:
        future.set_result(fn(*args))
    except BaseException as exc:      # noqa: BLE001 - reported through the Future
        future.set_exception(exc)


def _finish():
    """At exit: drop the compiles still queued and wait for the one under
    way (a thread still inside the compiler while the interpreter tears
    down C++ state can abort the process)."""
    global _closing
    _closing = True
    for fn in _at_close:
        try:
            fn()
        except Exception:       # noqa: BLE001 - the exit goes on
            pass
    thread = _thread
    if thread is not None and thread.is_alive():
        _queue.put((concurrent.futures.Future(), _stop, ()))
        _set_limits(False)              # nothing else runs now
        thread.join()


def _stop():
    """The sentinel that ends the worker."""

