"""fastlazy's step executor (fastlazy/csrc/step_executor.h): the TorchScript
backend's graphs run step by step, ATen's CPU kernels called directly where
a run's inputs allow, and every other run as the interpreter would run it.
Eager is the oracle, bit for bit (the same kernels run)."""
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastlazy
from fastlazy import graph_cache, metrics, step_executor
from helpers import run_in_threads

pytestmark = pytest.mark.skipif(not step_executor.available(),
                                reason=f"step executor {step_executor.why_not()}")


def graph(body, inputs=2):
    """IR of a graph over `inputs` tensors %a, %b, ... whose last line
    defines %out."""
    params = ", ".join(f"%{'abcd'[i]} : Tensor" for i in range(inputs))
    return f"graph({params}):\n{body}\n  return (%out)"


def run(ir, *inputs):
    """The executor's output and whether the run called any kernel directly."""
    program = step_executor.compile(ir)
    out = program(*inputs)
    return out, program.calls["direct"] > 0


ONE = "  %one : int = prim::Constant[value=1]()\n"

# (IR body, eager's computation): one per entry of the executor's direct table
DIRECT = [
    (ONE + "  %out : Tensor = aten::add(%a, %b, %one)", lambda a, b: a + b),
    (ONE + "  %t : Tensor = aten::add(%a, %b, %one)\n  %out : Tensor = aten::add_(%t, %b, %one)",
     lambda a, b: (a + b).add_(b)),
    ("  %two : float = prim::Constant[value=2.5]()\n  %out : Tensor = aten::sub(%a, %b, %two)",
     lambda a, b: torch.sub(a, b, alpha=2.5)),
    (ONE + "  %t : Tensor = aten::mul(%a, %b)\n  %out : Tensor = aten::sub_(%t, %a, %one)",
     lambda a, b: (a * b).sub_(a)),
    ("  %t : Tensor = aten::div(%a, %b)\n  %out : Tensor = aten::mul_(%t, %b)",
     lambda a, b: (a / b).mul_(b)),
    ("  %t : Tensor = aten::mul(%a, %b)\n  %out : Tensor = aten::div_(%t, %a)",
     lambda a, b: (a * b).div_(a)),
    ("  %t : Tensor = aten::neg(%a)\n  %out : Tensor = aten::neg_(%t)", lambda a, b: (-a).neg_()),
    ("  %t : Tensor = aten::exp(%a)\n  %out : Tensor = aten::exp_(%t)", lambda a, b: a.exp().exp_()),
    ("  %t : Tensor = aten::rsqrt(%a)\n  %out : Tensor = aten::rsqrt_(%t)",
     lambda a, b: a.rsqrt().rsqrt_()),
    ("  %t : Tensor = aten::sigmoid(%a)\n  %out : Tensor = aten::sigmoid_(%t)",
     lambda a, b: a.sigmoid().sigmoid_()),
    ("  %t : Tensor = aten::tanh(%a)\n  %out : Tensor = aten::tanh_(%t)",
     lambda a, b: a.tanh().tanh_()),
    (ONE + "  %s : Tensor = aten::sub(%a, %b, %one)\n  %t : Tensor = aten::relu(%s)\n"
     "  %out : Tensor = aten::relu_(%t)",
     lambda a, b: (a - b).relu().relu_()),
    ("  %t : Tensor = aten::silu(%a)\n  %out : Tensor = aten::silu_(%t)",
     lambda a, b: torch.nn.functional.silu(torch.nn.functional.silu(a), inplace=True)),
    ('  %s : str = prim::Constant[value="tanh"]()\n  %t : Tensor = aten::gelu(%a, %s)\n'
     '  %out : Tensor = aten::gelu_(%t, %s)',
     lambda a, b: torch.ops.aten.gelu_(torch.nn.functional.gelu(a, approximate="tanh"),
                                       approximate="tanh")),
    ("  %out : Tensor = aten::mm(%a, %b)", lambda a, b: a @ b),
    ("  %ab : Tensor = aten::unsqueeze(%a, %z)\n  %bb : Tensor = aten::unsqueeze(%b, %z)\n"
     "  %out : Tensor = aten::bmm(%ab, %bb)",
     lambda a, b: torch.bmm(a[None], b[None])),
    ("  %h : float = prim::Constant[value=0.5]()\n  %out : Tensor = aten::addmm(%a, %a, %b, %h, %h)",
     lambda a, b: torch.addmm(a, a, b, beta=0.5, alpha=0.5)),
    ("  %out : Tensor = aten::pow(%a, %b)", torch.pow),
] + [(f"  %out : Tensor = aten::{op}(%a, %b)", getattr(torch, op))
     for op in ("eq", "ne", "lt", "le", "gt", "ge")]


