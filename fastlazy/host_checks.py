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
copy of x.
"""
from __future__ import annotations

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


def _in_range(x: torch.Tensor, low: float, high: float, message: str) -> torch.Tensor:
    if not bool(((x >= low) & (x <= high)).all()):       # (NaN is outside, as in eager)
        raise RuntimeError(message)
    return x.clone()


def _in_range_fake(x, low, high, message):
    return torch.empty_like(x)


def _in_range_backward(ctx, grad):
    return grad, None, None, None


# aten op -> (argument checked, low, high, eager's message): checks made
# inside the op's kernel, which inductor's decomposition of it drops
KERNEL_CHECKS = {
    torch.ops.aten.binary_cross_entropy.default:
        (0, 0.0, 1.0, "all elements of input should be between 0 and 1"),
}


def define() -> None:
    """Define the ops `fastlazy::checked` and `fastlazy::in_range` (once,
    by fastlazy's boot)."""
    op = torch.library.custom_op("fastlazy::checked", mutates_args=())(_checked)
    op.register_fake(_checked_fake)
    op.register_autograd(_checked_backward)
    op = torch.library.custom_op("fastlazy::in_range", mutates_args=())(_in_range)
    op.register_fake(_in_range_fake)
    op.register_autograd(_in_range_backward)


def keep_kernel_checks(graph: torch.fx.Graph) -> None:
    """Pass the arguments KERNEL_CHECKS names through `fastlazy::in_range`
    before their ops (in place; for graphs a compiler fuses)."""
    for node in list(graph.nodes):
        check = KERNEL_CHECKS.get(node.target) if node.op == "call_function" else None
        if check is None:
            continue
        index, low, high, message = check
        with graph.inserting_before(node):
            checked = graph.call_function(torch.ops.fastlazy.in_range.default,
                                          (node.args[index], low, high, message))
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
