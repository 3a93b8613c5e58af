"""The generic path's flat keys (csrc/generic_record.pxi): a published
signature is found again from the call's argument vector, reading an eager
operand's metadata at every call.  An eager tensor's shape, strides and
dtype can change without a version bump (resize_, set_, .data=, t_): every
call after such a change gives eager's result.  Eager is the oracle."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import generic, views

pytestmark = pytest.mark.usefixtures("lazy_on")


def hits():
    return fastlazy.metrics.counters()["generic_calls"]


A = torch.arange(6.0).reshape(2, 3)


def addmm_with(e):
    """torch.addmm of a LazyTensor and the eager `e` (a generic call whose
    arguments the entry sees), three times so that the last two are
    published hits; eager's result."""
    z = torch.zeros(1)
    la = fastlazy.lazy(A)
    for _ in range(3):
        got = torch.addmm(z, la, e).to_eager()
    torch.testing.assert_close(got, torch.addmm(z, A, e))


@pytest.mark.parametrize("change", [
    "resize_", "resize_ smaller", "set_", "data", "t_", "unsqueeze_", "as_strided_"])
def test_eager_operand_changed_between_hits_gives_eager_result(change):
    e = torch.rand(3, 2)
    addmm_with(e)
    if change == "resize_":
        e.resize_(3, 4)
        # resize_ keeps the 6 old elements first in memory and leaves the 6
        # new ones unset (NaN at times, and NaN != NaN): set every one
        e.view(-1)[6:] = 0.5
    elif change == "resize_ smaller":
        e.resize_(3, 1)
    elif change == "set_":
        e.set_(torch.rand(3, 5))
    elif change == "data":
        e.data = torch.rand(3, 1)
    elif change == "t_":
        e.t_()
    elif change == "unsqueeze_":
        e.unsqueeze_(0)
    elif change == "as_strided_":
        e.as_strided_((3, 2), (1, 3))
    z, la = torch.zeros(1), fastlazy.lazy(A)
    try:
        expected = torch.addmm(z, A, e)
    except RuntimeError as exc:
        # raised at the call, as eager raises it
        with pytest.raises(type(exc)):
            torch.addmm(z, la, e)
    else:
        got = torch.addmm(z, la, e)
        assert got.shape == expected.shape          # known before it runs
        torch.testing.assert_close(got.to_eager(), expected)


def test_eager_operand_dtype_replaced_through_data():
    # .data = another dtype: eager's addmm then refuses the mixed dtypes
    b, w = torch.rand(5), torch.rand(3, 5)
    x = fastlazy.lazy(torch.rand(4, 3))
    for _ in range(3):
        torch.testing.assert_close(torch.addmm(b, x, w).to_eager(),
                                   torch.addmm(b, x.to_eager(), w))
    w.data = w.data.double()
    with pytest.raises(RuntimeError):
        torch.addmm(b, x.to_eager(), w)
    with pytest.raises(RuntimeError):
        torch.addmm(b, x, w)            # at the call, as in eager


def test_eager_operand_requires_grad_between_hits():
    b, w = torch.rand(5), torch.rand(3, 5)
    x = fastlazy.lazy(torch.rand(4, 3))
    for _ in range(3):
        assert not torch.addmm(b, x, w).requires_grad
    w.requires_grad_(True)
    out = torch.addmm(b, x, w)
    assert out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.to_eager().t() @ torch.ones(4, 5))


def test_bool_and_int_arguments_are_different_signatures():
    # eager takes keepdim=True and refuses keepdim=1: a hit for True must
    # not take the int
    x = fastlazy.lazy(torch.rand(3, 4))
    for _ in range(3):
        assert torch.cumsum(x, 1, dtype=torch.float64).dtype == torch.float64
        torch.testing.assert_close(torch.std(x, 1, True).to_eager(),
                                   torch.std(x.to_eager(), 1, True))
    for value in (1, 1.0):
        try:
            expected = torch.std(x.to_eager(), 1, value)
        except TypeError:
            with pytest.raises(TypeError):
                torch.std(x, 1, value)
        else:
            torch.testing.assert_close(torch.std(x, 1, value).to_eager(), expected)


