"""Eager operands' metadata read by the C++ reader (csrc/tensor_facts.h,
installed from the step executor's extension) and by torch's getters (its
fallback): both give eager's results, through a C rule and through the
generic path's flat keys, for every layout, dtype and kind of tensor an
eager operand may be."""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import fastlazy
from fastlazy import _core, step_executor

pytestmark = pytest.mark.usefixtures("lazy_on")


@pytest.fixture(params=["c++", "getters"])
def reader(request):
    if request.param == "c++" and not step_executor.available():
        pytest.skip(f"the step executor's extension is {step_executor.why_not()}")
    _core.set_tensor_reader(step_executor.tensor_reader() if request.param == "c++" else None)
    yield request.param
    _core.set_tensor_reader(step_executor.tensor_reader())


def test_the_reader_comes_with_the_executor():
    assert _core.tensor_reader_installed() == step_executor.available()


def _inference():
    with torch.inference_mode():
        return torch.randn(3, 4)


EAGER = {
    "contiguous": lambda: torch.randn(3, 4),
    "0-dim": lambda: torch.tensor(2.5),
    "transposed": lambda: torch.randn(4, 3).t(),
    "expanded": lambda: torch.randn(1, 4).expand(3, 4),
    "offset slice": lambda: torch.randn(5, 9)[1:4, ::2][:, :4],
    "empty": lambda: torch.randn(0, 4),
    "int64": lambda: torch.arange(12).reshape(3, 4),
    "float64": lambda: torch.randn(3, 4, dtype=torch.float64),
    "bool": lambda: torch.rand(3, 4) > 0.5,
    # (every dtype the rules cover: the reader reports c10's number for it,
    # which the core maps to its own code)
    "uint8": lambda: torch.arange(12, dtype=torch.uint8).reshape(3, 4),
    "int8": lambda: torch.arange(12, dtype=torch.int8).reshape(3, 4),
    "int16": lambda: torch.arange(12, dtype=torch.int16).reshape(3, 4),
    "int32": lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4),
    "float16": lambda: torch.randn(3, 4).half(),
    "bfloat16": lambda: torch.randn(3, 4).bfloat16(),
    "complex64": lambda: torch.randn(3, 4, dtype=torch.complex64),
    "complex128": lambda: torch.randn(3, 4, dtype=torch.complex128),
    "parameter": lambda: nn.Parameter(torch.randn(3, 4)),
    "frozen parameter": lambda: nn.Parameter(torch.randn(3, 4), requires_grad=False),
    "requires grad": lambda: torch.randn(3, 4, requires_grad=True),
    "inference": _inference,
    "8 dims": lambda: torch.randn(1, 1, 1, 1, 1, 1, 3, 4),
    "9 dims": lambda: torch.randn(1, 1, 1, 1, 1, 1, 1, 3, 4),
    "float8": lambda: torch.randn(3, 4).to(torch.float8_e4m3fn),
    "uint16": lambda: torch.arange(12).reshape(3, 4).to(torch.uint16),
    "complex32": lambda: torch.randn(3, 4, dtype=torch.complex64).to(torch.complex32),
    "meta": lambda: torch.empty(3, 4, device="meta"),
    "sparse": lambda: torch.randn(3, 4).to_sparse(),
}


def _outcome(fn):
    """fn()'s result, or the type of what it raised.  A LazyTensor's
    metadata is read before its value: it is what the reader told."""
    try:
        out = fn()
    except Exception as exc:                  # (the type is what is compared)
        return type(exc)
    if type(out) is fastlazy.LazyTensor:
        told = _metadata(out)
        out = out.to_eager()
        assert told == _metadata(out)
    return out


def _metadata(t):
    return t.shape, t.dtype, t.device, t.requires_grad


def _assert_same(got, want):
    if isinstance(want, type):
        assert got is want
        return
    assert not isinstance(got, type), got
    assert _metadata(got) == _metadata(want)
    if want.device.type == "meta":
        return
    if want.is_sparse:
        got, want = got.to_dense(), want.to_dense()
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("name", list(EAGER))
@pytest.mark.parametrize("call", ["add (C rule)", "where (generic)"])
def test_an_eager_operand_gives_eagers_result(reader, name, call):
    """The same call three times (the generic path's later two are hits
    found by the flat key, read off the eager operand each time)."""
    e = EAGER[name]()
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    if call.startswith("add"):
        def run(a):
            return a + e
    else:
        def run(a):
            return torch.where(a > 0, a, e)
    want = _outcome(lambda: run(x))
    for _ in range(3):
        _assert_same(_outcome(lambda: run(fastlazy.lazy(x))), want)


