"""A LazyTensor is accepted where libraries expect a torch.Tensor:
isinstance and torch.is_tensor answer True, while type() stays LazyTensor,
and what that promise implies works without computing the value."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import LazyTensor

pytestmark = pytest.mark.usefixtures("lazy_on")


def test_isinstance_and_is_tensor_answer_true():
    x = fastlazy.lazy(torch.rand(2, 3)) + 1
    assert isinstance(x, torch.Tensor)
    assert torch.is_tensor(x)
    assert type(x) is LazyTensor
    assert isinstance(x, LazyTensor)
    assert not isinstance(x, torch.nn.Parameter)
    assert fastlazy.metrics.counters()["flushes"] == 0        # nothing computed


def test_code_that_checks_isinstance_then_calls_methods():
    def normalize(t):
        if not isinstance(t, torch.Tensor):
            raise TypeError("expected a tensor")
        return (t - t.mean(-1, keepdim=True)) / t.std(-1, keepdim=True)

    a = torch.rand(4, 5)
    got = normalize(fastlazy.lazy(a))
    assert type(got) is LazyTensor
    torch.testing.assert_close(got.to_eager(), normalize(a))


METADATA = ("is_nested", "layout", "is_sparse", "is_sparse_csr", "is_quantized", "is_meta",
            "is_mkldnn", "is_cpu", "is_cuda", "itemsize", "nbytes", "is_leaf", "dtype",
            "shape", "ndim", "device", "requires_grad")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", METADATA)
def test_metadata_reads_do_not_compute(name, grad):
    """Every metadata attribute of a pending result is eager's, and reading
    it runs nothing (nn.MultiheadAttention reads is_nested each call)."""
    a, w = torch.rand(2, 3), torch.rand(3, requires_grad=grad)
    pending = fastlazy.lazy(a) * w
    got = getattr(pending, name)
    assert fastlazy.metrics.counters()["flushes"] == 0
    assert got == getattr(a * w, name)


@pytest.mark.parametrize("grad", [False, True])
def test_grad_fn_of_a_pending_result(grad):
    a, w = torch.rand(2, 3), torch.rand(3, requires_grad=grad)
    pending = fastlazy.lazy(a) * w
    got = pending.grad_fn
    assert type(got) is type((a * w).grad_fn)
    # without autograd there is nothing to compute
    assert fastlazy.metrics.counters()["flushes"] == (1 if grad else 0)


def test_multihead_attention_records_one_graph():
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.rand(2, 5, 16)
    with torch.no_grad():
        expected = mha(x, x, x, need_weights=False)[0]
        lx = fastlazy.lazy(x) * 1             # pending, as inside a model
        fastlazy.metrics.reset()
        out = mha(lx, lx, lx, need_weights=False)[0]
        assert fastlazy.metrics.counters()["flushes"] == 0
        torch.testing.assert_close(out.to_eager(), expected)
    assert fastlazy.metrics.counters()["flushes"] == 1


def test_reads_that_split_the_program_are_named_by_line():
    x = fastlazy.lazy(torch.rand(3))
    y = x * 2
    if y.sum() > -1:          # a read: computes the graph here
        z = y + 1
    fastlazy.mark_step()      # not a split: asked for
    text = fastlazy.explain()
    assert "graphs computed before mark_step()" in text
    assert f"test_tensor_compat.py:{_line_of('if y.sum() > -1')}" in text
    assert "<unknown>" not in fastlazy.metrics.report()
    del z


def _line_of(snippet):
    import inspect
    source, start = inspect.getsourcelines(test_reads_that_split_the_program_are_named_by_line)
    return start + next(i for i, line in enumerate(source) if snippet in line)


def test_copies_pickles_and_checkpoints():
    import copy
    import io
    import pickle

    a = torch.rand(2, 3)
    x = fastlazy.lazy(a) * 2
    deep = copy.deepcopy(x)
    assert type(deep) is LazyTensor and torch.equal(deep.to_eager(), a * 2)
    assert deep.to_eager() is not x.to_eager()              # a copy of the value
    assert torch.equal(copy.copy(x).to_eager(), a * 2)
    assert torch.equal(pickle.loads(pickle.dumps(x)), a * 2)  # saved as its value
    buffer = io.BytesIO()
    torch.save({"w": x}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)                # weights_only=True, torch's default
    assert type(loaded["w"]) is torch.Tensor and torch.equal(loaded["w"], a * 2)


def test_module_buffers_and_state_dict_take_lazy_tensors():
    module = torch.nn.Module()
    module.register_buffer("scale", fastlazy.lazy(torch.rand(3)) + 1)
    assert type(module.scale) is LazyTensor
    state = module.state_dict()
    assert torch.equal(state["scale"].to_eager(), module.scale.to_eager())
    other = torch.nn.Module()
    other.register_buffer("scale", torch.zeros(3))
    other.load_state_dict(state)
    assert torch.equal(other.scale, module.scale.to_eager())


@pytest.mark.parametrize("call", [
    lambda t: torch.Tensor.size(t), lambda t: torch.Tensor.size(t, 1),
    lambda t: torch.Tensor.dim(t), lambda t: torch.Tensor.numel(t),
    lambda t: torch.Tensor.is_floating_point(t), lambda t: torch.Tensor.element_size(t)],
    ids=["size", "size(1)", "dim", "numel", "is_floating_point", "element_size"])
def test_unbound_metadata_methods_answer_without_computing(call):
    a = torch.rand(2, 3)
    assert call(fastlazy.lazy(a) * 2) == call(a * 2)
    assert fastlazy.metrics.counters()["flushes"] == 0


_CONTIGUOUS, _CHANNELS_LAST = torch.contiguous_format, torch.channels_last
LAYOUT_CASES = {     # (the input's memory format, the calls)
    "elementwise": (_CONTIGUOUS, lambda t: t * 2 + 1),
    "transposed view": (_CONTIGUOUS, lambda t: (t * 2).transpose(0, 2)),
    "slice": (_CONTIGUOUS, lambda t: (t + 1)[:, 1:3]),
    "channels last": (_CHANNELS_LAST, lambda t: (t * 2).relu()),
    "matmul": (_CONTIGUOUS, lambda t: t @ t.transpose(-1, -2)),
    # generic calls (no C rule): as the real run of the signature's first
    # call laid the result out, its operands laid out alike
    "generic": (_CONTIGUOUS, lambda t: torch.flip(t * 2, [0])),
    "generic of a generic": (_CONTIGUOUS, lambda t: torch.flip(F.pad(t * 2, (1, 1)), [1])),
    "generic reshape copy": (_CONTIGUOUS, lambda t: (t * 2).transpose(1, 2).reshape(2, 12, 5)),
    "generic, column-major result": (_CONTIGUOUS, lambda t: torch.linalg.inv(
        (t * 2).reshape(30, 2, 2) + torch.eye(2))),
    "generic with an eager operand": (_CONTIGUOUS,
                                      lambda t: (t + 1).index_select(1, torch.tensor([0, 2]))),
    # operands that are views no tensor holds any more (laid out as their
    # programs lay them out on meta tensors)
    "generic of a transposed view": (_CONTIGUOUS,
                                     lambda t: F.pad((t * 2).transpose(0, 2), (1, 1))),
    "generic of a permuted view": (_CONTIGUOUS, lambda t: (t + 1).permute(3, 2, 1, 0)
                                   .index_select(0, torch.tensor([0, 2]))),
    "generic of an expanded slice": (_CONTIGUOUS, lambda t: torch.roll(
        (t * 2)[:, :1].expand(2, 3, 4, 5), 1, 0)),
    "elementwise of a permuted view": (_CONTIGUOUS, lambda t: (t * 2).permute(0, 2, 1, 3) * 3),
}
LAYOUT_QUERIES = {
    "stride()": lambda t: t.stride(), "stride(-1)": lambda t: t.stride(-1),
    "is_contiguous()": lambda t: t.is_contiguous(),
    "is_contiguous(channels_last)":
        lambda t: t.is_contiguous(memory_format=torch.channels_last),
}


@pytest.mark.parametrize("query", LAYOUT_QUERIES.values(), ids=LAYOUT_QUERIES.keys())
@pytest.mark.parametrize("case", LAYOUT_CASES.values(), ids=LAYOUT_CASES.keys())
def test_layout_queries_are_eagers_without_computing(case, query):
    """x.stride() and x.is_contiguous() of a pending result whose layout its
    producers tell (libraries ask before .contiguous(), Longformer's
    chunking reads strides): eager's answer, and the graph does not run."""
    memory_format, calls = case
    a = torch.rand(2, 3, 4, 5).contiguous(memory_format=memory_format)
    pending = calls(fastlazy.lazy(a))
    assert query(pending) == query(calls(a))
    assert fastlazy.metrics.counters()["flushes"] == 0
    assert fastlazy.metrics.counters()["fallbacks"] == 0