def test_float_arguments_keep_their_sign_and_value():
    x = fastlazy.lazy(torch.tensor([-1.0, 0.0, 2.0]))
    for value in (0.5, 0.5, 0.0, 0.0, -0.0, -0.0, 2.5):
        got = torch.where(x > 0, x, value).to_eager()
        expected = torch.where(x.to_eager() > 0, x.to_eager(), value)
        torch.testing.assert_close(got, expected)
        assert torch.equal(torch.signbit(got), torch.signbit(expected))


def test_keyword_names_are_part_of_the_key():
    x = fastlazy.lazy(torch.rand(3, 4))
    for _ in range(3):
        torch.testing.assert_close(torch.cumsum(x, dim=1).to_eager(),
                                   torch.cumsum(x.to_eager(), dim=1))
        torch.testing.assert_close(torch.cumsum(x, dim=0).to_eager(),
                                   torch.cumsum(x.to_eager(), dim=0))
    with pytest.raises(TypeError):
        torch.cumsum(x.to_eager(), dims=1)
    with pytest.raises(TypeError):
        torch.cumsum(x, dims=1)


def test_published_signature_is_recorded_without_python(monkeypatch):
    # (addmm with beta: its C rule leaves the call to the generic path)
    x = fastlazy.lazy(torch.rand(4, 6))
    w = torch.rand(6, 2)
    torch.addmm(torch.ones(2), x, w, beta=0.5)
    torch.addmm(torch.ones(2), x, w, beta=0.5)

    def refuse(*args, **kwargs):
        raise AssertionError("went up into Python")

    monkeypatch.setattr(generic, "record", refuse)
    before = hits()
    out = torch.addmm(torch.ones(2), x, w, beta=0.5)
    assert hits() == before + 1
    torch.testing.assert_close(out.to_eager(), 0.5 + x.to_eager() @ w)


def test_view_geometry_is_part_of_the_key():
    # reshape of a contiguous view is a view of the root; of a transposed
    # view, a copy: a write through the result reaches the root only then
    for _ in range(3):
        x = fastlazy.lazy(torch.zeros(4, 4))
        r = x.view(4, 4).reshape(16)
        r.add_(1)
        assert x.to_eager().sum() == 16
        y = fastlazy.lazy(torch.zeros(4, 4))
        s = y.t().reshape(16)
        s.add_(1)
        assert y.to_eager().sum() == 0


def test_family_holds_views_weakly():
    x = fastlazy.lazy(torch.zeros(8))
    kept = [x[i:i + 1] for i in range(4)]
    for i in range(40):
        x[i % 8:i % 8 + 1]          # views dropped at once
    family = x.family
    assert type(family) is views.Family
    assert sorted(id(v) for v in family.members) == sorted(id(v) for v in kept)
    family.discard(kept[0])
    assert len(family.members) == 3
    member = kept[1].family
    assert type(member) is views.Member and member.root is x
    assert member.size == (1,) and member.stride == (1,) and member.offset == 1


def test_call_returning_its_argument_is_a_hit_in_c(monkeypatch):
    # x.contiguous() of a contiguous x returns x itself, as in eager
    x = fastlazy.lazy(torch.rand(3, 4))
    assert x.contiguous() is x
    assert x.contiguous() is x

    def refuse(*args, **kwargs):
        raise AssertionError("went up into Python")

    monkeypatch.setattr(generic, "record", refuse)
    assert x.contiguous() is x
    monkeypatch.undo()
    t = x.t()
    c = t.contiguous()              # a copy: another signature
    assert c is not t
    torch.testing.assert_close(c.to_eager(), x.to_eager().t())


def test_getitem_is_a_hit_in_c(monkeypatch):
    x = fastlazy.lazy(torch.arange(12.0).reshape(3, 4))
    x[1:, ::2]
    x[1:, ::2]

    def refuse(*args, **kwargs):
        raise AssertionError("went up into Python")

    monkeypatch.setattr(generic, "record", refuse)
    y = x[1:, ::2]
    torch.testing.assert_close(y.to_eager(), torch.arange(12.0).reshape(3, 4)[1:, ::2])
    assert type(y.family) is views.Member and y.family.root is x


