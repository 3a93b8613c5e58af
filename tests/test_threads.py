"""Threads: each records into its own segment; reading a tensor another
thread left pending computes it (or waits for the thread computing it);
inductor compiles one graph at a time.  The stress programs
(tests/thread_stress.py) run in a subprocess with a timeout, with a tiny
switch interval so that threads interleave between almost any two
bytecodes; each scenario runs many rounds."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastlazy
from fastlazy import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRESS = os.path.join(ROOT, "tests", "thread_stress.py")
ALL = ["own_tensors", "in_place_and_threshold", "shared_pending", "handed_over",
       "per_thread_segments", "toggling"]


def stress(backend, rounds, scenarios, timeout=300):
    done = subprocess.run([sys.executable, STRESS, backend, str(rounds), *scenarios],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, (f"exit {done.returncode} after {done.stdout.split()}\n"
                                  f"{done.stderr[-3000:]}")
    assert done.stdout.split() == scenarios


@pytest.mark.parametrize("backend", ["native", "eager", "torchscript"])
def test_thread_stress(backend):
    stress(backend, 100, ALL)


def test_thread_stress_inductor():
    # one graph structure per scenario: the compiles are few, and serialized
    stress("inductor", 30, ["own_tensors", "shared_pending", "handed_over"], timeout=500)


def test_threads_share_the_graph_cache(lazy_on):
    """Per thread: the segment.  Shared: the graph cache, so a graph one
    thread compiled is a hit on another."""
    def work():
        x = fastlazy.lazy(torch.ones(3))
        out.append(((x * 3) + 1).to_eager())
    out = []
    work()
    misses = fastlazy.metrics.counters()["cache_misses"]
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert fastlazy.metrics.counters()["cache_misses"] == misses
    assert all(torch.equal(v, torch.full((3,), 4.0)) for v in out) and len(out) == 2


def test_a_thread_reads_a_tensor_another_left_pending(lazy_on):
    x = fastlazy.lazy(torch.arange(4.0)) * 2
    got = []
    t = threading.Thread(target=lambda: got.append((x + 1).to_eager()))
    t.start()
    t.join()
    assert torch.equal(got[0], torch.arange(4.0) * 2 + 1)
    assert x.is_materialized            # the other thread computed it
    assert _core.pending_nodes() == 0
    y = x * 5                           # this thread records on, in a fresh segment
    assert torch.equal(y.to_eager(), torch.arange(4.0) * 10)


def test_flush_sites_read_and_reset_while_another_thread_flushes():
    """The core counts each read's site without a lock: explain()'s table
    read and metrics.reset() on one thread while another thread reads
    values at new sites raise nothing and name only real sites."""
    stop, errors = threading.Event(), []

    def reads():
        x = fastlazy.lazy(torch.ones(3))
        try:
            while not stop.is_set():
                for k in range(20):         # a different code offset each time
                    exec(f"float((x * {k}).sum())", {"x": x})
        except Exception as exc:            # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)         # the threads switch as often as they can
    other = threading.Thread(target=reads)
    other.start()
    try:
        deadline = time.perf_counter() + 1.0
        while time.perf_counter() < deadline:
            fastlazy.metrics.flushes_by_site()
            fastlazy.metrics.reset()
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    assert not errors, errors
    sites = fastlazy.metrics.flushes_by_site()
    assert all(name != "<unknown>" for _, name in sites), sites
