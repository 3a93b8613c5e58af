"""fastlazy: lazy tensors for PyTorch that cost almost nothing to record.

    import torch, fastlazy
    fastlazy.enable()                  # patch torch's entry points
    a = torch.rand(100, 100).to("lazy")
    r = (a + 1) * a                    # recorded, ~100 ns per op
    print(r)                           # one compiled graph runs, result kept
    fastlazy.mark_step()               # compute every live LazyTensor now

Modules stay eager (model.to("lazy") returns it): parameters join as inputs.

The torch._lazy functions have the same names here: mark_step,
wait_device_ops, sync_multi, to_cpu, add_step_closure, metrics.counter_names,
metrics.counter_value, metrics.metrics_report, debug.dump_ir,
debug.render_ir_graph.  fastlazy.metrics holds the counters and report(),
fastlazy.debug the graph dumps; the other modules are the implementation.
"""
# Functions, not modules, under private names: help() lists a package's
# module attributes as its submodules.
from fastlazy import debug, metrics, optable
from fastlazy._core import LazyTensor, lazy
from fastlazy._core import mark_step as _flush_all
from fastlazy._core import set_flush_threshold as _set_threshold
from fastlazy.boot import boot as _boot
from fastlazy.closures import (add_step_closure as _add_closure,
                               run_step_closures as _run_closures,
                               wait_async_closures as _wait_closures)
from fastlazy.compile_worker import start_beside as _start_beside
from fastlazy.graph_cache import backend_name as _backend_name
from fastlazy.graph_cache import backend_names as _backend_names
from fastlazy.graph_cache import set_backend as _set_backend
from fastlazy.patching import disable as _unpatch
from fastlazy.patching import enable as _patch
from fastlazy.patching import enabled as _patched

_boot()

# LazyTensor is public (type(x) is fastlazy.LazyTensor) but left out of
# __all__, which help() follows: its hundreds of Tensor methods would bury
# the functions below.
__all__ = ["enable", "disable", "enabled", "lazy", "mark_step", "wait_device_ops",
           "sync_multi", "to_cpu", "add_step_closure", "explain", "set_flush_threshold",
           "set_backend", "backend", "metrics", "debug"]

# the names enable(backend=...) and set_backend() take
BACKENDS = _backend_names()


def enable(backend: str | None = None) -> "Enabled":
    """Patch torch's entry points so that calls with a LazyTensor record.

    Idempotent; fastlazy.disable() undoes it exactly.  `backend` picks the
    backend of graphs compiled from now on (default: $FASTLAZY_BACKEND or
    "auto"):

    - "auto": the tiered engine -- each graph runs at once on torchscript
      (or native), and one that keeps recurring is compiled by inductor on
      a background thread and kept if it runs faster (no call ever waits);
    - "torchscript": TorchScript's graph executor (NNC fuses on CUDA);
    - "native": fastlazy's own step executor, with a kernel for batch-1
      float32 linear layers;
    - "inductor": torch inductor (fused C++ on CPU, Triton on CUDA);
    - "eager": a node-by-node replay (the reference, for debugging).

    Also a context manager: ``with fastlazy.enable(): ...`` disables again
    at the end of the block if it was not enabled before.
    """
    if backend is not None:
        _set_backend(backend)
    was_enabled = _patched()
    _patch()
    # the thread for jobs beside the user's starts here, not at the first
    # job: a thread's start delayed the graph call that queued it
    _start_beside()
    return Enabled(True, was_enabled)


class Enabled:
    """fastlazy's on/off state, as enable() and enabled() return it.

    True or false as the state was when it was made (``if
    fastlazy.enabled():``).  Also a context manager: fastlazy is enabled
    inside the block and afterwards as it was before (``with
    fastlazy.enabled():`` and ``with fastlazy.enable():`` mean the same).
    """
    __slots__ = ("_state", "_was")

    def __init__(self, state: bool, was: bool | None = None):
        self._state = state
        self._was = was          # before enable(); None: taken at __enter__

    def __bool__(self):
        return self._state

    def __eq__(self, other):
        return bool(self) == other if isinstance(other, (bool, int, Enabled)) else NotImplemented

    def __hash__(self):
        return hash(self._state)

    def __repr__(self):
        if self._was is None:
            return repr(self._state)
        return (f"<fastlazy enabled, backend {backend()!r}: fastlazy.disable() undoes it, "
                f"or use `with fastlazy.enable():`>")

    def __enter__(self):
        if self._was is None:
            self._was = _patched()
            _patch()
        return self

    def __exit__(self, *exc):
        if not self._was:
            disable()
        return False


def disable() -> None:
    """Put every patched torch attribute back (the identical objects)."""
    _unpatch()


def enabled() -> Enabled:
    """Whether torch's entry points are patched (``if fastlazy.enabled():``);
    ``with fastlazy.enabled():`` enables fastlazy for a block."""
    return Enabled(_patched())


def mark_step(device: str = "", wait: bool = False) -> None:
    """Compute every live LazyTensor this thread recorded now (one graph),
    then run the step closures.  As torch._lazy.mark_step; `device` is
    accepted for compatibility and ignored (fastlazy has one buffer per
    thread for all devices);
    `wait=True` also waits for queued CUDA work and asynchronous closures."""
    _flush_all()
    _run_closures()
    if wait:
        wait_device_ops()


def wait_device_ops(devices=None) -> None:
    """Wait for outstanding device work (CUDA) and asynchronous step closures."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _wait_closures()


def sync_multi(tensors, devices=None) -> None:
    """Compute the given LazyTensors (and every other live one: fastlazy
    flushes whole segments, so a later read of those is free)."""
    for t in tensors:
        if type(t) is LazyTensor:
            t.to_eager()


def to_cpu(tensors, devices=None):
    """A pytree with every LazyTensor replaced by its value on the CPU."""
    from torch.utils._pytree import tree_flatten, tree_unflatten
    flat, spec = tree_flatten(tensors)
    sync_multi(flat)
    return tree_unflatten([t.to_eager().cpu() if type(t) is LazyTensor else t for t in flat],
                          spec)


def add_step_closure(closure, args=(), run_async: bool = False) -> None:
    """Run `closure(*args)` after the next mark_step(), when every live
    tensor is computed (see fastlazy.closures)."""
    _add_closure(closure, args, run_async)


def explain() -> str:
    """Which calls ran eagerly instead of being recorded, and why."""
    return metrics.explain()


def set_flush_threshold(nodes: int) -> None:
    """Flush automatically once this many nodes are pending (default 10000)."""
    _set_threshold(nodes)


def set_backend(name: str) -> None:
    """Choose the backend for graphs compiled from now on."""
    _set_backend(name)


def backend() -> str:
    """The active backend's name (one of BACKENDS)."""
    return _backend_name()