@pytest.mark.parametrize("body,eager", DIRECT, ids=lambda v: v.split("aten::")[-1].split("(")[0]
                         if isinstance(v, str) else "")
def test_each_direct_op_gives_eagers_values_on_both_paths(body, eager):
    """Each op of the direct table, called directly (plain inputs) and boxed
    (inputs requiring grad, grad mode on): eager's values bit for bit."""
    body = "  %z : int = prim::Constant[value=0]()\n" + body
    ir = graph(body)
    a, b = torch.rand(6, 6) + 0.5, torch.rand(6, 6) + 0.5
    expected = eager(a, b)
    out, direct = run(ir, a, b)
    assert direct
    assert torch.equal(out, expected) and out.dtype == expected.dtype
    ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
    if body.rsplit("aten::", 1)[-1].split("(")[0].endswith("_"):
        return     # an in-place op on a result that requires grad: eager's own rules
    out, direct = run(ir, ga, gb)
    assert not direct
    # history where eager's has it (a comparison's result has none)
    assert torch.equal(out.detach(), expected)
    assert (out.grad_fn is None) == (eager(ga, gb).grad_fn is None)


# A Python number as a binary op's operand (a graph's lifted float or int
# input, or a constant): ATen's Scalar overloads, which the executor calls
# with the number wrapped in self's dtype where that cannot change a value.
NUMBER_OPS = [
    ("add", "%a, %n, %one", lambda a, n: torch.add(a, n)),
    ("sub", "%a, %n, %two", lambda a, n: torch.sub(a, n, alpha=2)),
    ("mul", "%a, %n", torch.mul),
    ("div", "%a, %n", torch.div),
    ("add_", "%a, %n, %one", lambda a, n: a.add_(n)),
    ("sub_", "%a, %n, %one", lambda a, n: a.sub_(n)),
    ("mul_", "%a, %n", lambda a, n: a.mul_(n)),
    ("div_", "%a, %n", lambda a, n: a.div_(n)),
    ("pow", "%a, %n", torch.pow),
] + [(op, "%a, %n", getattr(torch, op)) for op in ("eq", "ne", "lt", "le", "gt", "ge")]

# (TorchScript takes no bool as a Scalar: fastlazy emits none)
NUMBERS = [1.01, -0.0, 1e300, float("nan"), 3, 2**40, -7, 1.5 - 2j]
NUMBER_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                 torch.int32, torch.uint8, torch.bool, torch.complex64]


def _number_graph(op, args, number):
    """A graph of one op whose number operand %n is an input (a float, int
    or complex, as a lifted number is)."""
    consts = ("  %one : int = prim::Constant[value=1]()\n"
              "  %two : int = prim::Constant[value=2]()\n")
    kind = {float: "float", int: "int", complex: "complex"}[type(number)]
    params = f"%a : Tensor, %n : {kind}"
    return f"graph({params}):\n{consts}  %out : Tensor = aten::{op}({args})\n  return (%out)"


@pytest.mark.parametrize("op,args,eager", NUMBER_OPS, ids=[o[0] for o in NUMBER_OPS])
def test_number_operands_give_eagers_values_dtypes_and_errors(op, args, eager):
    """Every dtype against numbers that round, overflow, are NaN, -0.0, a
    large int, a bool or complex: eager's values bit for bit (NaN where
    eager's is, the sign of a zero included), its dtype, or its error."""
    program, ran = {}, set()
    for number in NUMBERS:
        key = type(number)
        if key not in program:
            program[key] = step_executor.compile(_number_graph(op, args, number))
        for dtype in NUMBER_DTYPES:
            base = (torch.linspace(-3, 3, 12) * 7).to(dtype)
            try:
                expected = eager(base.clone(), number)
            except Exception as exc:        # noqa: BLE001 - eager's error is the oracle
                with pytest.raises(type(exc)):
                    program[key](base.clone(), number)
                continue
            out = program[key](base.clone(), number)
            ran.add(key)
            where = f"{op} {dtype} {number!r}"
            assert out.dtype == expected.dtype, where
            assert torch.equal(out.isnan(), expected.isnan()), where
            same = (out == expected) | out.isnan()
            if out.is_floating_point():
                same &= out.signbit() == expected.signbit()
            assert bool(same.all()), where
    for key in ran:     # (lt of a complex number raises in every dtype)
        assert program[key].calls["direct"] > 0, f"{op} {key.__name__}: no direct call"