def test_layout_queries_take_eagers_errors_and_unknown_layouts():
    a = torch.rand(2, 3)
    pending = fastlazy.lazy(a) * 2
    with pytest.raises(IndexError, match="Dimension out of range"):
        pending.stride(2)
    with pytest.raises(IndexError, match="Dimension out of range"):
        (a * 2).stride(2)
    # a generic call too large for a real run of its signature: its value
    # answers (a fake kernel's strides are not taken for eager's)
    large = torch.rand(1025, 1024)
    unknown = torch.flip(fastlazy.lazy(large), [0])
    assert unknown.stride() == torch.flip(large, [0]).stride()
    assert fastlazy.metrics.counters()["flushes"] == 1


@pytest.mark.parametrize("call", [
    lambda t: torch.Tensor.item(t.sum()), lambda t: torch.Tensor.tolist(t),
    lambda t: torch.Tensor.stride(t), lambda t: torch.Tensor.is_contiguous(t),
    lambda t: torch.Tensor.add(t, 1), lambda t: torch.Tensor.nonzero(t),
    lambda t: torch.Tensor.cpu(t), lambda t: torch.Tensor.type(t),
    lambda t: torch.Tensor.sum(t, 0), lambda t: torch.Tensor.argmax(t)],
    ids=["item", "tolist", "stride", "is_contiguous", "add", "nonzero", "cpu", "type",
         "sum", "argmax"])
