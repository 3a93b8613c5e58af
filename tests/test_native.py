"""The native backend's own machinery: the one-row linear kernel (both its
AVX2 and portable versions) against eager, the cases it must leave to torch,
the buffers it keeps between calls, and the torchscript backend handing it
batch-1 graphs.  (The differential suite runs every op on the native backend
through helpers.BACKENDS.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastlazy
from fastlazy import _steps
from fastlazy._core import LazyTensor
from helpers import assert_same, run_in_threads

# every test runs on the native backend (conftest's backend fixture), with
# fastlazy enabled and its counters zeroed
pytestmark = [pytest.mark.parametrize("backend", ["native"], indirect=True),
              pytest.mark.usefixtures("backend", "lazy_on")]

ISAS = ["vector", "portable"]


@pytest.fixture(params=ISAS)
def isa(request):
    was = _steps.use_vector_kernel(request.param == "vector")
    yield request.param
    _steps.use_vector_kernel(was)


def kernel_runs(fn):
    """fn's result and how many layers the kernel computed for it."""
    before = _steps.kernel_calls()
    out = fn()
    if isinstance(out, LazyTensor):
        out = out.to_eager()
    return out, _steps.kernel_calls() - before


# (out_features, in_features): below, at and around the 8x8 vector blocks
SIZES = [(1, 1), (3, 7), (8, 8), (17, 9), (37, 19), (256, 256), (9, 300), (1000, 1000)]