def test_the_chain_runs_directly_through_fastlazy():
    """The TorchScript backend hands its graphs to the executor; an
    inference chain's runs call the kernels directly and equal eager's."""
    before = fastlazy.backend()
    fastlazy.set_backend("torchscript")
    try:
        xs = [torch.rand(8, 8) + 0.5 for _ in range(4)]
        lz = [fastlazy.lazy(x) for x in xs]
        for _ in range(3):
            out = (lz[0] + lz[1]).mul(lz[2]).div(lz[3]).sub(lz[1]).to_eager()
        assert torch.equal(out, (xs[0] + xs[1]).mul(xs[2]).div(xs[3]).sub(xs[1]))
        program = next(reversed(graph_cache.programs.values())).call
        assert isinstance(program, step_executor._module.StepProgram)
        assert program.direct_steps == program.steps == 4
        assert program.calls == {"direct": 12, "boxed": 0, "reused": 0}
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)


def test_a_conjugate_view_is_read_through_the_dispatcher():
    """A conjugate view carries a bit the kernels do not read (eager
    resolves it in the dispatcher): the step reading it runs boxed."""
    a = torch.randn(4, dtype=torch.complex64)
    b = torch.randn(4, dtype=torch.complex64)
    ir = graph("  %out : Tensor = aten::mul(%a, %b)")
    out, direct = run(ir, a.conj(), b)
    assert torch.equal(out, a.conj() * b)
    # an intermediate conjugate view made inside the graph
    ir = graph("  %c : Tensor = aten::conj(%a)\n  %out : Tensor = aten::mul(%c, %b)")
    out, _ = run(ir, a, b)
    assert torch.equal(out, a.conj() * b)


def test_autocast_and_dispatch_modes_see_every_op():
    """Under autocast the ops cast as eager's do; a TorchDispatchMode sees
    every op of the graph."""
    a, b = torch.rand(4, 4), torch.rand(4, 4)
    ir = graph("  %out : Tensor = aten::mm(%a, %b)")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, direct = run(ir, a, b)
        expected = a @ b
    assert not direct
    assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    ir = graph("  %one : int = prim::Constant[value=1]()\n"
               "  %t : Tensor = aten::add(%a, %b, %one)\n  %out : Tensor = aten::relu_(%t)")
    with Record():
        out, direct = run(ir, a, b)
    assert not direct
    assert seen == ["aten.add.Tensor", "aten.relu_.default"]
    assert torch.equal(out, (a + b).relu_())


def test_gradients_and_in_place_writes_keep_eagers_bookkeeping():
    """A run whose inputs require grad builds eager's autograd history; an
    in-place direct call on an input bumps its version as eager's does."""
    a, b = torch.rand(3, 3, requires_grad=True), torch.rand(3, 3)
    ir = graph("  %out : Tensor = aten::mm(%a, %b)")
    out, direct = run(ir, a, b)
    assert not direct
    out.sum().backward()
    assert torch.equal(a.grad, torch.ones(3, 3) @ b.t())
    with torch.no_grad():          # nothing to record: direct
        out, direct = run(ir, a, b)
    assert direct and out.grad_fn is None and not out.requires_grad

    x, y = torch.rand(3), torch.rand(3)
    expected = x + y
    version = x._version
    ir = graph("  %one : int = prim::Constant[value=1]()\n  %out : Tensor = aten::add_(%a, %b, %one)")
    out, direct = run(ir, x, y)
    assert direct and x._version == version + 1
    assert torch.equal(x, expected) and out.data_ptr() == x.data_ptr()


def test_inference_tensors_take_eagers_path():
    """An inference tensor's keys differ from a plain tensor's: its steps run
    boxed, with eager's outcome (an in-place update of one outside inference
    mode is refused)."""
    with torch.inference_mode():
        x = torch.rand(3)
    y = torch.rand(3)
    ir = graph("  %one : int = prim::Constant[value=1]()\n  %out : Tensor = aten::add(%a, %b, %one)")
    out, direct = run(ir, x, y)
    assert torch.equal(out, x + y)
    ir = graph("  %one : int = prim::Constant[value=1]()\n  %out : Tensor = aten::add_(%a, %b, %one)")
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        x.add_(y)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        run(ir, x, y)


