"""Step closures, as in torch._lazy: functions run after the next
mark_step(), when every live tensor (their arguments included) is computed.

Synchronous closures run in order on the thread calling mark_step().
Asynchronous ones run in order on one worker thread fed by a bounded queue
(FASTLAZY_MAX_ASYNC_QUEUE, default 100: a full queue blocks mark_step, which
keeps a slow closure from piling up work); an exception in one is re-raised
by the next mark_step.
"""
from __future__ import annotations

import os
import queue
import threading

# Re-entrant: a finalizer run by an allocation inside the lock may call
# back into fastlazy (read a LazyTensor: a flush) on this very thread.
_lock = threading.RLock()
_sync: list = []
_async: list = []
_worker = None


class _AsyncRunner:
    def __init__(self):
        self.queue: queue.Queue = queue.Queue(int(os.environ.get("FASTLAZY_MAX_ASYNC_QUEUE", "100")))
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="fastlazy-step-closures",
                                       daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            closure = self.queue.get()
            try:
                if self.error is None:
                    closure()
            except BaseException as exc:   # reported by the next mark_step
                self.error = exc
            finally:
                self.queue.task_done()

    def submit(self, closures):
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError("an asynchronous step closure raised") from error
        for closure in closures:
            self.queue.put(closure, block=True)


def add_step_closure(closure, args=(), run_async=False) -> None:
    """Run `closure(*args)` after the next mark_step()."""
    with _lock:
        (_async if run_async else _sync).append((closure, tuple(args)))


def run_step_closures() -> None:
    global _worker
    with _lock:
        sync, async_ = _sync[:], _async[:]
        _sync.clear()
        _async.clear()
    if async_:
        if _worker is None:
            _worker = _AsyncRunner()
        _worker.submit([_bind(f, a) for f, a in async_])
    for closure, args in sync:
        closure(*args)


def wait_async_closures() -> None:
    """Block until every queued asynchronous closure has run."""
    if _worker is not None:
        _worker.queue.join()
        if _worker.error is not None:
            error, _worker.error = _worker.error, None
            raise RuntimeError("an asynchronous step closure raised") from error


def _bind(closure, args):
    def run():
        closure(*args)
    return run