@pytest.mark.parametrize("name", ["contiguous", "0-dim", "transposed", "int64", "parameter",
                                  "requires grad", "inference", "8 dims"])
def test_a_wrapped_eager_tensor_keeps_its_metadata(reader, name):
    e = EAGER[name]()
    assert _metadata(fastlazy.lazy(e)) == _metadata(e)


@pytest.mark.parametrize("name", list(EAGER))
def test_the_flat_key_reads_what_torch_says(reader, name):
    e = EAGER[name]()
    keyed = (e.layout is torch.strided and e.device.type == "cpu" and e.dim() <= 8
             and e.dtype not in (torch.float8_e4m3fn, torch.uint16))
    want = (e.dtype, tuple(e.shape), e.stride(), 0, e.requires_grad) if keyed else None
    assert _core.eager_operand_facts(e) == want


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_flat_key_reads_any_view_as_torch_does(data):
    """Views of every placement (hypothesis draws sizes, a permutation,
    steps and offsets), both readers."""
    ndim = data.draw(st.integers(0, 5))
    sizes = data.draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    base = torch.randn([2 * n + 2 for n in sizes])
    index = tuple(slice(data.draw(st.integers(0, 1)), None, data.draw(st.integers(1, 2)))
                  for _ in sizes)
    view = base[index]
    view = view[tuple(slice(0, n) for n in sizes)]
    view = view.permute(data.draw(st.permutations(range(ndim))))
    if ndim and data.draw(st.booleans()):
        view = view.unsqueeze(0).expand(3, *view.shape)
    want = (view.dtype, tuple(view.shape), view.stride(), 0, False)
    for capsule in (step_executor.tensor_reader(), None):
        _core.set_tensor_reader(capsule)
        try:
            assert _core.eager_operand_facts(view) == want
        finally:
            _core.set_tensor_reader(step_executor.tensor_reader())


def test_a_changed_operand_is_read_again_at_every_hit(reader):
    """The reader keeps nothing between calls: a weight resized in place
    between two hits gives eager's result (and eager's error) each time."""
    e = torch.randn(4, 3)
    z, a = torch.zeros(1), torch.randn(2, 4)
    for _ in range(3):
        _assert_same(_outcome(lambda: torch.addmm(z, fastlazy.lazy(a), e)),
                     torch.addmm(z, a, e))
    e.resize_(4, 5).copy_(torch.randn(4, 5))
    _assert_same(_outcome(lambda: torch.addmm(z, fastlazy.lazy(a), e)), torch.addmm(z, a, e))
    e.t_()
    _assert_same(_outcome(lambda: torch.addmm(z, fastlazy.lazy(a), e)),
                 _outcome(lambda: torch.addmm(z, a, e)))



def _write_behind(e):
    """Write e in place through the unpatched method: fastlazy does not see it."""
    if e.dtype == torch.bool:
        torch.Tensor.logical_not_.__wrapped__(e)
    else:
        torch.Tensor.add_.__wrapped__(e, 1)


@pytest.mark.parametrize("call", ["linear (C rule)", "masked_fill (signature hit)"])
def test_the_version_read_with_the_metadata_is_the_tensors(reader, call):
    """Each eager operand's version counter is read with its metadata: one
    written twice before the call (version 2, not 0) is no error, one
    written behind fastlazy's back after the call is, and an inference
    tensor (it keeps no counter) is never one."""
    x = torch.randn(2, 4)
    if call.startswith("linear"):
        def run(a, e):
            return F.linear(a, e)

        def operand():
            return torch.randn(3, 4)
    else:
        def run(a, e):
            return a.masked_fill(e, 0.0)

        def operand():
            return torch.rand(2, 4) > 0.5
    for _ in range(3):                       # the generic path's hits included
        e = operand()
        _write_behind(e)
        _write_behind(e)
        assert e._version == 2
        _assert_same(_outcome(lambda: run(fastlazy.lazy(x), e)), run(x, e))
        r = run(fastlazy.lazy(x), e)
        _write_behind(e)
        with pytest.raises(RuntimeError, match="modified in place after a lazy op used it"):
            r.to_eager()
    with torch.inference_mode():
        e = operand()
    _assert_same(_outcome(lambda: run(fastlazy.lazy(x), e)), run(x, e))