@pytest.mark.parametrize("call", [
    lambda m, i: m & (i > 2), lambda m, i: ~m, lambda m, i: i // 3, lambda m, i: i % 3,
    lambda m, i: m ^ m, lambda m, i: i << 1,
    lambda m, i: i.to(torch.float32), lambda m, i: m.to("cpu"),
    lambda m, i: i.to(dtype=torch.float16),
    lambda m, i: i.to(copy=True, dtype=torch.float32, device=i.device),
    lambda m, i: i.to(copy=True), lambda m, i: i.to(device="cpu", copy=False),
], ids=["and", "invert", "floordiv", "mod", "xor", "lshift", "to-dtype",
        "to-own-device", "to-dtype-keyword", "to-keywords-copy", "to-copy",
        "to-keywords-no-copy"])
def test_operators_without_a_row_and_to_are_hits_in_c(call, monkeypatch):
    # HuggingFace's generate calls these on its masks and token ids per
    # token: a signature seen before is recorded without Python
    mask = torch.tensor([True, False, True, True])
    ids = torch.tensor([0, 4, 7, 9])
    m, i = fastlazy.lazy(mask), fastlazy.lazy(ids)
    call(m, i)
    call(m, i)

    def refuse(*args, **kwargs):
        raise AssertionError("went up into Python")

    monkeypatch.setattr(generic, "record", refuse)
    y = call(m, i)
    monkeypatch.undo()
    want = call(mask, ids)
    got = y.to_eager() if type(y) is fastlazy.LazyTensor else y
    assert torch.equal(got, want) and got.dtype == want.dtype
    if want is ids or want is mask:
        assert y is i or y is m        # (a no-op .to returns the tensor itself)


@pytest.mark.parametrize("call", [
    lambda a, b, e: torch.cat([a, b], dim=1),
    lambda a, b, e: torch.cat((e, a), -1),           # an eager tensor in the list
    lambda a, b, e: torch.stack([a, b]),
    lambda a, b, e: torch.cat([a, b], dim=0, out=None),
], ids=["cat-list", "cat-eager-in-tuple", "stack", "cat-keyword"])
def test_tensors_inside_a_list_are_a_hit_in_c(call, monkeypatch):
    # torch.cat's LazyTensors sit in a list, where the entry point does not
    # look: __torch_function__ takes the call to the same signature hits
    a, b = fastlazy.lazy(torch.rand(2, 3)), fastlazy.lazy(torch.rand(2, 3))
    e = torch.rand(2, 3)
    call(a, b, e)
    call(a, b, e)

    def refuse(*args, **kwargs):
        raise AssertionError("went up into Python")

    monkeypatch.setattr(generic, "record", refuse)
    y = call(a, b, e)
    monkeypatch.undo()
    torch.testing.assert_close(y.to_eager(), call(a.to_eager(), b.to_eager(), e))


def test_a_torch_python_function_returning_a_tuple_with_none_is_a_hit_in_c(monkeypatch):
    # F.multi_head_attention_forward reaches __torch_function__ (it is not
    # an entry point) and returns (output, None) without weights
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.rand(1, 4, 8)
    lx = fastlazy.lazy(x)
    with torch.no_grad():
        attention(lx, lx, lx, need_weights=False)
        attention(lx, lx, lx, need_weights=False)

        def refuse(*args, **kwargs):
            raise AssertionError("went up into Python")

        monkeypatch.setattr(generic, "record", refuse)
        out, weights = attention(lx, lx, lx, need_weights=False)
        monkeypatch.undo()
        expected, _ = attention(x, x, x, need_weights=False)
    assert weights is None
    torch.testing.assert_close(out.to_eager(), expected)


