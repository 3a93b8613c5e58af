"""Property-based programs over views and in-place ops, lazily and eagerly.

A program keeps every tensor it makes alive -- inputs, views of them, views
of views, results -- and mutates some of them in place (in-place ops,
__setitem__).  At the end every one of them must hold eager's values: a
write through a view reaches its base and every other view of that base,
and a write to the base reaches its views.

View steps only take views whose aliasing does not depend on memory layout
(select, slice, transpose, unsqueeze, diagonal; view(-1) of an input): a
LazyTensor that is not a view reports a contiguous layout, where eager's
result of an op on a transposed view may not be contiguous (see README).

Each runs on the CPU and on CUDA (fewer examples: helpers.fuzz_settings),
against eager on the same device.  Every error a program can meet is one
of eager's checks of shapes and aliasing, made on the host on either
device.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import fastlazy

from helpers import fuzz_settings

# (index_list is advanced indexing: a copy, which later writes must not reach)
VIEWS = ["select", "slice", "transpose", "unsqueeze", "diagonal", "flatten_input",
         "narrow", "index_list"]
WRITES = ["add_", "mul_", "sub_", "setitem", "setitem_list", "zero_", "clamp_",
          "transpose_", "unsqueeze_", "squeeze_"]


@st.composite
def programs(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 3)) for _ in range(ndim))
    dtype = draw(st.sampled_from([torch.float32, torch.int64, torch.float64]))
    n_inputs = draw(st.integers(1, 2))
    steps = []
    for k in range(draw(st.integers(1, 10))):
        pool = n_inputs + k
        kind = draw(st.sampled_from(["view"] * 3 + ["write"] * 3 + ["op"]))
        steps.append((kind, draw(st.sampled_from(VIEWS if kind == "view" else WRITES)),
                      draw(st.integers(0, pool - 1)), draw(st.integers(0, pool - 1)),
                      draw(st.integers(-3, 3)), draw(st.booleans())))
    return shape, dtype, n_inputs, steps


def _view(name, x, i, n_inputs, a):
    if x.dim() == 0:
        return x.unsqueeze(0)
    d = i % x.dim()
    if name == "select":
        return x.select(d, i % x.shape[d]) if x.shape[d] else x
    if name == "slice":
        return x[1:] if i % 2 else x[..., ::2]
    if name == "transpose":
        return x.transpose(0, d)
    if name == "unsqueeze":
        return x.unsqueeze(d)
    if name == "diagonal":
        return x.diagonal(0, 0, -1) if x.dim() >= 2 else x[:1]
    if name == "narrow":
        return x.narrow(d, 0, max(x.shape[d] - 1, 0))
    if name == "index_list":
        if x.dim() >= 2 and x.shape[1]:
            return x[:, [-1, 0]]
        return x[[i % x.shape[0]]] if x.shape[0] else x
    # view(-1) only of an input, which is contiguous in eager too
    return x.view(-1) if a < n_inputs else x[:]


def _write(name, x, y, i, flag):
    # in place, a tensor's place in its storage (a base's with live views
    # too: those keep the storage)
    if name == "transpose_":
        return x.transpose_(0, i % x.dim()) if x.dim() else x
    if name == "unsqueeze_":
        return x.unsqueeze_(i % (x.dim() + 1))
    if name == "squeeze_":
        return x.squeeze_(i % x.dim()) if x.dim() else x
    if name == "setitem":
        if x.dim() == 0:
            x.fill_(i)
        else:
            x[i % max(x.shape[0], 1)] = 2.5 if flag and x.dtype.is_floating_point else i
        return x
    if name == "setitem_list":
        if x.dim() == 0 or x.shape[0] == 0:
            return x.zero_()
        # distinct rows: with repeated ones eager's write order would decide
        x[sorted({0, x.shape[0] - 1})] = 2.5 if flag and x.dtype.is_floating_point else i
        return x
    if name == "zero_":
        return x.zero_()
    if name == "clamp_":
        return x.clamp_(min=-1, max=2)
    # a tensor operand is copied first: reading memory that the op writes
    # (x.add_(x[..., ::2])) gives values that depend on eager's loop order
    other = y.clone() if flag else i
    return getattr(x, name)(other)


def run(shape, dtype, n_inputs, steps, lazy, device="cpu"):
    torch.manual_seed(0)
    inputs = [(torch.arange(torch.Size(shape).numel(), dtype=torch.float64) * (k + 1) - 3)
              .reshape(shape).to(device, dtype) for k in range(n_inputs)]
    pool = [fastlazy.lazy(v) * 1 if lazy else v for v in inputs]
    for k, (kind, name, a, b, i, flag) in enumerate(steps):
        try:
            if kind == "view":
                out = _view(name, pool[a], i, n_inputs, a)
            elif kind == "write":
                out = _write(name, pool[a], pool[b], i, flag)
            else:
                out = pool[a] * 2 + pool[b]
        except Exception as exc:
            return pool, (k, type(exc))
        pool.append(out)
    return pool, None


def _value(x):
    return x.to_eager() if isinstance(x, fastlazy.LazyTensor) else x


def check(shape, dtype, n_inputs, steps, device="cpu"):
    want, want_err = run(shape, dtype, n_inputs, steps, lazy=False, device=device)
    got, got_err = run(shape, dtype, n_inputs, steps, lazy=True, device=device)
    assert want_err == got_err
    assert len(want) == len(got)
    for k, (w, g) in enumerate(zip(want, got)):
        g = _value(g)
        assert g.dtype == w.dtype and g.shape == w.shape, k
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"pool[{k}]")


_SETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


def test_views_and_inplace_match_eager(backend, lazy_on, device):
    @fuzz_settings(device, _SETTINGS)
    @given(program=programs())
    def views_program(program):
        check(*program, device)
    views_program()


REGRESSIONS = [
    # a TorchScript graph computing into an intermediate's storage was
    # reused for shapes where a broadcast made the result larger
    ((2, 2), torch.float64, 1, [("op", "add_", 0, 0, 0, False)]),
    ((1, 2), torch.float64, 1, [("write", "sub_", 0, 0, 0, False),
                                ("view", "transpose", 0, 0, 1, False),
                                ("op", "add_", 0, 2, 0, False),
                                ("view", "select", 3, 0, 1, False)]),
]


@pytest.mark.parametrize("case", REGRESSIONS)
def test_view_regressions(case, lazy_on, device):
    check(*case, device)