def test_errors_are_pythons_exceptions_and_leave_inputs_intact():
    """A kernel's error is a Python exception of eager's type, not a
    crash; a wrong input is refused by type."""
    a, b = torch.rand(2, 3), torch.rand(4, 5)
    ir = graph("  %out : Tensor = aten::mm(%a, %b)")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run(ir, a, b)
    with pytest.raises(TypeError, match="not a tensor"):
        run(ir, a, 3)
    idx = graph("  %z : int = prim::Constant[value=7]()\n"
                "  %out : Tensor = aten::select(%a, %z, %z)", inputs=1)
    with pytest.raises(IndexError):
        run(idx, a)
    assert a.shape == (2, 3)


def test_dead_intermediates_are_released_during_the_run():
    """A register is released after its last read: a chain of n steps holds
    about two intermediates at a time, not n."""
    n = 40
    lines = ["  %one : int = prim::Constant[value=1]()", "  %v0 : Tensor = aten::add(%a, %b, %one)"]
    lines += [f"  %v{i} : Tensor = aten::add(%v{i - 1}, %b, %one)" for i in range(1, n)]
    lines.append(f"  %out : Tensor = aten::mul(%v{n - 1}, %b)")
    ir = graph("\n".join(lines))
    a, b = torch.rand(256, 1024), torch.rand(256, 1024)     # 1 MiB each
    peak = []

    class Peak(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            import gc
            out = func(*args, **(kwargs or {}))
            peak.append(sum(1 for o in gc.get_objects() if type(o) is torch.Tensor
                            and o.shape == (256, 1024)))
            return out

    # counting live tensors needs Python objects per step: the boxed path
    # under a dispatch mode runs the same step list and release plan
    with Peak():
        out, _ = run(ir, a, b)
    expected = a + b
    for _ in range(1, n):
        expected = expected + b
    assert torch.equal(out, expected * b)
    assert max(peak) <= 6, max(peak)


# contiguous, clone and as_strided_scatter, called directly: (IR body over
# %a and %b, eager's computation).  %c is a 6x6 intermediate each may take
# over (nothing else reads it), %ct its transpose, %e one read again after.
_MADE = ("  %one : int = prim::Constant[value=1]()\n"
         "  %zero : int = prim::Constant[value=0]()\n"
         "  %none : NoneType = prim::Constant()\n"
         "  %cf : int = prim::Constant[value=0]()\n"
         "  %pf : int = prim::Constant[value=1]()\n"
         "  %c : Tensor = aten::mul(%a, %b)\n")
_PLACE = ("  %size : int[] = prim::Constant[value=[2, 3]]()\n"
          "  %stride : int[] = prim::Constant[value=[6, 2]]()\n"
          "  %off : int = prim::Constant[value=7]()\n")
OWNED = [
    # (body, eager, buffers the run takes over)
    ("  %out : Tensor = aten::clone(%c, %none)", lambda a, b: (a * b).clone(), 1),
    ("  %out : Tensor = aten::clone(%c, %cf)", lambda a, b: (a * b).clone(), 1),
    # a view keeps its base (eager's _base), so its storage is shared
    ("  %ct : Tensor = aten::transpose(%c, %zero, %one)\n"
     "  %out : Tensor = aten::clone(%ct, %pf)",
     lambda a, b: (a * b).t().clone(memory_format=torch.preserve_format), 0),
    ("  %ct : Tensor = aten::transpose(%c, %zero, %one)\n"
     "  %out : Tensor = aten::clone(%ct, %cf)",
     lambda a, b: (a * b).t().clone(memory_format=torch.contiguous_format), 0),
    ("  %ct : Tensor = aten::transpose(%c, %zero, %one)\n"
     "  %out : Tensor = aten::contiguous(%ct, %cf)", lambda a, b: (a * b).t().contiguous(), 0),
    ("  %out : Tensor = aten::contiguous(%c, %cf)", lambda a, b: (a * b).contiguous(), 0),
    # read again after the clone: the clone is a copy, the write its own
    ("  %k : Tensor = aten::clone(%c, %none)\n  %w : Tensor = aten::mul_(%k, %b)\n"
     "  %out : Tensor = aten::add(%w, %c, %one)",
     lambda a, b: (a * b).clone().mul_(b) + a * b, 0),
    # a view of an intermediate read later: its storage is shared
    ("  %r : Tensor = aten::select(%c, %zero, %one)\n  %k : Tensor = aten::clone(%r, %none)\n"
     "  %w : Tensor = aten::mul_(%k, %k)\n  %out : Tensor = aten::add(%c, %w, %one)",
     lambda a, b: a * b + (a * b)[1].clone().mul_((a * b)[1]), 0),
    # a graph input is always held by its caller
    ("  %out : Tensor = aten::clone(%a, %none)", lambda a, b: a.clone(), 0),
    (_PLACE + "  %s : Tensor = aten::slice(%b, %zero, %zero, %one, %one)\n"
     "  %v : Tensor = aten::reshape(%s, %size)\n"
     "  %out : Tensor = aten::as_strided_scatter(%c, %v, %size, %stride, %off)",
     lambda a, b: torch.as_strided_scatter(a * b, b[:1].reshape(2, 3), (2, 3), (6, 2), 7), 1),
    (_PLACE + "  %s : Tensor = aten::slice(%b, %zero, %zero, %one, %one)\n"
     "  %v : Tensor = aten::reshape(%s, %size)\n"
     "  %out : Tensor = aten::as_strided_scatter(%a, %v, %size, %stride, %off)",
     lambda a, b: torch.as_strided_scatter(a, b[:1].reshape(2, 3), (2, 3), (6, 2), 7), 0),
    # a scatter whose source views the very buffer: a copy first
    (_PLACE + "  %s : Tensor = aten::slice(%c, %zero, %zero, %one, %one)\n"
     "  %v : Tensor = aten::reshape(%s, %size)\n"
     "  %out : Tensor = aten::as_strided_scatter(%c, %v, %size, %stride, %off)",
     lambda a, b: torch.as_strided_scatter(a * b, (a * b)[:1].reshape(2, 3), (2, 3), (6, 2), 7),
     0),
]


@pytest.mark.parametrize("body,eager,reused", OWNED,
                         ids=[f"{k}-{o[2]}" for k, o in enumerate(OWNED)])
def test_a_dead_buffer_is_taken_over_only_where_nothing_else_sees_it(body, eager, reused):
    """clone and as_strided_scatter of an intermediate read for the last
    time, held nowhere else, laid out as the copy would be: the buffer
    itself is the result; in every other case a copy.  Either way eager's
    values and strides, and the inputs untouched."""
    a, b = torch.rand(6, 6) + 0.5, torch.rand(6, 6) + 0.5
    a0, b0 = a.clone(), b.clone()
    expected = eager(a, b)
    program = step_executor.compile(graph(_MADE + body))
    for _ in range(2):
        out = program(a, b)
        assert torch.equal(out, expected) and out.stride() == expected.stride()
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert program.calls["reused"] == 2 * reused


def test_writes_to_a_fresh_tensor_take_over_its_buffer_through_fastlazy():
    """x[...] = v and masked_fill_ on a fresh result, as a model builds a
    band or a mask: each functional write clones the tensor, and every
    clone of a tensor nobody else holds takes it over; eager's values."""
    before = fastlazy.backend()
    fastlazy.set_backend("torchscript")
    try:
        a = torch.randn(2, 9, 8, 17)

        def band(x):
            z = x.new_zeros((2, 9, 8, 17))
            z[:, :-1, :, 8:] = x[:, :-1, :8, :9]
            z[:, -1, :, 8:] = x[:, -1, :, :9]
            z[:, 1:, :, :8] = x[:, :-1, :, 9:]
            z.masked_fill_(z > 1, -float("inf"))
            return z

        lz = fastlazy.lazy(a)
        for _ in range(3):
            got = band(lz).to_eager()
        assert torch.equal(got, band(a))
        program = next(reversed(graph_cache.programs.values())).call
        assert isinstance(program, step_executor._module.StepProgram)
        # the three writes' clones and the masked fill's, at each of 3 runs
        assert program.calls["reused"] == 3 * 4
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)


