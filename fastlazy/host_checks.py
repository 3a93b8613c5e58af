"""Checks eager makes on the host after a kernel, kept in recorded programs.

torch's linear algebra computes with a kernel that reports failure in an
`info` tensor (linalg_inv_ex, linalg_cholesky_ex, _linalg_solve_ex,
linalg_lu_factor_ex...) and then reads that tensor on the host:
`aten._linalg_check_errors(info, api_name, is_matrix)` raises
torch.linalg.LinAlgError for a singular or non-positive-definite input.
That call returns nothing, so a program made of the call's results would
drop it, and `linalg.inv` of a singular matrix would give infinities
where eager raises.

A recorded program keeps it instead, as data flow: each of its results
passes through `fastlazy::checked(result, info, api_name, is_matrix)`,
which makes eager's check and returns a copy of the result (a custom op
may not return its input).  Reading any result of the call then raises
eager's LinAlgError, as the other errors that depend on values do: when
the graph runs, not at the call.  The copy costs O(n^2) beside the
kernel's O(n^3).

Some kernels check their inputs' values inside their own loop, which a
fused program drops where the compiler decomposes the op:
binary_cross_entropy raises for an input outside [0, 1] in eager and on
the fast tier, and inductor's decomposition returns NaN.  Graphs for
inductor (inductor_graph.py) pass such an input through
`fastlazy::in_range(x, low, high, message)` first: eager's check, then a
copy of x; an index that eager's kernel refuses to read from the end
(`index_select`'s) goes through `fastlazy::int_values_within`.  And a
composite function may check its arguments' values on the host before
any kernel (F.one_hot reads its classes' min and max),
which the program its fake run records lacks: FUNCTION_CHECKS puts the
same checks at the start of its program.  An integer argument's checks go
through `fastlazy::int_values_within` instead (one_hot's two in one call):
an integer tensor has no NaN and no gradient, so the op needs no autograd
formula and skips `torch.library.custom_op`'s Python layers, which cost
about 30 us a call.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx

_CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default

# the aten ops that check values on the host and return nothing
HOST_CHECKS = frozenset({_CHECK_ERRORS})


def _checked(result: torch.Tensor, info: torch.Tensor, api_name: str,
             is_matrix: bool) -> torch.Tensor:
    torch._linalg_check_errors(info, api_name, is_matrix=is_matrix)
    return result.clone()


def _checked_fake(result, info, api_name, is_matrix):
    return torch.empty_like(result)


def _checked_backward(ctx, grad):
    return grad, None, None, None


def _in_range(x: torch.Tensor, low: Optional[float], high: Optional[float],
              message: str) -> torch.Tensor:
    inside = torch.ones_like(x, dtype=torch.bool)
    if low is not None:
        inside &= x >= low
    if high is not None:
        inside &= x <= high
    if not bool(inside.all()):                            # (NaN is outside, as in eager)
        raise RuntimeError(message)
    return x.clone()


def _in_range_fake(x, low, high, message):
    return torch.empty_like(x)


def _in_range_backward(ctx, grad):
    return grad, None, None, None


def _int_values_within(x: torch.Tensor, low: int, below: str, high: int,
                       above: str) -> torch.Tensor:
    """Eager's checks of an integer (or bool) tensor's values: `below`
    raised if one is under `low`, else `above` if one is over `high`
    (int64's least and greatest: no bound); then a copy of x (an op may not
    return its input)."""
    if x.numel():
        least, most = torch.aminmax(x if x.dtype != torch.bool else x.to(torch.uint8))
        if least.item() < low:
            raise RuntimeError(below)
        if most.item() > high:
            raise RuntimeError(above)
    return x.clone()


# aten op -> (argument checked, low, high, eager's message): checks made
# inside the op's kernel, which inductor's decomposition of it drops
KERNEL_CHECKS = {
    torch.ops.aten.binary_cross_entropy.default:
        (0, 0.0, 1.0, "all elements of input should be between 0 and 1"),
}

# aten op -> (the position of its index argument, eager's message): ops
# whose CPU kernel refuses a negative index, where inductor reads one from
# the end as Python's x[-1] does (its own bounds check, which it keeps,
# catches only what still falls outside after that): a compiled program
# gave `index_select(0, [-1])` the last row where eager raises.  The check
# raises RuntimeError; reading the result then recomputes the failed node
# on its own, eagerly (graph_cache.recover), which raises eager's error.
NON_NEGATIVE_INDICES = {
    torch.ops.aten.index_select.default: (2, "index out of range in self"),
    torch.ops.aten.index_add.default: (2, "index_add(): an index is negative"),
    torch.ops.aten.index_copy.default: (2, "index_copy(): an index is negative"),
}


_library = None      # the Library fragment holding int_values_within's kernel


def define() -> None:
    """Define the ops `fastlazy::checked`, `fastlazy::in_range` and
    `fastlazy::int_values_within` (once, by fastlazy's boot)."""
    global _library
    op = torch.library.custom_op("fastlazy::checked", mutates_args=())(_checked)
    op.register_fake(_checked_fake)
    op.register_autograd(_checked_backward)
    op = torch.library.custom_op("fastlazy::in_range", mutates_args=())(_in_range)
    op.register_fake(_in_range_fake)
    op.register_autograd(_in_range_backward)
    _library = torch.library.Library("fastlazy", "FRAGMENT")
    _library.define("int_values_within(Tensor x, int low, str below, int high, str above)"
                    " -> Tensor")
    _library.impl("int_values_within", _int_values_within, "CompositeExplicitAutograd")
    torch.library.register_fake("fastlazy::int_values_within", lib=_library)(
        lambda x, low, below, high, above: torch.empty_like(x))


def _one_hot_checks(args, kwargs):
    num_classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if type(num_classes) is not int or num_classes < 0:
        return ()          # (classes counted from the data: the call runs eagerly)
    return ((0, 0.0, None, "Class values must be non-negative."),
            (0, None, float(num_classes - 1), "Class values must be smaller than num_classes."))


# function -> its calls' checks of tensor arguments' values, made on the
# host (one_hot reads its input's min and max): (tensor argument, low,
# high, eager's message), in eager's order
FUNCTION_CHECKS = {torch.nn.functional.one_hot: _one_hot_checks}


def keep_argument_checks(func, args, kwargs, graph: torch.fx.Graph) -> None:
    """Put FUNCTION_CHECKS' checks of a call of `func` at the start of its
    program `graph` (whose placeholders are the call's tensor arguments),
    in place: the program a fake run records has none of them."""
    rule = FUNCTION_CHECKS.get(getattr(func, "__wrapped__", func))
    if rule is None:
        return
    values = [n for n in graph.nodes if n.op == "placeholder"]
    last = values[-1]
    for index, call in _check_calls(rule(args, kwargs), values):
        source = values[index]
        with graph.inserting_after(last):
            checked = graph.call_function(call[0], (source, *call[1:]))
        checked.meta["val"] = source.meta.get("val")
        source.replace_all_uses_with(checked, delete_user_cb=lambda user: user is not checked)
        values[index] = last = checked


def _check_calls(checks, values):
    """(argument index, (op, its arguments after the tensor)) for each call
    making `checks` in their order: an integer argument's through
    int_values_within, a lower bound's check and the next check's upper
    bound in one call (F.one_hot's pair); others' through in_range."""
    within = torch.ops.fastlazy.int_values_within.default
    calls = []
    for index, low, high, message in checks:
        val = values[index].meta.get("val")
        if val is None or val.dtype.is_floating_point or val.dtype.is_complex:
            calls.append((index, (torch.ops.fastlazy.in_range.default, low, high, message)))
            continue
        # (integer values: x >= low is x >= ceil(low), x <= high is x <= floor(high))
        low = _INT64_MIN if low is None else math.ceil(low)
        high = _INT64_MAX if high is None else math.floor(high)
        previous = calls[-1][1] if calls and calls[-1][0] == index else None
        lower_only_before = (previous is not None and previous[0] is within
                             and previous[3] == _INT64_MAX)
        if lower_only_before and low == _INT64_MIN:
            # this upper bound joins the lower bound's call (still checked after it)
            _, first_low, below, _, _ = previous
            calls[-1] = (index, (within, first_low, below, high, message))
        else:
            calls.append((index, (within, low, message, high, message)))
    return calls


# int_values_within: no bound on that side (bounds are ints: TorchScript's IR
# has no literal for a non-finite float)
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def keep_kernel_checks(graph: torch.fx.Graph, on_cpu: bool = True) -> None:
    """Pass the arguments KERNEL_CHECKS names through `fastlazy::in_range`,
    and (`on_cpu`: a graph of CPU tensors) the indices NON_NEGATIVE_INDICES
    names through `fastlazy::int_values_within`, before their ops (in
    place; for graphs a compiler fuses).  On a GPU eager's kernel asserts
    on the device, which no check here could raise as, and a check's read
    of the values on the host would stall every run."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        check = KERNEL_CHECKS.get(node.target)
        if check is not None:
            index, low, high, message = check
            call = (torch.ops.fastlazy.in_range.default, low, high, message)
        elif on_cpu and node.target in NON_NEGATIVE_INDICES:
            index, message = NON_NEGATIVE_INDICES[node.target]
            call = (torch.ops.fastlazy.int_values_within.default, 0, message, _INT64_MAX,
                    message)
        else:
            continue
        with graph.inserting_before(node):
            checked = graph.call_function(call[0], (node.args[index], *call[1:]))
        node.args = node.args[:index] + (checked,) + node.args[index + 1:]


def keep(graph: torch.fx.Graph) -> None:
    """Route every output of `graph` through the host checks its calls
    make (in place; the caller regenerates its code)."""
    checks = [n for n in graph.nodes if n.op == "call_function" and n.target in HOST_CHECKS]
    if not checks:
        return
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    results = output.args[0]
    single = not isinstance(results, (tuple, list))
    wrapped = []
    for result in ([results] if single else results):
        if isinstance(result, torch.fx.Node):
            for check in checks:
                with graph.inserting_before(output):
                    made = graph.call_function(torch.ops.fastlazy.checked.default,
                                               (result, *check.args),
                                               dict(check.kwargs))
                made.meta["val"] = result.meta.get("val")
                result = made
        wrapped.append(result)
    output.args = (wrapped[0] if single else type(results)(wrapped),)
    for check in checks:
        graph.erase_node(check)
