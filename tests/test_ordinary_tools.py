"""Ordinary tools given a LazyTensor answer as they answer for the eager
tensor it stands for (issue 17, item 4)."""
import copy
import io
import warnings

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from torch.utils.data import default_collate

import fastlazy
from fastlazy import LazyTensor
from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable())


def pair():
    t = torch.rand(2, 3)
    return t, fastlazy.lazy(t)


def test_assert_close_and_default_collate():
    t, x = pair()
    torch.testing.assert_close(x, x)
    torch.testing.assert_close(x * 2, t * 2)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        torch.testing.assert_close(x, t + 1)
    batch = default_collate([x, x * 2])
    assert torch.equal(batch.to_eager() if type(batch) is LazyTensor else batch,
                       default_collate([t, t * 2]))


def test_torch_tensor_copies_the_value_with_eagers_warning():
    t, x = pair()
    with warnings.catch_warnings(record=True) as eager_w:
        warnings.simplefilter("always")
        expected = torch.tensor(t)
    with warnings.catch_warnings(record=True) as lazy_w:
        warnings.simplefilter("always")
        got = torch.tensor(x * 1)
    assert type(got) is torch.Tensor and torch.equal(got, expected)
    assert [str(w.message) for w in lazy_w] == [str(w.message) for w in eager_w]
    assert "To copy construct from a tensor" in str(lazy_w[0].message)
    assert lazy_w[0].filename == __file__            # the caller's line, as eager's
    assert torch.equal(torch.tensor([x[0, 0], x[1, 2]]), torch.tensor([t[0, 0], t[1, 2]]))
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([x[0], x[1]])                  # eager's own error
    assert torch.tensor(x, dtype=torch.float64).dtype == torch.float64


def test_as_tensor_and_asarray_return_the_tensor_itself():
    t, x = pair()
    assert torch.as_tensor(x) is x and torch.asarray(x) is x
    cast = torch.as_tensor(x, dtype=torch.float64)
    assert type(cast) is LazyTensor and torch.equal(cast.to_eager(), t.double())
    copied = torch.asarray(x, copy=True)
    assert torch.equal(copied, t)


def test_parameter_and_buffer_of_a_lazy_tensor_hold_its_value():
    t, x = pair()
    p = torch.nn.Parameter(x * 2)
    assert type(p) is torch.nn.Parameter and p.requires_grad and p.is_leaf
    assert torch.equal(p.detach(), t * 2)
    q = torch.nn.Parameter(x, requires_grad=False)
    assert not q.requires_grad
    b = torch.nn.Buffer(x)
    assert type(b) is not LazyTensor and torch.equal(b, t)
    module = torch.nn.Linear(3, 2)
    module.weight = torch.nn.Parameter(fastlazy.lazy(torch.ones(2, 3)))
    torch.optim.SGD(module.parameters(), lr=0.1)     # takes it: a leaf


def test_torch_load_with_weights_only_of_a_saved_lazy_tensor():
    t, x = pair()
    buffer = io.BytesIO()
    torch.save({"x": x * 2}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["x"]) is torch.Tensor and torch.equal(loaded["x"], t * 2)


NUMPY_CASES = {
    "x + ndarray": lambda x: x + np.ones((2, 3)),
    "x * ndarray": lambda x: x * np.ones((2, 3)),
    "x - ndarray row": lambda x: x - np.ones(3),
    "x == ndarray": lambda x: x == np.ones((2, 3)),
    "np.float64 * x": lambda x: np.float64(2) * x,
    "x * np.float64": lambda x: x * np.float64(2),
    "np.float32 + x": lambda x: np.float32(2) + x,
    "np.int64 * x": lambda x: np.int64(2) * x,
    "ndarray + x": lambda x: np.ones((2, 3)) + x,
    "ndarray * x": lambda x: np.ones((2, 3)) * x,
}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", NUMPY_CASES)
def test_numpy_operands_give_what_eager_gives(case):
    """A Tensor (not an ndarray) of eager's dtype, or eager's exception."""
    t, x = pair()
    f = NUMPY_CASES[case]
    try:
        expected = f(t)
    except TypeError as exc:
        with pytest.raises(TypeError, match=str(exc)[:20]):
            f(x)
        return
    got = f(x)
    assert isinstance(got, torch.Tensor) and not isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype
    assert torch.equal(got.to_eager() if type(got) is LazyTensor else got, expected)