def test_a_run_lets_go_of_the_gil_only_where_the_last_run_was_long():
    """A first run, and a run after one of at least 100 us, let other
    threads run Python meanwhile; a run after a short one keeps the GIL
    (handing it over costs such a run more than it could give)."""
    import threading
    program = step_executor.compile(graph("  %out : Tensor = aten::mm(%a, %b)"))
    small, big = torch.rand(4, 4), torch.rand(1200, 1200)
    assert program.releases_gil
    for _ in range(3):          # (a first run pays one-time costs)
        program(small, small)
    assert not program.releases_gil
    program(big, big)
    assert program.releases_gil
    counted, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1
    other = threading.Thread(target=count)
    other.start()
    try:
        time.sleep(0.05)
        before = counted[0]
        out = program(big, big)             # tens of milliseconds, without the GIL
        during = counted[0] - before
    finally:
        stop.set()
        other.join()
    assert torch.equal(out, big @ big)
    assert during > 0


def test_threads_run_one_program_at_once():
    """One program called from several threads at the same time: each run
    has its own registers."""
    ir = graph("  %one : int = prim::Constant[value=1]()\n"
               "  %t : Tensor = aten::add(%a, %b, %one)\n  %out : Tensor = aten::mul_(%t, %b)")
    program = step_executor.compile(ir)
    inputs = [(torch.rand(64, 64), torch.rand(64, 64)) for _ in range(4)]
    results = {}

    def work(k):
        a, b = inputs[k]
        for _ in range(300):
            results[k] = program(a, b)

    assert not run_in_threads(work, 4)
    for k, (a, b) in enumerate(inputs):
        assert torch.equal(results[k], (a + b) * b)