# -- calls that return several results --------------------------------------
# A published signature whose call returns a tuple, list or structseq of
# several recorded results (views, or new tensors: aten's functional batch norm)
# is recorded by the core too: one node per result over the same inputs.
SEVERAL = {
    "tensor_split": lambda x, e: torch.tensor_split(x, 3, 1),
    "chunk_of_a_transpose": lambda x, e: x.t().chunk(2, 1),
    "unbind": lambda x, e: x.unbind(1),
    # torch.return_types structseqs (beam search's topk per token)
    "topk": lambda x, e: torch.topk(x, 3, dim=1),
    "max_over_a_dim": lambda x, e: x.max(dim=-1),
    "sort": lambda x, e: torch.sort(x, 1, descending=True),
    "eager_operands": lambda x, e: torch.ops.aten._native_batch_norm_legit_functional.default(
        x.reshape(2, 6, 1), e, e, e * 0, e * 0 + 1, True, 0.1, 1e-5),
}


@pytest.mark.parametrize("name", list(SEVERAL))
def test_several_results_are_recorded_without_python(monkeypatch, name):
    call = SEVERAL[name]
    x, e = torch.randn(2, 6), torch.rand(6)
    lx = fastlazy.lazy(x)
    for _ in range(2):
        # analysed and published (a second time where the first made x a
        # base of views, which its key tells apart)
        call(lx, e)
    monkeypatch.setattr(generic, "record", lambda *a, **k: pytest.fail("went up into Python"))
    before = hits()
    got = call(lx, e)
    assert hits() == before + 1
    want = call(x, e)
    assert type(got) is type(want) and len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is fastlazy.LazyTensor
        torch.testing.assert_close(g.to_eager(), w, rtol=0, atol=0)


def test_a_write_through_one_published_view_reaches_the_base():
    for _ in range(3):
        base = fastlazy.lazy(torch.zeros(2, 6))
        first, second, third = base.chunk(3, dim=1)
        second.add_(1)
        want = torch.zeros(2, 6)
        want[:, 2:4] = 1
        assert torch.equal(base.to_eager(), want)
        assert torch.equal(first.to_eager(), torch.zeros(2, 2))


# -- under autocast: the key holds the thread's autocast state at the call --

def _linear_under_autocast(x, w, b):
    with torch.no_grad():
        return F.linear(x, w, b)


def test_a_signature_under_autocast_is_recorded_without_python(monkeypatch):
    x, w, b = torch.rand(4, 6), torch.rand(3, 6), torch.rand(3)
    lx = fastlazy.lazy(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):
            _linear_under_autocast(lx, w, b)
            lx * 2
        monkeypatch.setattr(generic, "record", lambda *a, **k: pytest.fail("went up into Python"))
        got, twice = _linear_under_autocast(lx, w, b), lx * 2
        want = _linear_under_autocast(x, w, b)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.to_eager(), want)
    torch.testing.assert_close(twice.to_eager(), x * 2)


@pytest.mark.parametrize("change", ["nested context", "setter", "disabled", "other thread"])
def test_an_autocast_state_change_is_a_new_signature(change):
    """A hit published under one autocast state is never taken under
    another, however the state changed: a nested context, torch's setter
    called directly, autocast turned off inside the context, or another
    thread (autocast state is per thread)."""
    import threading
    x, w, b = torch.rand(4, 6), torch.rand(3, 6), torch.rand(3)
    lx = fastlazy.lazy(x)
    got = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):
            _linear_under_autocast(lx, w, b)
        if change == "nested context":
            with torch.autocast("cpu", dtype=torch.float16):
                got["lazy"], got["eager"] = (_linear_under_autocast(v, w, b) for v in (lx, x))
        elif change == "setter":
            torch.set_autocast_dtype("cpu", torch.float16)
            try:
                got["lazy"], got["eager"] = (_linear_under_autocast(v, w, b) for v in (lx, x))
            finally:
                torch.set_autocast_dtype("cpu", torch.bfloat16)
        elif change == "disabled":
            torch.set_autocast_enabled("cpu", False)
            try:
                got["lazy"], got["eager"] = (_linear_under_autocast(v, w, b) for v in (lx, x))
            finally:
                torch.set_autocast_enabled("cpu", True)
        else:
            def elsewhere():
                got["lazy"], got["eager"] = (_linear_under_autocast(v, w, b) for v in (lx, x))
            thread = threading.Thread(target=elsewhere)
            thread.start()
            thread.join()
    assert got["lazy"].dtype == got["eager"].dtype != torch.bfloat16
    torch.testing.assert_close(got["lazy"].to_eager(), got["eager"])