def test_enabled_is_a_truth_value_and_a_context_manager():
    assert fastlazy.enabled() and fastlazy.enabled() == True  # noqa: E712
    fastlazy.disable()
    try:
        state = fastlazy.enabled()
        assert not state and repr(state) == "False"
        with fastlazy.enabled():
            assert fastlazy.enabled()
            assert type(torch.rand(2).to("lazy")) is LazyTensor
        assert not fastlazy.enabled()
        assert not state                  # a snapshot, not the live state
    finally:
        fastlazy.enable()


def test_enable_says_what_it_returned():
    text = repr(fastlazy.enable())
    assert "fastlazy enabled" in text and "fastlazy.disable()" in text
    assert "object at" not in text


def _scaled_sine(t):
    return t.sin() * 2 + 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_function_runs_on_the_values(how):
    """A ScriptFunction hands its arguments to its graph without asking
    __torch_function__: it read a LazyTensor as an empty meta tensor."""
    t, x = pair()
    scripted = (torch.jit.script(_scaled_sine) if how == "script"
                else torch.jit.trace(_scaled_sine, (t,)))
    got = scripted(x * 3)
    assert type(got) is LazyTensor
    torch.testing.assert_close(got.to_eager(), _scaled_sine(t * 3))
    torch.testing.assert_close(scripted(t), _scaled_sine(t))     # eager calls as before


class _Tagged(torch.Tensor):
    pass


def test_make_subclass_of_a_lazy_tensor_holds_its_value():
    t, x = pair()
    sub = torch.Tensor._make_subclass(_Tagged, x * 2)
    assert type(sub) is _Tagged
    torch.testing.assert_close(torch.Tensor(sub), t * 2)


def test_cpp_code_computing_on_a_lazy_tensor_raises_instead_of_a_wrong_value(monkeypatch):
    """Where torch's C++ reads a LazyTensor as a tensor without asking
    __torch_function__ (the ScriptFunction call, had fastlazy not wrapped
    it), computing with it raises: never an empty result."""
    from fastlazy import value_calls
    call = value_calls.torch._C.ScriptFunction.__call__
    scripted = torch.jit.script(_scaled_sine)
    _, x = pair()
    monkeypatch.setattr(torch._C.ScriptFunction, "__call__", call.__wrapped__)
    # (the TorchScript interpreter re-raises it without its message)
    with pytest.raises(RuntimeError):
        scripted(x)


def test_as_subclass_of_a_lazy_tensor_is_the_subclass():
    """x.as_subclass(cls) (torchvision's tv_tensors wrap tensors so) gives
    a cls, as eager does, holding the value: a LazyTensor would lose the
    type its caller asked for."""
    t, x = pair()
    sub = (x * 2).as_subclass(_Tagged)
    assert type(sub) is _Tagged
    torch.testing.assert_close(torch.Tensor(sub), t * 2)