def test_a_graph_the_executor_refuses_runs_on_the_interpreter(monkeypatch):
    """A graph with a node the executor has no operator for runs on the
    interpreter, counted; `why_not` and explain() name a disabled executor."""
    with pytest.raises(RuntimeError):
        step_executor.compile("graph(%a : Tensor):\n  %out : Tensor = aten::no_such_op(%a)\n"
                              "  return (%out)")

    def refuse(ir):
        raise RuntimeError("no operator")

    monkeypatch.setattr(step_executor, "compile", refuse)
    before = fastlazy.backend()
    fastlazy.set_backend("torchscript")
    metrics.reset()
    try:
        x = torch.rand(5)
        out = (fastlazy.lazy(x) * 3 + 1).to_eager()
        assert torch.equal(out, x * 3 + 1)
        assert metrics.counters()["executor_refusals"] == 1
        program = next(reversed(graph_cache.programs.values())).call
        assert not isinstance(program, step_executor._module.StepProgram)
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)
    step_executor.set_enabled(False)
    try:
        assert "switched off" in step_executor.why_not()
        assert "step executor is switched off" in fastlazy.explain()
    finally:
        step_executor.set_enabled(True)
    assert step_executor.why_not() is None


def test_lists_and_tuples_the_backend_emits():
    """prim::ListConstruct (of sizes read at run time, of tensors, of
    optional tensors; a list of constants is folded) and prim::TupleConstruct
    have no operator: the executor builds them as the interpreter does."""
    a, b = torch.rand(4, 6), torch.rand(4, 6)
    sizes = graph("  %z : int = prim::Constant[value=0]()\n  %m : int = prim::Constant[value=-1]()\n"
                  "  %o : int = prim::Constant[value=1]()\n"
                  "  %s : int = aten::size(%a, %z)\n"
                  "  %l : int[] = prim::ListConstruct(%s, %m, %o)\n"
                  "  %t : Tensor = aten::unsqueeze(%a, %m)\n"
                  "  %u : Tensor = aten::view(%t, %l)\n"
                  "  %c : int[] = prim::ListConstruct(%m)\n"
                  "  %out : Tensor = aten::view(%u, %c)", inputs=1)
    for x in (a, torch.rand(3, 5)):
        out, _ = run(sizes, x)
        assert torch.equal(out, x.reshape(-1))
    cat = graph("  %z : int = prim::Constant[value=0]()\n"
                "  %l : Tensor[] = prim::ListConstruct(%a, %b)\n"
                "  %out : Tensor = aten::cat(%l, %z)")
    out, _ = run(cat, a, b)
    assert torch.equal(out, torch.cat([a, b]))
    index = graph("  %l : Tensor?[] = prim::ListConstruct(%b)\n"
                  "  %out : Tensor = aten::index(%a, %l)")
    i = torch.tensor([2, 0, 2])
    out, _ = run(index, a, i)
    assert torch.equal(out, a[i])
    pair = ("graph(%a : Tensor, %b : Tensor):\n  %one : int = prim::Constant[value=1]()\n"
            "  %x : Tensor = aten::add(%a, %b, %one)\n  %y : Tensor = aten::mul(%a, %b)\n"
            "  %out : (Tensor, Tensor) = prim::TupleConstruct(%x, %y)\n  return (%out)")
    out = step_executor.compile(pair)(a, b)
    assert type(out) is tuple and torch.equal(out[0], a + b) and torch.equal(out[1], a * b)


