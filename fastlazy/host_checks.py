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


def define() -> None:
    """Define the op `fastlazy::checked` (once, by fastlazy's boot)."""
    op = torch.library.custom_op("fastlazy::checked", mutates_args=())(_checked)
    op.register_fake(_checked_fake)
    op.register_autograd(_checked_backward)


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