class _Doubling(torch.Tensor):
    """A tensor type whose __torch_function__ doubles every tensor result."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            return a.as_subclass(torch.Tensor) if isinstance(a, _Doubling) else a
        out = func(*map(plain, args), **{k: plain(v) for k, v in (kwargs or {}).items()})
        return out * 2 if isinstance(out, torch.Tensor) else out


class _Unwrapped(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl


@pytest.mark.parametrize("call", [
    lambda s, x: torch.add(s, x), lambda s, x: torch.add(x, s), lambda s, x: s * x,
    lambda s, x: x * s, lambda s, x: x.mul(s), lambda s, x: torch.where(x > 1, s, x),
    lambda s, x: torch.nn.functional.linear(x, s), lambda s, x: x.add(other=s, alpha=2)],
    ids=["add", "add_lazy_first", "mul", "rmul", "method", "where", "linear", "keyword"])
@pytest.mark.parametrize("cls", [_Doubling, _Tagged, _Unwrapped])
def test_a_tensor_subclass_beside_a_lazy_tensor_gets_its_torch_function(call, cls):
    # eager calls the subclass's __torch_function__ first; a LazyTensor,
    # like a plain tensor, takes no part in the dispatch
    t = torch.arange(9.0).view(3, 3)
    s = (torch.arange(9.0).view(3, 3) / 4).as_subclass(cls)
    want = call(s, t)
    got = call(s, fastlazy.lazy(t))
    value = got.to_eager() if type(got) is LazyTensor else got
    assert torch.equal(value.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
    assert type(got) is (LazyTensor if type(want) is torch.Tensor else type(want))


def test_a_compiled_function_called_with_lazy_tensors_runs_as_written():
    # dynamo does not trace a LazyTensor (nor fastlazy's own files): the
    # compiled function's graph breaks, and its calls record lazily
    torch._dynamo.reset()

    @torch.compile(backend="eager")
    def f(x, w):
        # (cummax: a generic call, whose first signature is analysed)
        return torch.cummax(torch.nn.functional.gelu(x @ w), -1).values.sum(-1) + 1

    t, w = torch.rand(3, 4), torch.rand(4, 13)
    got = f(fastlazy.lazy(t), w)
    assert type(got) is LazyTensor
    assert torch.equal(got.to_eager(), f(t, w))
    assert torch.equal(f(t, w), torch.cummax(torch.nn.functional.gelu(t @ w), -1).values.sum(-1) + 1)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_compiled_function_calls_a_lazy_tensors_methods_as_written(backend):
    # a LazyTensor's methods and attributes (x.view, x.shape): dynamo
    # leaves each frame that meets one to Python, which records lazily
    torch._dynamo.reset()

    def f(x):
        b, c = x.shape
        return x.view(-1).softmax(-1).reshape(b * c).sin_() * x.size(0)

    compiled = torch.compile(f, backend=backend)
    t = torch.rand(4, 5)
    got = compiled(fastlazy.lazy(t))
    assert type(got) is LazyTensor
    assert torch.equal(got.to_eager(), f(t))
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(10, 2))
    compiled_net = torch.compile(copy.deepcopy(net), backend=backend)
    got = compiled_net(fastlazy.lazy(t.view(2, 2, 5)))
    assert type(got) is LazyTensor
    assert torch.equal(got.to_eager(), net(t.view(2, 2, 5)))


def test_a_compiled_module_trains_on_lazy_tensors_as_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.manual_seed(0)
    lazy = torch.compile(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                             torch.nn.Linear(8, 2)), backend="eager")
    x = torch.rand(5, 4)
    for model, inp in ((eager, x), (lazy, fastlazy.lazy(x))):
        model(inp).square().mean().backward()
    for a, b in zip(eager.parameters(), lazy.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_a_compiled_call_with_a_lazy_tensor_leaves_other_compiles_compiled():
    """The call with a LazyTensor runs uncompiled, that call alone: dynamo
    had skipped the code of every frame that met one for good, so every
    other compiled nn.Linear (the same forward) ran uncompiled too, and
    with fullgraph=True raised."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    t = torch.rand(2, 3)
    first = torch.nn.Linear(3, 3)
    got = torch.compile(first, backend=counter)(fastlazy.lazy(t))
    assert type(got) is LazyTensor and counter.frame_count == 0
    assert torch.equal(got.to_eager(), first(t))
    other = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    compiled = torch.compile(other, backend=counter, fullgraph=True)
    assert torch.equal(compiled(t), other(t))
    assert counter.frame_count == 1
    # the same module compiled without fullgraph (which a LazyTensor call
    # refuses, as documented), given a LazyTensor, then eager tensors again
    loose = torch.compile(other, backend=counter)
    got = loose(fastlazy.lazy(t))
    assert type(got) is LazyTensor and torch.equal(got.to_eager(), other(t))
    assert torch.equal(compiled(t), other(t)) and torch.equal(loose(t), other(t))
    assert counter.frame_count == 1


def test_torch_compile_of_eager_code_traces_through_the_entry_points():
    # enable() replaced torch's functions with its entry points: dynamo
    # traces the original behind each, in one graph, as without fastlazy
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))

    def f(x):
        return torch.ops.aten.sin(model(x)) + torch.nn.functional.softplus(x).sum()

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.rand(3, 4)
    assert torch.equal(compiled(x), f(x))


def test_torch_compile_of_eager_code_traces_through_the_guards():
    # torch's constructors and factories, the functional checks' gates and
    # Tensor.grad stand behind fastlazy's guards while it is enabled:
    # dynamo traces the original behind each, in one graph
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.rand(4))
    p.grad = torch.ones(4)

    def f(x):
        y = torch.nn.functional.softmax(x, -1) + torch.zeros(4) + torch.arange(4)
        y = y * p.grad + torch.tensor([1.0, 2.0, 3.0, 4.0])
        return torch.nn.functional.layer_norm(y, (4,)) + torch.full((4,), 2.0)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    x = torch.rand(4)
    assert torch.equal(compiled(x), f(x))