@pytest.mark.parametrize("built,why", [
    (None, "not built"),
    ("0.0.1", "built for torch 0.0.1"),
])
def test_an_executor_built_for_another_torch_is_not_used(monkeypatch, built, why):
    """The extension holds the version of the torch it was compiled
    against: none (an isolated build, where torch was not importable, or a
    failed compile) or another version leaves it unused, and says why."""
    import sys
    import types
    module = None if built is None else types.SimpleNamespace(TORCH_VERSION=built)
    monkeypatch.setitem(sys.modules, "fastlazy._executor", module)
    module, reason = step_executor._load()
    assert module is None and why in reason


def test_a_first_run_in_inference_mode_leaves_later_runs_direct():
    """The plain keys a direct call's operands must have are taken once per
    process, outside inference mode whatever the first run's mode (an
    inference tensor lacks the autograd keys, and taking those would send
    every later plain tensor through the dispatcher)."""
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from fastlazy import step_executor\n"
        "ir = ('graph(%a : Tensor, %b : Tensor):\\n  %one : int = prim::Constant[value=1]()\\n'\n"
        "      '  %out : Tensor = aten::add(%a, %b, %one)\\n  return (%out)')\n"
        "p = step_executor.compile(ir)\n"
        "with torch.inference_mode():\n"
        "    p(torch.rand(3), torch.rand(3))\n"
        "q = step_executor.compile(ir)\n"
        "q(torch.rand(3), torch.rand(3))\n"
        "print(q.calls['direct'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "1", out.stdout + out.stderr


# Every line form the TorchScript backend emits: scalar inputs, each kind of
# constant (negative ints, floats in exponent form, strings, bools, None, a
# device), lists of each kind, a node with two outputs, a tuple output.
EVERY_FORM = """graph(%x0 : Tensor, %x1 : Tensor, %x2 : float, %x3 : int, %x4 : complex):
  %t1 : int = prim::Constant[value=-1]()
  %t2 : float = prim::Constant[value=1e-05]()
  %t3 : float = prim::Constant[value=0.1767766952966369]()
  %t4 : str = prim::Constant[value="tanh"]()
  %t5 : bool = prim::Constant[value=1]()
  %t6 : NoneType = prim::Constant()
  %t7 : Device = prim::Constant[value="cpu"]()
  %t8 : int = prim::Constant[value=9223372036854775807]()
  %t9 : float = prim::Constant[value=-3.4028234663852886e+38]()
  %t10 : int = prim::Constant[value=0]()
  %f : bool = prim::Constant[value=0]()
  %t11 : int[] = aten::size(%x0)
  %t12 : int[] = aten::slice(%t11, %t1, %t6, %x3)
  %t13 : Tensor = aten::layer_norm(%x0, %t12, %t6, %t6, %t2, %t5)
  %t14 : Tensor = aten::gelu(%t13, %t4)
  %t15 : Tensor = aten::mul(%t14, %x2)
  %t16 : Tensor, %t17 : Tensor = aten::max(%t15, %t1, %t5)
  %t18 : Tensor[] = prim::ListConstruct(%t16, %x1)
  %t19 : Tensor = aten::cat(%t18, %t1)
  %t20 : Tensor?[] = prim::ListConstruct(%t6, %t17)
  %t21 : float[] = prim::ListConstruct(%t3, %t9)
  %t22 : bool[] = prim::ListConstruct(%t5, %t5)
  %t23 : Tensor = aten::clamp(%t19, %t9, %t6)
  %t24 : int = aten::size(%t23, %t10)
  %t25 : int[] = prim::ListConstruct(%t24, %t1)
  %t26 : Tensor = aten::reshape(%t23, %t25)
  %t27 : Tensor = aten::to(%t26, %t7, %t6, %f, %f)
  %t28 : Tensor = aten::mul(%t27, %x4)
  %outs : (Tensor, Tensor) = prim::TupleConstruct(%t28, %t17)
  return (%outs)"""


