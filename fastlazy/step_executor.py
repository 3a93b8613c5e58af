"""The step executor, where it can run: the C++ extension fastlazy._executor
(csrc/step_executor.h) built for the torch imported.

It runs the TorchScript backend's graphs (the IR that backend emits) that no
fuser acts on: one step per node over a register file, in place of
TorchScript's interpreter, and ATen's CPU kernel called directly (no
dispatcher) for the ops of its direct table where a run's inputs allow (see
the header).  The interpreter stays for graphs that fuse (NNC on CUDA, or
on CPU where fusion is switched on) and where the executor is not built:
`why_not()` says why.

FASTLAZY_EXECUTOR=0 in the environment, or `set_enabled(False)`, runs every
graph compiled afterwards on the interpreter (for comparison and debugging).
"""
from __future__ import annotations

import importlib
import os

import torch


def _load():
    """(the extension module, None), or (None, why it is not there)."""
    try:
        module = importlib.import_module("fastlazy._executor")
    except ImportError as exc:
        return None, ("not built: torch was not importable when fastlazy was built "
                      "(pip's isolated build; `pip install --no-build-isolation` into an "
                      "environment with torch builds it), or its compile failed (see the "
                      f"build's output) ({exc})")
    # checked before any use: a module compiled against another torch's
    # C++ API may load and then misread that torch's objects
    if module.TORCH_VERSION != torch.__version__:
        return None, (f"built for torch {module.TORCH_VERSION}, not the torch "
                      f"{torch.__version__} imported: rebuild fastlazy")
    return module, None


_module, _why_not = _load()
_enabled = _module is not None and os.environ.get("FASTLAZY_EXECUTOR", "1") != "0"


def available() -> bool:
    """Was the executor built, for this torch?"""
    return _module is not None


def extension():
    """The extension module (fastlazy._executor) built for this torch, or
    None; it also holds the packed convolution op and the CPU pool, which
    serve whether or not graphs run on the executor."""
    return _module


def enabled() -> bool:
    """Will graphs compiled from now on run on the executor?"""
    return _enabled


def set_enabled(on: bool) -> None:
    """Run graphs compiled from now on on the executor (if available) or on
    TorchScript's interpreter.  Graphs compiled already keep theirs."""
    global _enabled
    if on and _module is None:
        raise RuntimeError(f"fastlazy's step executor is {_why_not}")
    _enabled = bool(on)


def tensor_reader():
    """The extension's reader of eager tensors' metadata, in a capsule for
    the core (csrc/tensor_facts.h), or None where it is not built for this
    torch.  It serves whether or not graphs run on the executor."""
    return None if _module is None else _module.tensor_reader()


_packed_conv = None


def packed_conv_op():
    """The op fastlazy::packed_conv2d (csrc/packed_conv.h: a convolution
    with its weight packed for oneDNN, fastlazy.packed_convs), defined at
    the first call; None where the executor is not in use."""
    global _packed_conv
    if _packed_conv is None and _enabled:
        _module.register_packed_conv()
        _packed_conv = torch.ops.fastlazy.packed_conv2d.default
    return _packed_conv if _enabled else None


def conv_times_op():
    """The op fastlazy::conv_times (csrc/packed_conv.h: ATen's and the
    packed convolution timed in C++), defined with packed_conv_op's."""
    return None if packed_conv_op() is None else torch.ops.fastlazy.conv_times.default


def why_not() -> str | None:
    """Why graphs run on the interpreter (None where the executor is on)."""
    if _module is None:
        return _why_not
    return None if _enabled else "switched off (FASTLAZY_EXECUTOR=0 or set_enabled(False))"


# Tests switch this on (tests/conftest.py): every graph compiled is then
# also read by torch's parseIR, and where the executor's own reader
# (csrc/ir_reader.h) built another graph, the two printed graphs are kept
# in reader_mismatches for the test to fail on.
check_reader = False
reader_mismatches: list = []


def compile(ir: str):
    """A StepProgram for the graph in TorchScript IR `ir`.  RuntimeError if
    a node has no operator to run it (the caller keeps the interpreter)."""
    if check_reader:
        mine, theirs = _module.read_both(ir)
        if mine is not None and mine != theirs:
            reader_mismatches.append((ir, mine, theirs))
    return _module.StepProgram(ir)