def _value(t):
    return t.to_eager() if type(t) is LazyTensor else t


def test_forward_mode_transforms_of_lazy_tensors_give_eagers_values():
    """torch.func.jvp and jacfwd pair a LazyTensor's value with its tangent
    (a dual made of the LazyTensor itself was an empty meta stand-in: jvp
    returned empty tensors); forward_ad.make_dual likewise."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import jacfwd, jvp
    x, v, w = torch.randn(4), torch.randn(4), torch.randn(4)
    f = lambda a: (a.sin() * w).exp()      # noqa: E731
    want = jvp(f, (x,), (v,))
    for primal, tangent in ((fastlazy.lazy(x), fastlazy.lazy(v)), (fastlazy.lazy(x), v),
                            (x, fastlazy.lazy(v))):
        got = jvp(f, (primal,), (tangent,))
        for g, e in zip(got, want):
            assert g.shape == e.shape
            torch.testing.assert_close(_value(g), e)
    torch.testing.assert_close(_value(jacfwd(f)(fastlazy.lazy(x))), jacfwd(f)(x))
    captured = fastlazy.lazy(w)
    torch.testing.assert_close(_value(jvp(lambda a: a * captured, (x,), (v,))[1]), v * w)
    with fwAD.dual_level():
        dual = fwAD.make_dual(fastlazy.lazy(x), fastlazy.lazy(v))
        tangent = fwAD.unpack_dual(dual.sin()).tangent
    torch.testing.assert_close(_value(tangent), x.cos() * v)


def test_linearize_of_a_lazy_tensor_gives_eagers_linear_function():
    """linearize traces jvp with make_fx; handed LazyTensor tangents, the
    trace saw none of their ops and its linear function returned garbage."""
    from torch.func import linearize      # (bound however the user imports it)
    x, v = torch.randn(4), torch.randn(4)
    out, linear = linearize(torch.sin, fastlazy.lazy(x))
    torch.testing.assert_close(_value(out), x.sin())
    for tangent in (fastlazy.lazy(v), v):
        torch.testing.assert_close(_value(linear(tangent)), x.cos() * v)


@pytest.mark.parametrize("make", [
    lambda t, d: torch.zeros_like(t, device=d), lambda t, d: torch.empty_like(t, device=d),
    lambda t, d: torch.full_like(t, 2.0, device=d), lambda t, d: t.new_zeros(2, device=d),
    lambda t, d: t.new_ones((2, 3), device=d), lambda t, d: t.new_empty(4, device=d)])
def test_a_like_or_new_tensor_on_the_meta_device_is_eagers_meta_tensor(make):
    """A meta tensor has no value to compute: made from a LazyTensor it is
    eager's meta tensor (it was a LazyTensor reporting the cpu device,
    whose sums with cpu tensors were taken where eager raises)."""
    t, x = pair()
    for device in ("meta", torch.device("meta"), "cpu", "meta"):
        want, got = make(t, device), make(x, device)
        assert got.device == want.device and got.shape == want.shape
        assert type(got) is (torch.Tensor if want.is_meta else LazyTensor)
    with pytest.raises(RuntimeError):
        make(x, "meta") + torch.ones(2, 3)


def test_grad_of_a_pending_lazy_tensor_gives_eagers_gradient():
    """torch.func.grad took a LazyTensor's value inside its level, where a
    pending one's graph ran wrapped at that level: functorch's internal
    assert (TensorWrapper.cpp)."""
    from torch.func import grad, grad_and_value
    x, w = torch.randn(4), torch.randn(4)
    f = lambda a, b: (a.sin() * b).sum()      # noqa: E731
    want = grad_and_value(f, argnums=(0, 1))(x * 2, w)
    for args in ((fastlazy.lazy(x) * 2, w), (fastlazy.lazy(x) * 2, fastlazy.lazy(w) + 0)):
        (ga, gb), value = grad_and_value(f, argnums=(0, 1))(*args)
        for got, expected in ((ga, want[0][0]), (gb, want[0][1]), (value, want[1])):
            torch.testing.assert_close(_value(got), expected)
        torch.testing.assert_close(_value(grad(f)(*args)), want[0][0])
