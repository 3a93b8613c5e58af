"""Eager tensors written after a pending node read them, through paths no
recording entry point sees (watch.py): the graph must see the contents the
tensor had when the node was recorded, as eager does.

Each case is a program `f(lz)` run twice, with lz the identity (eager, the
oracle) and with lz = fastlazy.lazy; both must return equal values."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy._core import LazyTensor
from helpers import fastlazy_enabled  # noqa: F401  (module fixture)


def _value(x):
    return x.to_eager() if type(x) is LazyTensor else x


def same_as_eager(f):
    outs = {}
    for mode, lz in (("eager", lambda t: t), ("lazy", fastlazy.lazy)):
        torch.manual_seed(0)
        out = f(lz)
        out = out if isinstance(out, tuple) else (out,)
        outs[mode] = [_value(o).detach().clone() for o in out]
        fastlazy.mark_step()
    for e, l in zip(outs["eager"], outs["lazy"], strict=True):
        assert type(l) is torch.Tensor
        assert e.dtype == l.dtype and e.shape == l.shape
        torch.testing.assert_close(l, e, rtol=0, atol=0)


def _pending(lz):
    """An eager input e and a pending y = lz(ones) + e that reads it."""
    e = -torch.ones(4)
    y = lz(torch.ones(4)) * 2 + e
    return e, y


def _aten_add(e):
    torch.ops.aten.add_(e, 1)


CASES = {
    # memory handed out, then written
    "numpy": lambda e: e.numpy().__setitem__(0, 99),
    "np.asarray": lambda e: np.asarray(e).__setitem__(1, 99),
    "np.from_dlpack": lambda e: np.from_dlpack(e).__setitem__(2, 99),
    # reassigned or swapped under the same Python object
    ".data =": lambda e: setattr(e, "data", torch.zeros(4)),
    "swap_tensors": lambda e: torch.utils.swap_tensors(e, torch.full((4,), 7.0)),
    # storages
    "storage.fill_": lambda e: e.untyped_storage().fill_(0),
    "storage.copy_": lambda e: e.untyped_storage().copy_(torch.zeros(4).untyped_storage()),
    "storage[i] =": lambda e: e.untyped_storage().__setitem__(0, 0),
    "typed storage": lambda e: e.untyped_storage().nbytes() and e.storage().fill_(5.0),
    # torch functions and out=
    "out=": lambda e: torch.add(torch.ones(4), 1, out=e),
    "out= of a view": lambda e: torch.mul(torch.ones(2), 3, out=e[1:3]),
    "out= tuple": lambda e: torch.max(torch.rand(2, 4), 0, out=(e, torch.empty(4, dtype=torch.long))),
    "linalg out=": lambda e: torch.linalg.vector_norm(torch.ones(4, 4), dim=0, out=e),
    "torch.relu_": lambda e: torch.relu_(e),
    "torch.index_put_": lambda e: torch.index_put_(e, (torch.tensor([0]),), torch.tensor(5.0)),
    "torch._foreach_add_": lambda e: torch._foreach_add_([e], 1),
    "torch._foreach_mul_ view": lambda e: torch._foreach_mul_([e[::2]], 3.0),
    # factories' out= (guarded for their 0-dim tensor numbers, not watched)
    "torch.zeros out=": lambda e: torch.zeros(4, out=e),
    "torch.full out=": lambda e: torch.full((4,), 100.0, out=e),
    "torch.arange out=": lambda e: torch.arange(4.0, out=e),
    "torch.linspace out=": lambda e: torch.linspace(0, 1, 4, out=e),
    "torch.rand out=": lambda e: torch.rand(4, out=e),
    "torch.eye out= of a view": lambda e: torch.eye(2, out=e.view(2, 2)),
    # torch.nn.functional's own names for torch's writing functions
    "F.relu_": lambda e: F.relu_(e),
    "F.elu_": lambda e: F.elu_(e),
    "F.celu_": lambda e: F.celu_(e),
    "F.selu_": lambda e: F.selu_(e),
    "F.hardtanh_": lambda e: F.hardtanh_(e, 0.0, 0.5),
    "F.leaky_relu_": lambda e: F.leaky_relu_(e, 0.5),
    "F.rrelu_": lambda e: F.rrelu_(e),
    "F.threshold_": lambda e: F.threshold_(e, 0.5, 7.0),
    # torch.nn.functional and modules (torch.relu_, torch._C._nn.*_)
    "F.relu inplace": lambda e: F.relu(e, inplace=True),
    "F.elu inplace": lambda e: F.elu(e, inplace=True),
    "F.hardtanh inplace": lambda e: F.hardtanh(e, 0.0, 0.5, inplace=True),
    "F.leaky_relu inplace": lambda e: F.leaky_relu(e, 0.5, inplace=True),
    "nn.ReLU(inplace)": lambda e: torch.nn.ReLU(inplace=True)(e),
    "nn.Dropout(inplace)": lambda e: torch.nn.Dropout(0.5, inplace=True).train()(e),
    # the dispatcher directly
    "torch.ops.aten.add_": _aten_add,
    "aten.add_.Tensor": lambda e: torch.ops.aten.add_.Tensor(e, torch.ones(4)),
    "aten.copy_.default": lambda e: torch.ops.aten.copy_.default(e, torch.zeros(4)),
    "aten.add.out": lambda e: torch.ops.aten.add.out(torch.ones(4), torch.ones(4), out=e),
    "aten.fill_ on a view": lambda e: torch.ops.aten.fill_(e[2:], 3.0),
    # aliases: a .data alias or a view written through an unseen path
    ".data alias, aten": lambda e: torch.ops.aten.mul_(e.data, 4),
    "view, out=": lambda e: torch.neg(torch.ones(2, 2), out=e.view(2, 2)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_write_after_read_keeps_recorded_contents(name):
    write = CASES[name]

    def f(lz):
        e, y = _pending(lz)
        write(e)
        return y, e
    same_as_eager(f)


@pytest.mark.parametrize("name", ["torch.zeros out=", "torch.full out=", "F.relu_",
                                  "F.threshold_", "torch.relu_", "out="])
def test_write_after_read_under_inference_mode(name):
    """An inference tensor has no version counter: a write no path sees
    would go unnoticed until the graph read the new contents."""
    write = CASES[name]

    def f(lz):
        with torch.inference_mode():
            e, y = _pending(lz)
            write(e)
        return y, e
    same_as_eager(f)


@pytest.mark.parametrize("foreach,fused", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("opt", ["Adam", "SGD", "AdamW"])
def test_optimizer_step_after_a_pending_read(opt, foreach, fused):
    def f(lz):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.rand(4))
        p.grad = torch.rand(4)
        kwargs = {"lr": 0.1, "foreach": foreach}
        if fused:
            kwargs = {"lr": 0.1, "fused": True}
        if opt == "SGD":
            kwargs["momentum"] = 0.9
        o = getattr(torch.optim, opt)([p], **kwargs)
        y = lz(torch.ones(4)) * p.detach()          # reads p's memory
        o.step()
        o.step()
        return y, p.detach()
    same_as_eager(f)


def test_module_to_rebinds_data_after_a_pending_read():
    def f(lz):
        m = torch.nn.Linear(3, 2)
        with torch.no_grad():
            m.weight.fill_(1.0)
        y = lz(torch.ones(3)) @ m.weight.detach().T
        m.to(torch.float64)                         # param.data = ... inside
        m.weight.data.fill_(2.0)
        return y, m.weight.detach()
    same_as_eager(f)


def test_a_write_no_pending_node_reads_keeps_the_graph_whole():
    fastlazy.mark_step()
    e, y = _pending(fastlazy.lazy)
    other = torch.ones(4)
    for write in (lambda: torch.relu_(other), lambda: torch.ops.aten.add_(other, 1),
                  lambda: torch.add(e, 1, out=other), lambda: other.untyped_storage().fill_(0),
                  lambda: torch._foreach_add_([other], 1)):
        write()
        assert fastlazy._core.pending_nodes() == 2
    torch.testing.assert_close(y.to_eager(), torch.ones(4))


def test_lazy_arguments_still_record_through_watched_functions():
    x = fastlazy.lazy(torch.rand(4))
    out = torch.special.erf(x)
    assert type(out) is LazyTensor
    torch.testing.assert_close(out.to_eager(), torch.special.erf(x.to_eager()))
    for write in (F.relu_, F.elu_, lambda t: F.threshold_(t, 0.5, 7.0)):
        v = torch.randn(4)
        lazy = fastlazy.lazy(v.clone())
        assert write(lazy) is lazy
        torch.testing.assert_close(lazy.to_eager(), write(v))


def test_disable_restores_every_watched_function():
    originals = (torch.relu_, torch.ops.aten.add_.__class__.__call__,
                 torch._ops.OpOverload.__call__, torch.utils.swap_tensors,
                 torch.UntypedStorage.fill_, torch.Tensor.numpy)
    fastlazy.disable()
    try:
        assert torch.Tensor.data is torch._C.TensorBase.data
        assert type(torch.relu_).__name__ == "builtin_function_or_method"
        assert "__call__" not in vars(torch._ops.OpOverloadPacket) or \
            vars(torch._ops.OpOverloadPacket)["__call__"] is not originals[1]
    finally:
        fastlazy.enable()