def test_the_executors_reader_builds_parseirs_graph_from_every_emitted_form():
    """The executor reads the backend's IR with its own reader
    (csrc/ir_reader.h), which must build the graph torch's parseIR builds
    from the same text, and the graph must run as eager computes."""
    mine, theirs = step_executor._module.read_both(EVERY_FORM)
    assert mine is not None and mine == theirs
    program = step_executor.compile(EVERY_FORM)
    assert program.read_fast
    x, y = torch.rand(3, 4), torch.rand(3, 1)
    out, index = program(x, y, 2.0, 1, 1 + 2j)
    values, expected_index = (torch.nn.functional.gelu(
        torch.nn.functional.layer_norm(x, (4,), eps=1e-5), approximate="tanh") * 2.0).max(-1, True)
    expected = torch.cat([values, y], -1).clamp(min=-3.4028234663852886e+38)
    assert torch.equal(out, expected.reshape(3, -1) * (1 + 2j))
    assert torch.equal(index, expected_index)


@pytest.mark.parametrize("body", [
    "  %out = aten::relu(%a)",                                      # an untyped output
    '  %s : str = prim::Constant[value="a\\\\b"]()\n  %out : Tensor = aten::relu(%a)',  # an escape
    "  %out : Tensor = aten::relu(%a) # a comment",
    "  %out : Float(3, strides=[1], requires_grad=0, device=cpu) = aten::relu(%a)",
    "  %c : complex = prim::Constant[value=2j]()\n  %out : Tensor = aten::mul(%a, %c)",
], ids=["untyped", "escape", "comment", "refined type", "complex literal"])
def test_ir_outside_the_emitted_forms_is_left_to_parseir(body):
    """Text the backend never emits is not guessed at: the reader refuses
    it before building anything, torch's parseIR reads it, and it runs."""
    ir = graph(body, inputs=1)
    mine, _ = step_executor._module.read_both(ir)
    assert mine is None
    program = step_executor.compile(ir)
    assert not program.read_fast
    a = torch.rand(3) - 0.5
    out = program(a)
    assert torch.equal(out, a * 2j) if "2j" in body else torch.equal(out, a.relu())


def test_the_backends_graphs_are_read_by_the_executors_reader():
    """A graph recorded through fastlazy reaches the executor as text its
    own reader reads (parseIR's 2 us a line is for text it cannot)."""
    before = fastlazy.backend()
    fastlazy.set_backend("torchscript")
    try:
        x = torch.rand(4, 8)
        out = torch.nn.functional.layer_norm(fastlazy.lazy(x).view(2, 16), (16,)).softmax(-1)
        assert torch.equal(out.to_eager(),
                           torch.nn.functional.layer_norm(x.view(2, 16), (16,)).softmax(-1))
        program = next(reversed(graph_cache.programs.values())).call
        assert isinstance(program, step_executor._module.StepProgram) and program.read_fast
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)


MAX_POOL = ('  %k : int[] = prim::Constant[value=[3, 3]]()\n'
            '  %s : int[] = prim::Constant[value=[2, 2]]()\n'
            '  %p : int[] = prim::Constant[value=[1, 1]]()\n'
            '  %d : int[] = prim::Constant[value=[1, 1]]()\n'
            '  %c : bool = prim::Constant[value={ceil}]()\n'
            '  %out : Tensor = aten::max_pool2d(%a, %k, %s, %p, %d, %c)')


@pytest.mark.parametrize("shape", [(1, 32, 16, 16), (2, 64, 9, 7), (1, 3, 8, 8), (1, 16, 4, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("ceil", [0, 1])
def test_max_pool2d_runs_directly_with_eagers_bits_and_layout(shape, layout, ceil):
    """max_pool2d is a direct step: a large enough contiguous batch goes
    through ATen's channels-last kernel and back (faster, the same maxima),
    anything else through ATen's own call; values, NaNs and strides are
    eager's either way."""
    x = torch.randn(shape)
    x[0, 0, 0, 0] = float("nan")
    x[0, 1, :2] = -float("inf")
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    want = torch.nn.functional.max_pool2d(x, 3, 2, 1, ceil_mode=bool(ceil))
    out, direct = run(graph(MAX_POOL.format(ceil=ceil), inputs=1), x)
    assert direct
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.nan_to_num(), want.nan_to_num()) and out.stride() == want.stride()
