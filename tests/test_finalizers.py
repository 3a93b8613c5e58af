"""Finalizers, weakref callbacks and signal handlers run Python at any
allocation or reference drop -- in the middle of recording a node, or of a
flush -- and may read, record or drop LazyTensors of the very segment being
worked on.  They get the value (a read during the flush of its own segment
is computed apart), never a hang or a half-made node.  Each program runs in
a subprocess with a timeout: a hang or a crash fails the test, not the
suite."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent("""
    import gc, signal, sys, weakref, torch, fastlazy
    fastlazy.enable(backend=sys.argv[1])
    seen, want = [], []

    class Reader:
        # a garbage cycle whose __del__ reads (and records from) a LazyTensor
        def __init__(self, t, expected):
            self.t, self.expected, self.me = t, expected, self
        def __del__(self):
            try:
                seen.append(float((self.t * 1).sum()))
            except Exception as exc:
                seen.append(repr(exc))
            want.append(self.expected)
""")

PROGRAMS = {
    # the program: a __del__ run by the collector during the flush
    # of the segment holding its tensor (it once hung, or got AttributeError)
    "del_during_flush": """
        gc.set_threshold(1)
        for i in range(40):
            x = fastlazy.lazy(torch.ones(4))
            y = x + i
            Reader(y, 4.0 * (i + 1))
            z = y * 2
            del y
            assert z.to_eager()[0].item() == 2.0 * (i + 1)
    """,
    # collections at every allocation, while recording long chains with
    # threshold flushes: the reads land inside record() and flush()
    "gc_everywhere": """
        gc.set_threshold(1)
        fastlazy.set_flush_threshold(5)
        for i in range(30):
            x = fastlazy.lazy(torch.zeros(3))
            for j in range(12):
                x = x + 1
                if j % 3 == 0:
                    Reader(x, 3.0 * (j + 1))
            assert torch.equal(x.to_eager(), torch.full((3,), 12.0))
    """,
    # Python run while fastlazy holds one of its own locks (a trace
    # function stands in for a finalizer there): the read flushes, which
    # takes that lock again on the same thread.  Each read computes a new
    # graph (a chain one op longer each time): its compile path takes
    # fastlazy's locks, where a cache hit runs in C and takes none.
    "inside_locks": """
        box = {}
        def tracer(frame, event, arg):
            lock = frame.f_globals.get("_lock") if frame.f_globals.get(
                "__name__", "").startswith("fastlazy.") else None
            if event == "line" and lock is not None and "t" in box and (
                    lock._is_owned() if hasattr(lock, "_is_owned") else lock.locked()):
                t, expected = box.pop("t")
                seen.append(float((t * 1).sum()))
                want.append(expected)
            return tracer
        sys.settrace(tracer)
        try:
            for i in range(20):
                box["t"] = (fastlazy.lazy(torch.ones(4)) + i, 4.0 * (i + 1))
                y = fastlazy.lazy(torch.ones(2))
                for _ in range(i + 1):
                    y = y * 2
                y.to_eager()
        finally:
            sys.settrace(None)
        assert len(seen) == 20, seen
    """,
    # a weakref callback that reads a pending tensor, run when the eager
    # input a discarded node held is let go (Segment.kill)
    "weakref_callback": """
        for i in range(40):
            x = fastlazy.lazy(torch.ones(2)) * (i + 1)
            e = torch.ones(2)
            weakref.finalize(e, lambda x=x, i=i: (seen.append(float(x.sum())),
                                                   want.append(2.0 * (i + 1))))
            x + e            # recorded and discarded: the node dies, e is let go
            del e
            y = x - 1
            assert torch.equal(y.to_eager(), torch.full((2,), float(i)))
    """,
    # a signal handler that reads and records, fired while the main thread
    # records and flushes
    "signal_handler": """
        box = [fastlazy.lazy(torch.ones(2)) * 3]
        def handler(signum, frame):
            seen.append(float((box[0] + 0).sum()))
            want.append(6.0)
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
        try:
            for i in range(300):
                x = fastlazy.lazy(torch.zeros(2))
                for j in range(10):
                    x = x + 1
                assert torch.equal(x.to_eager(), torch.full((2,), 10.0))
                box[0] = fastlazy.lazy(torch.ones(2)) * 3
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
    """,
    # the collector frees a garbage cycle holding pending tensors while a
    # flush that fails runs (an eager write to an input ran it), one of them
    # read by a __del__ in the middle of the flush; the write's recovery
    # then computes the segment's other tensors one by one (it once read
    # the freed tensors: a crash)
    "drop_during_failed_flush": """
        class Box:
            def __init__(self, t):
                self.t, self.me = t, self
        gc.set_threshold(1)
        for i in range(40):
            base = torch.arange(8.0)
            x = fastlazy.lazy(base)
            Box(x * 3)
            Reader(x + i, 28.0 + 8 * i)
            bad = x.index_select(0, torch.tensor([100]))
            keep = x * 2
            base.add_(1)
            assert torch.equal(keep.to_eager(), torch.arange(8.0) * 2)
            try:
                bad.to_eager()
            except IndexError:
                pass
            else:
                raise AssertionError("an index out of range gave a value")
    """,
    # a weakref callback on a pending tensor runs in its deallocation,
    # before it lets its node go, and computes the segment (a read of a
    # sibling, mark_step, an eager write that runs a failing graph): the
    # dying tensor was taken for a live one and freed twice (a crash)
    "weakref_on_a_dying_tensor": """
        for i in range(20):
            base = torch.arange(4.0)
            x = fastlazy.lazy(base)
            y, z = x * 2, x + i
            bad = x.index_select(0, torch.tensor([100]))
            if i % 3 == 0:
                weakref.finalize(y, lambda z=z, i=i: (seen.append(z.tolist()),
                                                      want.append([float(i + k) for k in range(4)])))
            elif i % 3 == 1:
                weakref.ref(y, lambda w: fastlazy.mark_step())
            else:
                weakref.finalize(y, lambda base=base: base.add_(1))
            del y
            assert z.tolist() == [float(i + k) for k in range(4)]
    """,
    # a callback run by a flush writes the tensor being read in place: the
    # read gives the written value (it gave None)
    "rebound_during_its_own_flush": """
        for i in range(20):
            x = fastlazy.lazy(torch.arange(4.0))
            e = torch.ones(4)
            t = x * e + i                   # the segment holds e until it runs
            weakref.finalize(e, lambda t=t: t.add_(1))
            del e
            assert t.tolist() == [float(i + 1 + k) for k in range(4)], t.tolist()
    """,
    # a signal handler raises in the middle of the first analysis of a
    # signature (a timeout): the call raises the handler's exception, as
    # eager's does, and the signature is analysed anew next time (the
    # exception was kept as its verdict, and every later write through a
    # view of that geometry raised fastlazy's internal Unsafe)
    "handler_raises_during_an_analysis": """
        class Alarm(Exception):
            pass
        armed = [True]
        def tracer(frame, event, arg):
            if armed[0] and event == "call" and frame.f_code.co_name == "_scatter_into":
                armed[0] = False
                signal.raise_signal(signal.SIGALRM)
        def handler(signum, frame):
            raise Alarm()
        signal.signal(signal.SIGALRM, handler)
        y = fastlazy.lazy(torch.arange(6.0)) * 3
        sys.settrace(tracer)
        try:
            y[1:].mul_(2)
            raise AssertionError("the handler's exception was lost")
        except Alarm:
            pass
        finally:
            sys.settrace(None)
        for i in range(3):
            z = fastlazy.lazy(torch.arange(6.0)) * 3
            z[1:].mul_(2)
            assert z.tolist() == [0.0, 6.0, 12.0, 18.0, 24.0, 30.0], z.tolist()
    """,
}

EPILOGUE = textwrap.dedent("""
    gc.collect()
    assert seen == want, (seen[:5], want[:5])
    print("ok", len(seen))
""")


@pytest.mark.parametrize("backend", ["native", "torchscript", "eager"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_python_run_inside_the_core_gets_values(name, backend):
    program = PRELUDE + textwrap.dedent(PROGRAMS[name]) + EPILOGUE
    done = subprocess.run([sys.executable, "-c", program, backend], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.startswith("ok")