@pytest.mark.parametrize("n,k", SIZES, ids=[f"{n}x{k}" for n, k in SIZES])
@pytest.mark.parametrize("act", ["relu", "none"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_one_row_matches_eager(isa, n, k, act, bias):
    torch.manual_seed(n * 1000 + k)
    x, w = torch.randn(1, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None

    def layer(x, w=w, b=b):
        y = F.linear(x, w, b)
        return F.relu(y) if act == "relu" else y
    with torch.no_grad():
        got, runs = kernel_runs(lambda: layer(fastlazy.lazy(x)))
    assert runs == 1
    within_rounding(got, layer(x), layer, x, w, b)


def within_rounding(got, want, layer, x, w, b):
    """got is eager's result up to the order of its sums: both lie within
    the classical bound of a k-term float32 dot product, (k + 1) * 2^-24
    times the sum of the absolute terms, of the float64 result.  (A relu
    after the sum moves no value further from its exact one.)"""
    assert got.dtype == want.dtype and got.shape == want.shape
    double = (lambda t: None if t is None else t.double())
    exact = layer(double(x), double(w), double(b))
    terms = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    bound = (x.shape[-1] + 1) * 2.0 ** -24 * terms
    for name, value in (("kernel", got), ("eager", want)):
        error = (value.double() - exact).abs()
        assert (error <= bound).all(), f"{name}: error {error.max()} over the bound"


@pytest.mark.parametrize("shape", [(5,), (1, 5), (1, 1, 5)], ids=str)
def test_one_row_of_any_rank(shape):
    x, w, b = torch.randn(shape), torch.randn(4, 5), torch.randn(4)
    with torch.no_grad():
        got, runs = kernel_runs(lambda: torch.relu(F.linear(fastlazy.lazy(x), w, b)))
    assert runs == 1
    assert_same(got, torch.relu(F.linear(x, w, b)))


def test_special_values_pass_through_like_eager(isa):
    x = torch.tensor([[float("nan"), 1.0, -2.0, float("inf"), 0.5, 0.0, 3.0, -1.0, 2.0]])
    w = torch.zeros(10, 9)
    w[0, 0] = 1         # row 0 sees the nan
    w[1, 3] = 1         # row 1 sees +inf
    w[2, 3] = -1        # row 2 sees -inf: relu gives 0
    w[3:, 1:3] = torch.randn(7, 2)
    with torch.no_grad():
        got, runs = kernel_runs(lambda: F.relu(F.linear(fastlazy.lazy(x), w)))
        want = F.relu(F.linear(x, w))
    assert runs == 1
    assert_same(got, want)


def _whole(x):
    return x


CASES_FOR_TORCH = {
    # the kernel takes one contiguous row of float32 and a contiguous 2-d
    # weight; (x, weight, the view of x the layer is given)
    "two rows": (lambda: torch.randn(2, 5), lambda: torch.randn(4, 5), _whole),
    "strided row": (lambda: torch.randn(1, 10), lambda: torch.randn(4, 5),
                    lambda x: x[:, ::2]),
    "transposed weight": (lambda: torch.randn(1, 5), lambda: torch.randn(5, 4).t(), _whole),
    "weight over 2^20 elements": (lambda: torch.randn(1, 1100), lambda: torch.randn(1000, 1100),
                                  _whole),
}


@pytest.mark.parametrize("case", list(CASES_FOR_TORCH))
def test_other_calls_are_torch_bit_for_bit(case):
    make_x, make_w, view = CASES_FOR_TORCH[case]
    x, w = make_x(), make_w()
    b = torch.randn(w.shape[0])
    with torch.no_grad():
        got, runs = kernel_runs(lambda: F.relu(F.linear(view(fastlazy.lazy(x)), w, b)))
    assert runs == 0
    assert torch.equal(got, F.relu(F.linear(view(x), w, b)))


def test_float64_and_autograd_stay_with_torch():
    x, w = torch.randn(1, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    with torch.no_grad():
        got, runs = kernel_runs(lambda: F.linear(fastlazy.lazy(x), w))
    assert runs == 0 and torch.equal(got, F.linear(x, w))

    w = torch.randn(4, 5, requires_grad=True)
    x = torch.randn(1, 5)
    got, runs = kernel_runs(lambda: F.linear(fastlazy.lazy(x), w).sum())
    assert runs == 0
    got.backward()
    assert torch.equal(w.grad, x.expand(4, 5))


def mlp(depth=4, width=16):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).eval()


def test_kept_buffers_never_reach_a_result():
    """Intermediates between two kernel steps live in buffers the program
    keeps between calls; a result of an earlier call must not change."""
    model = mlp()
    x1, x2 = torch.randn(1, 16), torch.randn(1, 16)
    with torch.no_grad():
        first, runs = kernel_runs(lambda: model(fastlazy.lazy(x1)))
        second, _ = kernel_runs(lambda: model(fastlazy.lazy(x2)))
        again, _ = kernel_runs(lambda: model(fastlazy.lazy(x1)))
        assert runs == 4
        assert_same(first, model(x1))
        assert_same(second, model(x2))
        assert torch.equal(first, again)


def test_an_intermediate_that_is_also_read_keeps_its_own_value():
    """A layer's output that the user also holds (and views) is no kept
    buffer."""
    model = mlp(depth=3)
    xs = [torch.randn(1, 16) for _ in range(3)]
    results = []
    with torch.no_grad():
        for x in xs:
            hidden = model[:2](fastlazy.lazy(x))
            view = hidden.view(-1)
            out = model[2:](hidden)
            results.append((view, out))
        fastlazy.mark_step()
        for x, (view, out) in zip(xs, results):
            assert_same(view, model[:2](x).view(-1))
            assert_same(out, model(x))


def test_threads_running_one_program_at_once():
    model = mlp(depth=8, width=64)
    inputs = [torch.randn(1, 64) for _ in range(8)]
    with torch.no_grad():
        want = [model(x) for x in inputs]
    def worker(k):
        with torch.no_grad():
            for _ in range(200):
                got = model(fastlazy.lazy(inputs[k])).to_eager()
                assert torch.allclose(got, want[k], rtol=1e-5, atol=1e-6), f"thread {k}"

    assert not run_in_threads(worker, len(inputs))


def test_torchscript_hands_batch_one_graphs_to_the_kernel(monkeypatch):
    """The default backend cannot call the kernel from TorchScript: a graph
    whose first recording had one row runs natively; one first recorded on
    a batch stays TorchScript.  A graph's key does not hold its shapes, so
    the first recording decides for every later call of any batch size."""
    from fastlazy.backends import native as native_backend
    built = []
    build = native_backend.build
    monkeypatch.setattr(native_backend, "build", lambda view: built.append(view) or build(view))
    fastlazy.set_backend("torchscript")
    one, batch = torch.randn(1, 16), torch.randn(5, 16)
    model = mlp()
    with torch.no_grad():
        # one row first: native; the batch reuses that program, torch's calls
        for x, kernel in ((one, 4), (batch, 0), (one, 4)):
            got, runs = kernel_runs(lambda: model(fastlazy.lazy(x)))
            assert runs == kernel
            assert_same(got, model(x))
        assert len(built) == 1
        # a batch first: TorchScript, one row then runs there too
        model = mlp(depth=3)
        for x in (batch, one):
            got, runs = kernel_runs(lambda: model(fastlazy.lazy(x)))
            assert runs == 0
            assert_same(got, model(x))
    assert len(built) == 1


def test_metrics_count_the_kernel_layers():
    model = mlp(depth=3)
    fastlazy.metrics.reset()
    with torch.no_grad():
        model(fastlazy.lazy(torch.randn(1, 16))).to_eager()
        model(fastlazy.lazy(torch.randn(2, 16))).to_eager()
    assert fastlazy.metrics.counters()["kernel_layers"] == 3
    fastlazy.metrics.reset()
    assert fastlazy.metrics.counters()["kernel_layers"] == 0


def test_portable_kernel_can_be_chosen_and_restored():
    was = _steps.use_vector_kernel(False)
    try:
        assert _steps.use_vector_kernel(False) is False
    finally:
        _steps.use_vector_kernel(was)


def test_an_intermediate_is_dropped_after_its_last_reader():
    """A long chain must not hold every intermediate until it ends (at
    n=10000 a W1 value is 400 MB)."""
    import weakref
    from fastlazy.backends.native import _set_frees

    seen = {}

    def make(values):
        value = torch.ones(3)
        seen["first"] = weakref.ref(value)
        return value

    def read(values):
        return values[1] + 1

    def after(values):
        # the first value's last reader ran: the program holds it no more
        return torch.tensor(seen["first"]() is None)

    steps = [_steps.PyStep(1, make), _steps.PyStep(2, read), _steps.PyStep(3, after)]
    _set_frees(steps, [[0], [1], [2]], ninputs=1, outputs={3})
    program = _steps.StepProgram(1, 4, steps, (3,))
    assert program(torch.zeros(1))[0].item() is True


def test_default_dtype_does_not_reach_the_kernel_output():
    x, w = torch.randn(1, 6), torch.randn(3, 6)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            got, runs = kernel_runs(lambda: F.linear(fastlazy.lazy(x), w))
    finally:
        torch.set_default_dtype(before)
    assert runs == 1
    assert_same(got, F.linear(x, w))


def test_kept_buffers_across_inference_mode_and_no_grad():
    """A buffer kept from a call under inference_mode is an inference
    tensor; a later call under no_grad reads it again (and the fallback hands
    it to torch)."""
    model = mlp()
    x = torch.randn(1, 16)
    with torch.no_grad():
        want = model(x)
    with torch.inference_mode():
        first, runs = kernel_runs(lambda: model(fastlazy.lazy(x)))
    with torch.no_grad():
        second, again = kernel_runs(lambda: model(fastlazy.lazy(x)))
    assert runs == 4 and again == 4
    assert_same(first, want)
    assert_same(second, want)


def test_a_graph_mostly_of_other_ops_stays_on_torchscript(monkeypatch):
    """One one-row linear layer among many other ops: the kernel would save
    less than this executor's per-op cost takes, so the graph stays on
    TorchScript."""
    from fastlazy.backends import native as native_backend
    built = []
    build = native_backend.build
    monkeypatch.setattr(native_backend, "build", lambda view: built.append(view) or build(view))
    fastlazy.set_backend("torchscript")
    layer = torch.nn.Linear(16, 16)

    def model(x):
        for _ in range(6):
            x = torch.tanh(x * 0.5 + 1.0)
        return layer(x)
    x = torch.randn(1, 16)
    with torch.no_grad():
        assert_same(model(fastlazy.lazy(x)), model(x))
    assert not built