def test_unbound_tensor_methods_take_a_lazy_tensor(call):
    a = torch.rand(2, 3)
    got, want = call(fastlazy.lazy(a) * 2), call(a * 2)
    if type(got) is LazyTensor:
        got = got.to_eager()
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    else:
        assert got == want


def test_attributes_of_its_own_as_an_eager_tensor_takes():
    """torch._dynamo.mark_static_address sets one (HuggingFace's recurrent
    caches: Mamba, Mamba2, Jamba); each tensor has its own, and setting,
    reading or deleting one computes nothing."""
    x = fastlazy.lazy(torch.ones(3)) * 2
    y = fastlazy.lazy(torch.ones(3)) * 3
    torch._dynamo.mark_static_address(x)
    assert x._dynamo_static_input_type == "unguarded"
    assert getattr(y, "_dynamo_static_input_type", None) is None
    x.tag = [1]
    y.tag = [2]
    assert (x.tag, y.tag) == ([1], [2])
    del x.tag
    with pytest.raises(AttributeError):
        x.tag
    with pytest.raises(AttributeError):
        del x.tag
    with pytest.raises(AttributeError):
        x.shape = (3,)                 # eager's own refusal of a read-only attribute
    assert fastlazy.metrics.counters()["flushes"] == 0
    assert torch.equal(x.to_eager(), torch.full((3,), 2.0))


def test_requires_grad_assignment_is_eagers():
    x = fastlazy.lazy(torch.ones(3))
    x.requires_grad = True
    assert x.requires_grad and (x * 2).requires_grad
    with pytest.raises(RuntimeError, match="must be a bool"):
        x.requires_grad = 1
    with pytest.raises(RuntimeError, match="leaf variables"):
        (x * 2).requires_grad = False


def test_data_assignment_keeps_a_leaf_and_its_grad_as_eager_does():
    def run(lz):
        p = lz(torch.tensor([1., 2., 3.])).requires_grad_()
        (p * p).sum().backward()
        p.data = torch.full((3,), 5.0)
        (p * 1).sum().backward()
        return p.detach(), p.is_leaf, p.grad

    want, got = run(lambda t: t), run(fastlazy.lazy)
    assert torch.equal(got[0].to_eager(), want[0]) and got[1] == want[1]
    assert torch.equal(got[2], want[2])                 # [2, 4, 6] + 1
    with pytest.raises(RuntimeError, match="live views"):
        x = fastlazy.lazy(torch.ones(3))
        view = x[1:]
        x.data = torch.zeros(3)
    del view


def test_deepcopy_keeps_the_attributes():
    import copy
    x = fastlazy.lazy(torch.ones(2)) * 2
    x.tag = {"k": [1]}
    y = copy.deepcopy(x)
    assert y.tag == {"k": [1]} and y.tag is not x.tag
    assert torch.equal(y.to_eager(), x.to_eager())