# -- in-place writes to a pending result that no view shares: the functional
# form's signature is published under the in-place call's key, and the core
# records the write and moves the tensor onto it (generic_record.pxi
# record_inplace) --

def _band(z, x):
    z[:, 1:3] = x[:, :2]
    return z


WRITES = {
    "setitem": _band,
    "setitem_number": lambda z, x: z.__setitem__((0, slice(2, None)), 1.5) or z,
    "masked_fill_": lambda z, x: z.masked_fill_(x > 0.5, -float("inf")),
    "index_fill_": lambda z, x: z.index_fill_(1, torch.tensor([0, 3]), 2.0),
    "scatter_": lambda z, x: z.scatter_(1, torch.tensor([[0], [2], [1]]), x[:, :1]),
    "index_put_": lambda z, x: z.index_put_((torch.tensor([0, 2]),), x[:2]),
    # the causal mask's update: the view read is gone when the write comes
    "setitem_of_own_view": lambda z, x: z.__setitem__(
        (slice(None), slice(None, 2)), z[:, :2].masked_fill(x[:, :2] > 0.5, -1.0)) or z,
}


@pytest.mark.parametrize("name", list(WRITES))
def test_a_write_to_a_pending_result_is_recorded_without_python(monkeypatch, name):
    write = WRITES[name]
    x = torch.rand(3, 5)
    lx = fastlazy.lazy(x)
    for _ in range(2):
        write(lx * 2, lx)
    from fastlazy import mutation
    monkeypatch.setattr(mutation, "record_inplace",
                        lambda *a, **k: pytest.fail("went up into Python"))
    z = lx * 2
    before = hits()
    returned = write(z, lx)
    assert hits() > before
    assert returned is z
    assert type(z) is fastlazy.LazyTensor and not z.is_materialized
    torch.testing.assert_close(z.to_eager(), write(x * 2, x), rtol=0, atol=0)


@pytest.mark.parametrize("target", ["with a view", "materialized", "inference", "a view"])
def test_a_published_write_leaves_other_targets_to_the_generic_path(target):
    """The same call on a target the core may not write by itself -- a base
    of a live view, a computed value, an inference tensor, a view -- goes up
    to the generic path, which keeps eager's semantics: the view sees the
    write, the value is not written in place, an inference tensor is
    refused outside inference mode, a view's root sees the write."""
    x = torch.rand(3, 5)
    lx = fastlazy.lazy(x)
    for _ in range(3):
        _band(lx * 2, lx)                   # published
    ez = x * 2
    if target == "with a view":
        z = lx * 2
        v = z[1]
        _band(z, lx)
        _band(ez, x)
        assert torch.equal(v.to_eager(), ez[1])
    elif target == "materialized":
        value = x * 2
        z = fastlazy.lazy(value)
        _band(z, lx)
        _band(ez, x)
        assert torch.equal(value, x * 2)     # the tensor it was made from
    elif target == "inference":
        with torch.inference_mode():
            z = lx * 2
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            _band(z, lx)
        return
    else:
        root = lx * 2
        z = root[:, 1:]
        _band(z, lx)
        eroot = x * 2
        _band(eroot[:, 1:], x)
        assert torch.equal(root.to_eager(), eroot)
        ez = eroot[:, 1:]
    assert torch.equal(z.to_eager(), ez)


def test_a_published_write_in_training_gives_eagers_gradients():
    """A write to a pending result that requires grad (the pending result
    of a leaf's op): recorded by the core from the third call on, with
    eager's gradients."""
    w0 = torch.rand(3, 5)
    for k in range(4):
        w = fastlazy.lazy(w0.clone()).requires_grad_()
        h = w * 2
        h[:, 1:3] = w[:, :2] ** 2
        (h * h).sum().backward()
    ew = w0.clone().requires_grad_()
    eh = ew * 2
    eh[:, 1:3] = ew[:, :2] ** 2
    (eh * eh).sum().backward()
    torch.testing.assert_close(w.grad.to_eager() if isinstance(w.grad, fastlazy.LazyTensor)
                               else w.grad, ew.grad, rtol=0, atol=0)
