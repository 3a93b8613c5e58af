"""Thread stress programs, run by tests/test_threads.py in a subprocess with a
timeout (a hang or a crash fails the test, not the suite):

    python tests/thread_stress.py BACKEND ROUNDS SCENARIO...

Each scenario checks every value against eager and prints its name once it
passed.  The switch interval is made tiny, so threads interleave between
almost any two bytecodes: a race that once needed many runs to show shows in
a few rounds here.  Each scenario runs at three switch intervals.
"""
import queue
import sys
import threading

import torch

import fastlazy
from fastlazy import _core

ERRORS = []


def check(got, want, what):
    if not isinstance(got, torch.Tensor) or not torch.equal(got, want):
        ERRORS.append(f"{what}: got {got!r}, want {want!r}")


def run_threads(target, args_list):
    threads = [threading.Thread(target=guard(target), args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def guard(fn):
    def run(*args):
        try:
            fn(*args)
        except BaseException as exc:    # noqa: BLE001 -- every failure is reported
            ERRORS.append(f"{fn.__name__}{args[-1:]}: {type(exc).__name__}: {exc}")
    return run


def own_tensors(rounds):
    """The issue's program: each thread records and reads only its own."""
    def work(k):
        for _ in range(rounds):
            x = fastlazy.lazy(torch.full((256,), float(k)))
            for _ in range(8):
                x = x + fastlazy.lazy(torch.ones(256))
            check(x.to_eager(), torch.full((256,), k + 8.0), f"own[{k}]")
    run_threads(work, [(k,) for k in range(8)])


def in_place_and_threshold(rounds):
    """In-place rebinding and threshold flushes, per thread."""
    def work(k):
        for _ in range(rounds):
            x = fastlazy.lazy(torch.zeros(5)) + k
            y = x * 1
            for _ in range(9):
                x.add_(1)
                y = torch.add(y, x)
            check(y.to_eager(), torch.full((5,), 10.0 * k + 45.0), f"in-place[{k}]")
    before = _core.get_flush_threshold()
    _core.set_flush_threshold(7)
    try:
        run_threads(work, [(k,) for k in range(4)])
    finally:
        _core.set_flush_threshold(before)


def shared_pending(rounds):
    """Eight threads read (and record from) tensors another thread left
    pending; the main thread then reads them too."""
    def work(xs, k):
        for _ in range(3):
            for i, x in enumerate(xs):
                check((x * 2 + k).to_eager(), torch.full((4,), 2.0 * i + k), f"shared[{k}]")
    for _ in range(rounds // 4 + 1):
        xs = [fastlazy.lazy(torch.zeros(4)) + i for i in range(16)]
        run_threads(work, [(xs, k) for k in range(8)])
        for i, x in enumerate(xs):
            check(x.to_eager(), torch.full((4,), float(i)), "shared[main]")


def handed_over(rounds):
    """A producer keeps recording while a consumer reads what it handed over
    (the consumer flushes the producer's segment under its feet)."""
    box = queue.Queue()

    def produce(_):
        x = fastlazy.lazy(torch.zeros(3))
        for i in range(rounds * 4):
            x = x + 1
            box.put((i + 1, x * 1))
        box.put(None)

    def consume(_):
        while (item := box.get()) is not None:
            n, t = item
            check(t.to_eager(), torch.full((3,), float(n)), "handed")
    run_threads(lambda arg: (produce if arg == 0 else consume)(arg), [(0,), (1,)])


def per_thread_segments(rounds):
    """pending_nodes() and mark_step() are the calling thread's."""
    ready, done = threading.Barrier(2), threading.Barrier(2)

    def work(k):
        for _ in range(rounds):
            x = fastlazy.lazy(torch.ones(2))
            kept = [x + i for i in range(k + 1)]
            ready.wait()
            if _core.pending_nodes() != k + 1:
                ERRORS.append(f"thread {k} sees {_core.pending_nodes()} pending nodes")
            done.wait()
            fastlazy.mark_step()
            if _core.pending_nodes() != 0 or not all(t.is_materialized for t in kept):
                ERRORS.append(f"mark_step on thread {k} left its nodes pending")
    run_threads(work, [(0,), (1,)])


def toggling(rounds):
    """One thread toggles enable()/disable() while four record."""
    stop = threading.Event()

    def toggle(_):
        while not stop.is_set():
            fastlazy.disable()
            fastlazy.enable()

    def work(k):
        for _ in range(rounds):
            x = fastlazy.lazy(torch.full((8,), float(k)))
            y = (x + 1) * 2 - x
            check(y.to_eager(), torch.full((8,), k + 2.0), f"toggle[{k}]")
    toggler = threading.Thread(target=guard(toggle), args=(None,))
    toggler.start()
    try:
        run_threads(work, [(k,) for k in range(4)])
    finally:
        stop.set()
        toggler.join()
        fastlazy.enable()


# From switching between almost any two bytecodes to Python's default: the
# races of different windows show at different intervals.
SWITCH_INTERVALS = (1e-6, 1e-4, 5e-3)

SCENARIOS = {f.__name__: f for f in (own_tensors, in_place_and_threshold, shared_pending,
                                      handed_over, per_thread_segments, toggling)}


def main():
    backend, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    fastlazy.enable(backend=backend)
    for name in names:
        for interval in SWITCH_INTERVALS:
            sys.setswitchinterval(interval)
            SCENARIOS[name](rounds)
        if ERRORS:
            print("\n".join(ERRORS[:10]), file=sys.stderr)
            sys.exit(f"{name}: {len(ERRORS)} errors")
        print(name, flush=True)


if __name__ == "__main__":
    main()
