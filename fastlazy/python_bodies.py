"""torch's Python functions called with LazyTensors: their bodies are
recorded op by op, as eager runs them.

A function of torch.nn.functional written in Python (multi_head_attention_
forward, the one nn.MultiheadAttention calls) first asks
`has_torch_function(...)` of its tensor arguments, and a LazyTensor makes
the answer yes: the call goes to LazyTensor.__torch_function__ whole.
Analysed whole (make_fx), such a function costs milliseconds of analysis
for every new input shape and bakes the shape into its program: a new graph
for every batch size.  Its body, though, is calls that the core records --
C rules and the generic path's signatures -- so the core runs the body
itself: the function is called again with its own check answered "no" once,
for this call, on this thread.  Every call inside the body then goes where
a user's call would (an entry point, or __torch_function__): nothing in it
sees a LazyTensor that cannot take one.

The check is answered by the gate that replaces the module's
`has_torch_function*` names while fastlazy is enabled; it answers "no" only
to the first check after run_body set this thread's flag, and a function
is run this way only if its code makes that check before any other call
(read from its bytecode once), so the answer cannot reach another check.
Other functions (another module's, or one that calls something first) are
recorded whole, as before -- and so is a call asked to write its input
(`inplace=True`): the body's in-place call (`torch.selu_`) is one the
generic path cannot functionalize alone, and the whole call it can.
"""
from __future__ import annotations

import dis
import threading
import types

import torch

from fastlazy import _core

# the modules whose functions' checks are gated, and the names of the
# checks (torch.overrides' three forms, imported into each module)
_MODULES = (torch.nn.functional,)
CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
# instructions that may stand between the check's name and its call: the
# loads of its arguments (locals, constants, a tuple of them)
_ARGUMENT_LOADS = frozenset({"LOAD_FAST", "LOAD_CONST", "LOAD_DEREF", "BUILD_TUPLE",
                             "PRECALL", "PUSH_NULL", "KW_NAMES", "CACHE", "NOP", "RESUME",
                             "LOAD_FAST_LOAD_FAST"})
# ... and before the check's name: those, and stores of locals (the tuple
# of tensors MHA's check asks about) -- nothing that can run other code,
# which could reach another gated check first
_BEFORE_CHECK = _ARGUMENT_LOADS | {"STORE_FAST", "STORE_DEREF", "MAKE_CELL", "COPY_FREE_VARS"}


class OneNo(threading.local):
    """A "no" a gate gives the next question it takes on this thread.
    The core counts the threads holding one: with none, a gate is torch's
    own check called from C."""
    _pending = False

    @property
    def pending(self) -> bool:
        return self._pending

    @pending.setter
    def pending(self, value) -> None:
        value = bool(value)
        if value != self._pending:
            self._pending = value
            _core.gates_opened(1 if value else -1)


_state = OneNo()
# function -> (the check its body makes first, the position of its
# `inplace` parameter or -1), or None: read from its code once
_check_of: dict = {}


def gate(check, answer: OneNo, takes=None):
    """`check` (a form of has_torch_function) answering "no" once while
    `answer.pending` is set on this thread: to the next question, or to
    the next that `takes(*arguments)` accepts."""
    def answer_once(*args):
        if answer.pending and (takes is None or takes(*args)):
            answer.pending = False
            return False
        return check(*args)

    gated = _core.gated(check, answer_once)
    gated.fastlazy_gate = True
    return gated


def python_patches():
    """(module, check name, gate) for every gated module's checks."""
    patches = []
    for module in _MODULES:
        for name in CHECKS:
            check = vars(module).get(name)
            if check is not None:
                patches.append((module, name, gate(check, _state)))
    return patches


def _checks_first(code) -> str | None:
    """The name of the torch-function check `code` calls before any other
    call, or None."""
    check = None
    for instruction in dis.get_instructions(code):
        name = instruction.opname
        if check is None:
            if name == "LOAD_GLOBAL" and instruction.argval in CHECKS:
                check = instruction.argval
            elif name not in _BEFORE_CHECK:
                return None
        elif name == "CALL" or name.startswith("CALL_FUNCTION"):
            return check
        elif name not in _ARGUMENT_LOADS:
            return None
    return None


def _first_check(func) -> tuple | None:
    """(the check whose answer runs `func`'s body, the position of its
    `inplace` parameter or -1), if it is one to run."""
    if type(func) is not types.FunctionType:
        return None
    code = func.__code__
    if code.co_flags & (0x20 | 0x80 | 0x100 | 0x200):   # generator, coroutine, async
        return None
    if not any(func.__globals__ is vars(module) for module in _MODULES):
        return None
    check = _checks_first(code)
    if check is None:
        return None
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return check, params.index("inplace") if "inplace" in params else -1


def run_body(func, args, kwargs):
    """(True, result) of running `func`'s body on LazyTensor arguments, its
    calls recorded; (False, None) where it is not to be run so."""
    try:
        found = _check_of[func]
    except KeyError:
        found = _check_of[func] = _first_check(func)
    except TypeError:           # unhashable
        return False, None
    if found is None:
        return False, None
    name, inplace = found
    if inplace >= 0 and (kwargs.get("inplace") if inplace >= len(args) else args[inplace]):
        return False, None
    if not getattr(func.__globals__.get(name), "fastlazy_gate", False):
        return False, None          # fastlazy is not enabled: the check is torch's own
    _state.pending = True
    try:
        return True, func(*args, **kwargs)
    finally:
        _state.pending = False