# -- ShapeGuard: a compiled program's input sizes, checked in C ----------------------


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("kind", list(EAGER))
def test_a_shape_guard_matches_tensors_of_the_same_sizes_alone(reader, kind):
    """Every kind of eager tensor is told apart by its sizes alone, as
    torch.Size equality tells them: same sizes (whatever the strides,
    dtype or device) match, a size or rank more or less does not."""
    t = EAGER[kind]()
    guard = _core.ShapeGuard([t, 2.5, t])
    same = torch.empty(t.shape)
    strided = torch.empty(t.shape[::-1]).permute(tuple(reversed(range(t.dim()))))
    assert strided.shape == t.shape
    assert guard.matches((t, 2.5, t))
    assert guard.matches((same, "anything at a scalar's place", strided))
    grown = torch.empty(*t.shape[:-1], t.shape[-1] + 1) if t.dim() else torch.empty(1)
    assert not guard.matches((t, 2.5, grown))
    assert not guard.matches((same.unsqueeze(0), 2.5, t))
    assert not guard.matches((t, 2.5))                  # a shorter call
    assert not guard.matches((t, 2.5, list(t.shape)))


def test_a_shape_guard_reads_subclasses_and_rejects_non_tensors(reader):
    base = torch.randn(3, 4)
    guard = _core.ShapeGuard([base])
    assert guard.matches((base.as_subclass(_Subclass),))
    assert not guard.matches((torch.randn(4, 3).as_subclass(_Subclass),))
    assert not guard.matches((None,))
    assert not guard.matches(((3, 4),))
    assert _core.ShapeGuard([1, None]).matches((7, "x"))
    assert not _core.ShapeGuard([]).matches((base,))


_GRAD_MODES = {
    "default": lambda: torch.enable_grad(),
    "no_grad": lambda: torch.no_grad(),
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
    "inference_mode": lambda: torch.inference_mode(),
    "inference_mode(False) in no_grad": None,
}


@pytest.mark.parametrize("mode", list(_GRAD_MODES))
def test_grad_mode_is_read_as_torch_reads_it(reader, mode):
    """The rules read grad mode (C++ GradMode, or torch.is_grad_enabled) for
    every op with an operand that requires grad: a result requires grad
    exactly where eager's does, in each mode and in another thread."""
    w = nn.Parameter(torch.randn(4, 3))

    def results():
        x = torch.randn(2, 3)
        lazy = F.linear(fastlazy.lazy(x), w), F.softmax(fastlazy.lazy(x) * w[0], -1)
        return [t.requires_grad for t in lazy], [F.linear(x, w).requires_grad,
                                                 F.softmax(x * w[0], -1).requires_grad]

    def in_mode():
        if _GRAD_MODES[mode] is None:
            with torch.no_grad(), torch.inference_mode(False):
                return results()
        with _GRAD_MODES[mode]():
            return results()

    got, want = in_mode()
    assert got == want
    seen = []
    with torch.no_grad():         # (grad mode is per thread: the thread's own is read)
        t = threading.Thread(target=lambda: seen.append(results()))
        t.start()
        t.join()
    assert seen[0][0] == seen[0][1] == [True, True]


@pytest.mark.parametrize("name", ["contiguous", "0-dim", "transposed", "offset slice", "int64",
                                  "float64", "bool", "parameter", "float16", "int8"])
def test_a_write_through_another_alias_keeps_the_recorded_contents(reader, name):
    """The pending graph reads an eager tensor; an eager write through a
    different tensor object over the same memory (a .detach() alias of the
    storage) comes after the recording, so the graph's value is the one of
    the contents it was recorded with: the storage addresses compared (from
    the C++ tensor, or through torch's storage objects) must match."""
    e = EAGER[name]()
    want = e.detach().clone()
    got = fastlazy.lazy(torch.zeros((), dtype=e.dtype)) + e
    alias = e.detach()
    with torch.no_grad():
        alias.fill_(1)
    assert fastlazy.metrics.counters()["flushes"] >= 1
    assert torch.equal(got.to_eager(), want)
