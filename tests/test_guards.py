"""The guards (fastlazy/csrc/guards.h): torch's Python-level functions and
tensor attributes that eager code calls every step (an optimizer's
zero_grad and record_function, loss.backward(), torch.nn.functional's
has_torch_function checks, p.grad, p.data) go to torch's own in C while
nothing lazy is involved, and to fastlazy's Python only in the rare case.
P4 (eager code under enable() within 3 %) rests on the first half, eager's
semantics on the second."""
import functools
import os
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastlazy
from fastlazy import _core, fallback
from helpers import Square

pytestmark = pytest.mark.usefixtures("lazy_on")

PACKAGE = os.path.dirname(fastlazy.__file__)


def _fastlazy_frames(step):
    """The names of fastlazy's Python functions that step() entered, from
    a fresh enable(): nothing pending on this thread, no storage watched
    (a frozen program of an earlier test watches its parameters, and an
    eager torch.ops call then rightly goes to Python to report its writes)."""
    fastlazy.disable()
    fastlazy.enable()
    assert not _core.watching() and not _core.pending_nodes()
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return entered


def _eager_training_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    opt = torch.optim.SGD([*model.parameters(), *attention.parameters()], lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def step():
        opt.zero_grad()
        h = Square.apply(model(x)) + torch.zeros(4, 8) + torch.arange(8)
        h = attention(h[None], h[None], h[None], need_weights=False)[0][0]
        loss = F.mse_loss(h * torch.tensor(0.5), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        p = next(model.parameters())
        p.grad, p.data                              # reads of the guarded attributes
        p.data = p.data                             # and writes
        F.softmax(x, -1), F.layer_norm(x, (8,))     # gated checks
        torch.ops.aten.add(x, x), torch.ops.aten.add.Tensor(x, x)
        return loss.item()
    return step


def test_an_eager_training_step_enters_no_fastlazy_python():
    step = _eager_training_step()
    step()
    assert _fastlazy_frames(step) == []


def test_another_threads_pending_nodes_leave_eager_calls_in_c():
    # fl_pending stays set once several threads have recorded: the guards
    # ask about the calling thread's own segment
    held = []

    def record():
        held.append(fastlazy.lazy(torch.ones(2)) + 1)      # left pending

    thread = threading.Thread(target=record)
    thread.start()
    thread.join()
    step = _eager_training_step()
    step()
    try:
        assert _fastlazy_frames(step) == []
    finally:
        held.clear()


def test_gates_close_after_a_body_is_recorded():
    # a body run opens this thread's gate and takes its "no": afterwards
    # the checks are torch's own again, from C
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    x = fastlazy.lazy(torch.randn(1, 4, 16))
    mha(x, x, x, need_weights=False)[0].to_eager()
    step = _eager_training_step()
    assert _fastlazy_frames(step) == []


def test_a_lazy_gradient_set_on_an_eager_tensor_is_read():
    p = nn.Parameter(torch.ones(3))
    p.grad = fastlazy.lazy(torch.ones(3)) * 2
    assert type(p.grad) is torch.Tensor
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    del p.grad
    assert p.grad is None


def test_a_lazy_gradient_handed_to_backward_is_read():
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward(fastlazy.lazy(torch.tensor(3.0)))
    assert torch.equal(x.grad, torch.full((3,), 6.0))
    y = torch.ones(2, requires_grad=True)
    torch.autograd.backward([(y * 3).sum()], grad_tensors=[fastlazy.lazy(torch.tensor(2.0))])
    assert torch.equal(y.grad, torch.full((2,), 6.0))


def test_a_data_write_computes_the_pending_reads_first():
    e = torch.ones(3)
    pending = fastlazy.lazy(torch.zeros(3)) + e       # reads e's memory
    e.data = torch.full((3,), 5.0)                    # rebinds e: the read saw ones
    assert torch.equal(pending.to_eager(), torch.ones(3))
    e.data = fastlazy.lazy(torch.full((3,), 7.0))     # a LazyTensor's value
    assert type(e.data) is torch.Tensor and torch.equal(e, torch.full((3,), 7.0))


def test_a_torch_ops_write_computes_the_pending_reads_first():
    e = torch.ones(3)
    pending = fastlazy.lazy(torch.zeros(3)) + e
    torch.ops.aten.add_(e, 1)
    torch.ops.aten.mul_.Tensor(e, 3)
    assert torch.equal(pending.to_eager(), torch.ones(3))
    assert torch.equal(e, torch.full((3,), 6.0))


@pytest.mark.parametrize("holder", [
    lambda t: t, lambda t: [1, (2, t)], lambda t: {"a": [t]},
    lambda t: functools.partial(print, t), lambda t: functools.partial(print, k=t)],
    ids=["bare", "nested", "dict", "partial", "partial-keyword"])
def test_has_lazy_looks_where_materialize_does(holder):
    lazy = fastlazy.lazy(torch.ones(1))
    assert fallback.has_lazy([holder(lazy)])
    assert not fallback.has_lazy([holder(torch.ones(1))])
    materialized = fallback.materialize(holder(lazy))
    assert not fallback.has_lazy([materialized])


def test_the_guards_name_and_document_torchs_own():
    assert torch.autograd.backward.__name__ == "backward"
    assert torch.autograd.backward.__doc__ == torch.autograd.backward.__wrapped__.__doc__
    assert torch.Tensor.grad.__doc__ == torch._C.TensorBase.grad.__doc__
    fastlazy.disable()
    try:
        assert torch.Tensor.grad is torch._C.TensorBase.grad
        assert type(torch.autograd.backward).__name__ == "function"
    finally:
        fastlazy.enable()


def test_a_guarded_function_copies_and_pickles_as_torchs_own():
    import copy
    import pickle
    holder = nn.Module()
    holder.make = torch.zeros                   # a guard while enabled
    holder.fill = functools.partial(torch.full, (2,))
    twin = copy.deepcopy(holder)
    assert twin.make is torch.zeros and twin.fill.func is torch.full
    assert pickle.loads(pickle.dumps(torch.zeros)) is torch.zeros.__wrapped__
    assert copy.copy(torch.autograd.backward) is torch.autograd.backward


def test_a_lazy_tensor_deep_along_the_first_elements_is_read():
    # torch.tensor takes nesting deeper than 64 lists; the guard's walk
    # along the first elements is conversions' own, as deep
    data, want = fastlazy.lazy(torch.ones(1)), torch.ones(1)
    for _ in range(70):
        data, want = [data], [want]
    assert torch.equal(torch.tensor(data), torch.tensor(want))
