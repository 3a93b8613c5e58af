"""Inductor compiles in a separate process, so that no compiler's Python
shares the user's GIL.

A background compile on a thread of the user's process competes for the GIL
with the user's thread: W4's BERT ran its calls at 1.30-1.39 ms while its
graph compiled beside it, against 0.90 ms with no compile (cold process, 2
cores, the thread throttled by compile_worker).  Here the compile thread
only sends the graph's view (fastlazy.graph.GraphView: the nodes' aten
programs; the child builds the FX graph from it, so the user's process
spends no GIL time building one) and its inputs' metadata to one
long-lived child process and waits for the answer without the GIL; the
child compiles with inductor's standalone_compile and saves the artifact (its kernels land in
inductor's cache directory, shared with the parent), and the parent loads
it (a few milliseconds once the child has compiled it).

The child inherits the environment and receives the parent's inductor
config with every job, so patches the caller made (cpp_wrapper) apply
there.  Anything that stops a job from making it through the child (no
child, a graph it cannot pickle or save, a crash) raises `Unavailable`, and
the caller compiles on its own thread as before.  CPU graphs only (a CUDA
compile would need the child to hold a second CUDA context), and not those
compiled with their parameters frozen: inductor cannot save a program whose
parameters it folded into constants.

`FASTLAZY_COMPILE_PROCESS=0` turns it off.

The child is `python -m fastlazy.compile_process`: a loop that reads a job
from stdin and writes the answer to stdout, each a length-prefixed pickle.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import traceback

import torch
import torch.fx

from fastlazy import metrics
from fastlazy.graph import describe_input, example_input

_HEADER = struct.Struct("<Q")


class Unavailable(Exception):
    """The job did not make it through the compile process."""


def enabled() -> bool:
    return os.environ.get("FASTLAZY_COMPILE_PROCESS", "1") != "0"


def takes(args) -> bool:
    """Whether a compile for `args` may go to the compile process."""
    return enabled() and all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


# -- the parent's side -------------------------------------------------------------

_lock = threading.Lock()
_child: subprocess.Popen | None = None
_broken = False             # the child could not start or died: no new one
_artifacts: str | None = None   # this process's folder for the child's artifacts
last_error = ""             # why the last job compiled on the caller's thread


def compile(view, args):
    """The inductor-compiled callable of the graph `view` (a GraphView,
    lowered to FX by fastlazy.inductor_graph) for inputs like `args`
    (static shapes), compiled in the compile process with the inductor
    config in force here.  Unavailable (its reason kept in `last_error`)
    where the job did not make it through."""
    global last_error
    try:
        compiled = _compile_in_child(view, args)
    except Unavailable as exc:
        last_error = str(exc)
        raise
    metrics.count_event("tier_compiles_in_child")
    return compiled


def _compile_in_child(view, args):
    from torch._inductor import CompiledArtifact, config

    job = {"view": _pickled_view(view), "inputs": [describe_input(a) for a in args],
           "config": config.save_config()}
    with _lock:
        job["folder"] = _artifact_folder()
        answer = _ask(job)
    if "error" in answer:
        raise Unavailable(answer["error"])
    path = answer["path"]
    try:
        return CompiledArtifact.load(path=path, format="binary")
    except Exception as exc:      # noqa: BLE001 - the caller compiles here instead
        raise Unavailable(f"loading the compiled artifact failed: {exc}") from exc
    finally:
        _remove(path)


class _View:
    """What the inductor backend reads of a GraphView to build its FX
    graph: the slots (a tensor's as its dtype and rank), the nodes (without
    the op that recorded them: an op-table row or a captured GraphModule,
    read for names only) and the outputs."""

    def __init__(self, view):
        from fastlazy.graph import Slot
        self.slots = [Slot(s.index, s.position, s.kind, _TensorLike(s.value.dtype, s.value.dim()))
                      if s.kind == "tensor" else s for s in view.slots]
        self.nodes = [dataclasses.replace(n, op=None) for n in view.nodes]
        self.outputs = list(view.outputs)
        self.device_types = view.device_types


class _TensorLike:
    __slots__ = ("dtype", "ndim")

    def __init__(self, dtype, ndim):
        self.dtype, self.ndim = dtype, ndim

    def __reduce__(self):
        return _TensorLike, (self.dtype, self.ndim)

    def dim(self):
        return self.ndim


def _pickled_view(view) -> bytes:
    from fastlazy.node_program import AtenCall     # (node_program imports the backends' world)
    data = io.BytesIO()
    pickler = _GraphPickler(data)
    pickler.aten_call = AtenCall
    try:
        pickler.dump(_View(view))
    except Exception as exc:      # noqa: BLE001 - a value that does not pickle
        raise Unavailable(f"the graph cannot be pickled: {exc}") from exc
    return data.getvalue()


def _aten_call(name, overload, args, kwargs, optional):
    from fastlazy.node_program import AtenCall
    return AtenCall(name, overload, args, kwargs, optional)


class _GraphPickler(pickle.Pickler):
    """Pickles aten operators by name (pybind objects do not pickle)."""

    aten_call = None        # fastlazy.node_program.AtenCall, for a view's nodes

    def reducer_override(self, obj):
        if type(obj) is self.aten_call:
            # (its `fn` is the operator's builtin, remade from the rest)
            return _aten_call, (obj.name, obj.overload, obj.args, obj.kwargs, obj.optional)
        if isinstance(obj, torch._ops.OpOverload):
            return _aten_overload, (obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _aten_packet, (namespace, name)
        return NotImplemented


def _aten_packet(namespace, name):
    return getattr(getattr(torch.ops, namespace), name)


def _aten_overload(namespace, name, overload):
    return getattr(_aten_packet(namespace, name), overload)


def _artifact_folder() -> str:
    """The folder the child saves artifacts in: one per process, removed
    by close(), so that an artifact whose answer never got read (the
    process exits while the child compiles) is not left behind."""
    global _artifacts
    if _artifacts is None or not os.path.isdir(_artifacts):
        _artifacts = tempfile.mkdtemp(prefix="fastlazy-compiles-")
    return _artifacts


def _ask(job):
    child = _ensure_child()
    try:
        _send(child.stdin, job)
        return _receive(child.stdout)
    except (OSError, EOFError, ValueError, pickle.PickleError, struct.error) as exc:
        # (ValueError: a pipe closed under the read by the exit's close)
        _discard_child()
        raise Unavailable(f"the compile process stopped: {exc}") from exc


def _ensure_child() -> subprocess.Popen:
    global _child, _broken
    if _child is not None and _child.poll() is None:
        return _child
    if _broken:
        raise Unavailable("the compile process stopped or could not start earlier: "
                          "compiles stay on the compile thread")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    try:
        # started from the compile thread, the child inherits its lowered
        # priority (Linux niceness is per thread), and so do the C++
        # compilers inductor starts
        _child = subprocess.Popen([sys.executable, "-m", "fastlazy.compile_process"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env)
    except OSError as exc:
        _broken = True
        raise Unavailable(f"the compile process could not be started: {exc}") from exc
    return _child


def _discard_child():
    global _child, _broken
    child, _child = _child, None
    _broken = True
    if child is not None:
        _stop(child, kill=False)


def _stop(child, kill):
    """End the child, at once (kill) or by closing its stdin (it ends at
    EOF; killed if it has not within a second), and close its pipes."""
    if kill and child.poll() is None:
        child.kill()
    try:
        if not kill:
            child.stdin.close()
        child.wait(timeout=1)
    except Exception:             # noqa: BLE001 - a child that will not end is killed
        child.kill()
    for stream in (child.stdin, child.stdout):
        try:
            stream.close()
        except OSError:
            pass


def forget_after_fork():
    """In a forked child: the parent's compile process and its pipes are
    the parent's (two writers would interleave their jobs); this process
    starts its own when it needs one."""
    global _child, _broken, _lock, _artifacts
    _child, _broken, _lock, _artifacts = None, False, threading.Lock(), None


def close():
    """At exit the child is killed, whatever it is compiling: nobody will
    run what it makes.  The boot has the compile thread's exit hook call
    this first (compile_worker.at_close), so the program does not wait for
    the compile the thread was waiting on, and atexit once more."""
    global _artifacts
    child = _child
    if child is not None:
        _stop(child, kill=True)
    folder, _artifacts = _artifacts, None
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _send(stream, obj):
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("no answer")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("a cut answer")
    return pickle.loads(data)


def _remove(path):
    try:
        os.remove(path)
    except OSError:
        pass


# -- the child's side --------------------------------------------------------------

def _compile_job(job):
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    config.load_config(job["config"])
    # as fastlazy.backends.inductor compiles: a training program's backward
    # may run twice (retain_graph), so its saved tensors are not donated
    functorch_config.donated_buffer = False
    from fastlazy.inductor_graph import build_fx
    gm = torch.fx.GraphModule(torch.nn.Module(), build_fx(pickle.loads(job["view"])))
    _mark_cacheable(gm)
    inputs = [example_input(described, zeroed=True) for described in job["inputs"]]
    artifact = torch._inductor.standalone_compile(
        gm, inputs, dynamic_shapes="from_example_inputs", aot=True)
    handle, path = tempfile.mkstemp(prefix="compiled-", suffix=".bin", dir=job["folder"])
    os.close(handle)
    artifact.save(path=path, format="binary")
    return {"path": path}


def _mark_cacheable(gm):
    """Declare fastlazy's FX targets in `gm` (aten wrappers and helpers)
    safe for inductor's caches, through which standalone_compile saves its
    program; each keyed by its module's source, so that a changed helper
    is a new key."""
    from torch._inductor import config
    marked = config.unsafe_marked_cacheable_functions
    for node in gm.graph.nodes:
        module = getattr(node.target, "__module__", None) or ""
        if node.op == "call_function" and module.startswith("fastlazy."):
            marked.setdefault(f"{module}.{node.target.__name__}", _source_key(module))


@functools.lru_cache(maxsize=None)
def _source_key(module: str) -> str:
    with open(sys.modules[module].__file__, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()[:16]


def _serve():
    # the protocol owns the real stdout; anything printed goes to stderr
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    jobs = sys.stdin.buffer
    torch.set_num_threads(1)
    while True:
        try:
            job = _receive(jobs)
        except EOFError:
            return
        try:
            answer = _compile_job(job)
        except Exception as exc:      # noqa: BLE001 - reported to the parent
            answer = {"error": f"{type(exc).__name__}: {exc}"[:1000] + "\n" +
                      traceback.format_exc()[-2000:]}
        _send(answers, answer)


if __name__ == "__main__":
    # the package's module, not this __main__ copy: the jobs' pickles name
    # its classes
    from fastlazy import compile_process
    compile_process._serve()
