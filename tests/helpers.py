"""Differential-testing helpers: run the same function eagerly and lazily.

``check(fn, *args, **kwargs)`` is the one oracle every differential test uses:
eager PyTorch is the reference, fastlazy must give the same values, dtypes and
shapes -- or raise the same exception type at the same call, recording nothing.

A fixture shared by the test modules (import it into a test module so that
pytest registers it there):

* ``fastlazy_enabled`` -- module-scoped, autouse: ``fastlazy.enable()`` for
  the module, ``fastlazy.disable()`` after it.

The ``backend`` fixture, parametrized over BACKENDS, and the ``device``
fixture, parametrized over DEVICES, are conftest's.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import operator
import pathlib
import sys
import threading
import zlib

import pytest
import torch

import fastlazy
from fastlazy import _core, graph_cache
from fastlazy._core import LazyTensor
from fastlazy.optable import OPS

BACKENDS = ("torchscript", "native", "eager")
DEFAULT_BACKEND = "torchscript"
# the devices a test taking the `device` fixture runs on: CUDA items carry
# the `cuda` mark, which conftest turns into a skip without a CUDA device
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


# --------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", autouse=True)
def fastlazy_enabled():
    was = fastlazy.enabled()
    fastlazy.enable()
    yield
    fastlazy.mark_step()
    # thousands of graphs were compiled here: leave the cache as an
    # unrelated module expects it (tests elsewhere count cache misses)
    graph_cache.clear()
    if not was:             # (left as found when another module enabled it)
        fastlazy.disable()


# --------------------------------------------------------------------------
# the benchmark suite's modules

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def import_benchmark(name, path=None):
    """benchmarks/<name>.py (or `path`) as module `name`: the suite's modules
    import each other by bare name (workloads imports zoo), so they are
    registered under it, zoo before workloads."""
    if name in sys.modules:
        return sys.modules[name]
    if name == "workloads":
        import_benchmark("zoo")
    spec = importlib.util.spec_from_file_location(name, path or BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # before running it: its dataclasses look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# --------------------------------------------------------------------------
# comparing values


class Mismatch(AssertionError):
    """fastlazy and eager disagree."""


def tolerances(dtype):
    """assert_close tolerances: exact for integral and bool dtypes, looser for
    the half-precision floats, torch's defaults otherwise."""
    if dtype == torch.float16:
        return {"rtol": 1e-3, "atol": 1e-3}
    if dtype == torch.bfloat16:
        return {"rtol": 1.6e-2, "atol": 1e-2}
    if dtype.is_floating_point or dtype.is_complex:
        return {}
    return {"rtol": 0, "atol": 0}


def assert_same(got, expected, what="result"):
    """Same type; for tensors the same dtype, shape, device and values
    (NaN-aware)."""
    if isinstance(expected, torch.Tensor):
        if type(got) is LazyTensor:
            try:
                got = got.to_eager()
            except Exception as exc:   # noqa: BLE001
                raise Mismatch(f"{what}: eager gives {describe(expected)}; reading the "
                               f"LazyTensor raises {type(exc).__name__}: {exc}") from exc
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"{what}: eager gives a tensor, lazy gives {type(got).__name__} {got!r}")
        if got.dtype != expected.dtype:
            raise Mismatch(f"{what}: dtype {got.dtype}, eager {expected.dtype}")
        if got.shape != expected.shape:
            raise Mismatch(f"{what}: shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
        if got.device != expected.device:
            raise Mismatch(f"{what}: device {got.device}, eager {expected.device}")
        if expected.dtype == torch.complex32:       # few kernels: compare widened
            got, expected = got.to(torch.complex64), expected.to(torch.complex64)
        if _same_bits(got, expected):
            return
        try:
            torch.testing.assert_close(got, expected, equal_nan=True, check_stride=False,
                                       **tolerances(expected.dtype))
        except AssertionError as exc:
            raise Mismatch(f"{what}: values differ\nlazy:  {got}\neager: {expected}\n{exc}") from None
        return
    if isinstance(expected, (tuple, list)):
        # several results (torch.max's values and indices, chunk's parts)
        if type(got) is not type(expected) or len(got) != len(expected):
            raise Mismatch(f"{what}: lazy gives {describe(got)}, eager {describe(expected)}")
        for k, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{what}[{k}]")
        return
    if type(got) is not type(expected) or got != expected:
        raise Mismatch(f"{what}: lazy gives {got!r}, eager {expected!r}")


def _same_bits(a, b):
    """Fast path: equal values (NaN where NaN) without assert_close's cost."""
    if a.dtype == torch.complex32:
        a, b = a.to(torch.complex64), b.to(torch.complex64)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])
    return False


def describe(x):
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {x.dtype}"
    if type(x) is LazyTensor:
        return f"LazyTensor{tuple(x.shape)} {x.dtype}"
    return repr(x)


# --------------------------------------------------------------------------
# the sentinel: a LazyTensor made before the call under test, which must come
# out right whatever that call did


def make_sentinel():
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    s = fastlazy.lazy(base.clone()) * 3
    s = s + 1
    return s, base * 3 + 1


def check_sentinel(sentinel, expected):
    if type(sentinel) is not LazyTensor:
        raise Mismatch(f"sentinel is no longer a LazyTensor: {type(sentinel)}")
    assert_same(sentinel, expected, "a LazyTensor made before the call")


def generic_calls():
    """Calls the generic path has recorded so far (a C rule's call adds
    none)."""
    return fastlazy.metrics.counters()["generic_calls"]


def make_pending(t):
    """A pending LazyTensor of t's value, dtype and shape (``t * True`` is the
    identity for every dtype; it makes t a graph node instead of an input)."""
    return torch.mul(t, True)


# --------------------------------------------------------------------------
# the oracle


@dataclasses.dataclass
class Outcome:
    expected: object = None          # eager's result (None if it raised)
    exception: BaseException | None = None   # eager's exception
    lazy_result: object = None       # what the lazy run returned
    recorded: bool = False           # the lazy result was pending (recorded)
    nodes_before: int = 0            # pending nodes before the lazy call
    nodes_after: int = 0             # ... and after it


def _is_tensor(x):
    return isinstance(x, torch.Tensor)


def check(fn, *args, lazy=None, returns_self=False, pending=False, expect_recorded=None,
          **kwargs):
    """Run ``fn(*args, **kwargs)`` eagerly and with LazyTensors; compare.

    lazy: which tensor arguments become LazyTensors in the lazy run -- a
        collection of positions (int) and keyword names (str); default: every
        tensor argument.  The others are passed as (cloned) eager tensors.
        Python scalars and other objects pass through unchanged.
    returns_self: the call is in-place: it must return its first argument
        (the very object), eagerly and lazily.
    pending: the lazy arguments are made pending nodes (not materialized
        inputs) before the call.
    expect_recorded: if True (False), the lazy call must (must not) record a
        node, i.e. its result must not (must) be materialized already.

    Eager raises -> the lazy call must raise the same exception type at the
    call, record nothing, and leave earlier LazyTensors (and its own lazy
    arguments) correct.  Otherwise the lazy result must be a LazyTensor whose
    shape and dtype (read before anything runs) and value equal eager's; the
    arguments must end up equal too (in-place), and no tensor handed to
    fastlazy.lazy() is ever mutated.
    """
    lazy_keys = set(lazy) if lazy is not None else None

    def becomes_lazy(key, value):
        return _is_tensor(value) and (lazy_keys is None or key in lazy_keys)

    def clone(a):
        if type(a) in (list, tuple):
            return type(a)(clone(v) for v in a)
        return a.clone() if _is_tensor(a) else a

    eager_args = [clone(a) for a in args]
    eager_kwargs = {k: v.clone() if _is_tensor(v) else v for k, v in kwargs.items()}

    sources = []        # (tensor given to fastlazy.lazy, pristine copy)

    def to_lazy_run(key, value):
        if type(value) in (list, tuple):       # torch.cat's tensors
            return type(value)(to_lazy_run(key, v) for v in value)
        if not _is_tensor(value):
            return value
        c = value.clone()
        if not becomes_lazy(key, value):
            return c
        sources.append((c, value.clone()))
        t = fastlazy.lazy(c)
        return make_pending(t) if pending else t

    lazy_args = [to_lazy_run(i, a) for i, a in enumerate(args)]
    lazy_kwargs = {k: to_lazy_run(k, v) for k, v in kwargs.items()}
    # (what the lazy arguments hold: the caller's tensors, which were cloned
    # for both runs and are never touched; reading the LazyTensors here would
    # flush pending ones)
    lazy_before = list(args)

    # -- eager --
    eager_exc = None
    expected = None
    try:
        expected = fn(*eager_args, **eager_kwargs)
    except Exception as exc:   # noqa: BLE001 -- any exception is an outcome
        eager_exc = exc

    # -- lazy --
    sentinel, sentinel_expected = make_sentinel()
    nodes_before = _core.pending_nodes()
    lazy_exc = None
    got = None
    try:
        got = fn(*lazy_args, **lazy_kwargs)
    except Exception as exc:   # noqa: BLE001
        lazy_exc = exc
    nodes_after = _core.pending_nodes()

    if eager_exc is not None:
        if lazy_exc is None:
            try:
                shown = describe(got) + " = " + repr(got.to_eager() if type(got) is LazyTensor else got)
            except Exception as exc:   # noqa: BLE001
                shown = f"{describe(got)} (raising {type(exc).__name__}: {exc} when read)"
            raise Mismatch(f"eager raises {type(eager_exc).__name__}: {eager_exc}\n"
                           f"lazy returns {shown}")
        if type(lazy_exc) is not type(eager_exc):
            raise Mismatch(f"eager raises {type(eager_exc).__name__}: {eager_exc}\n"
                           f"lazy raises {type(lazy_exc).__name__}: {lazy_exc}")
        if nodes_after > nodes_before:
            raise Mismatch(f"the failed call recorded {nodes_after - nodes_before} node(s)")
        check_sentinel(sentinel, sentinel_expected)
        for i, a in enumerate(lazy_args):
            if type(a) is LazyTensor:
                assert_same(a, lazy_before[i], f"argument {i} after the failed call")
        _check_sources(sources)
        return Outcome(exception=eager_exc, lazy_result=None, nodes_before=nodes_before,
                       nodes_after=nodes_after)

    if lazy_exc is not None:
        raise Mismatch(f"eager returns {describe(expected)}\n"
                       f"lazy raises {type(lazy_exc).__name__}: {lazy_exc}") from lazy_exc

    if returns_self:
        if expected is not eager_args[0]:
            raise Mismatch("test bug: eager in-place call did not return self")
        if got is not lazy_args[0]:
            raise Mismatch(f"in-place call returned {describe(got)}, not its self argument")

    recorded = False
    # an eager out= tensor the call wrote is returned itself, as eager's is
    returns_out = (_is_tensor(expected) and expected is eager_kwargs.get("out")
                   and type(lazy_kwargs.get("out")) is not LazyTensor)
    if returns_out and got is not lazy_kwargs.get("out"):
        raise Mismatch(f"the call returned {describe(got)}, not its eager out= tensor")
    if _is_tensor(expected):
        if (returns_self or returns_out) and _is_tensor(got):
            pass        # an eager self mutated in place stays eager, as in torch
        elif type(got) is not LazyTensor:
            raise Mismatch(f"lazy call returned {type(got).__name__}, not a LazyTensor")
        else:
            recorded = not got.is_materialized
            flushes = fastlazy.metrics.counters()["flushes"]
            # metadata first: it must be known without running anything
            if tuple(got.shape) != tuple(expected.shape):
                raise Mismatch(f"LazyTensor.shape {tuple(got.shape)}, eager {tuple(expected.shape)}")
            if got.dtype != expected.dtype:
                raise Mismatch(f"LazyTensor.dtype {got.dtype}, eager {expected.dtype}")
            if got.ndim != expected.ndim or got.dim() != expected.dim():
                raise Mismatch(f"LazyTensor.ndim {got.ndim}, eager {expected.ndim}")
            if got.numel() != expected.numel():
                raise Mismatch(f"LazyTensor.numel() {got.numel()}, eager {expected.numel()}")
            if got.device != expected.device:
                raise Mismatch(f"LazyTensor.device {got.device}, eager {expected.device}")
            if recorded and (got.is_materialized
                             or fastlazy.metrics.counters()["flushes"] != flushes):
                raise Mismatch("reading shape/dtype ran the graph")
            if expect_recorded is not None and recorded != expect_recorded:
                raise Mismatch("the call was " + ("" if recorded else "not ") + "recorded")
        assert_same(got, expected)
    else:
        if (isinstance(expected, (tuple, list)) and any(map(_is_tensor, expected))
                and all(e is None or _is_tensor(e) for e in expected)):
            # several results (before reading them, which runs the graph),
            # or results and Nones (an output not asked for)
            recorded = isinstance(got, (tuple, list)) and len(got) == len(expected) and all(
                g is None if e is None else type(g) is LazyTensor and not g.is_materialized
                for g, e in zip(got, expected))
        assert_same(got, expected)

    # arguments afterwards: in-place effects (or none) as in eager
    for i, (g, e) in enumerate(zip(lazy_args, eager_args)):
        if _is_tensor(e):
            assert_same(g, e, f"argument {i} after the call")
    for k, e in eager_kwargs.items():
        if _is_tensor(e):
            assert_same(lazy_kwargs[k], e, f"argument {k}= after the call")
    _check_sources(sources)
    check_sentinel(sentinel, sentinel_expected)
    return Outcome(expected=expected, lazy_result=got, recorded=recorded,
                   nodes_before=nodes_before, nodes_after=nodes_after)


def _check_sources(sources):
    for given, pristine in sources:
        if given.dtype == pristine.dtype and given.shape == pristine.shape \
                and _same_bits(given, pristine):
            continue
        try:
            if given.dtype == torch.complex32:
                given, pristine = given.to(torch.complex64), pristine.to(torch.complex64)
            torch.testing.assert_close(given, pristine, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            raise Mismatch(f"a tensor handed to fastlazy.lazy() was mutated: "
                           f"{given} (was {pristine})") from None


# --------------------------------------------------------------------------
# operand specs: a case is written with specs and built into tensors when it
# runs (seeded from its id, so every run sees the same values)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
I8, I32, I64, U8, BOOL = torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool
C64, C128 = torch.complex64, torch.complex128
SHORT = {F16: "f16", BF16: "bf16", F32: "f32", F64: "f64", I32: "i32", I64: "i64",
         U8: "u8", BOOL: "b", C64: "c64", C128: "c128", I8: "i8", torch.int16: "i16"}


@dataclasses.dataclass(frozen=True)
class T:
    """A tensor operand: shape, dtype; `nonzero` for divisors of integer
    floor/trunc division; `special` puts NaN, +-inf and +-0 in (floats)."""
    shape: tuple
    dtype: torch.dtype
    nonzero: bool = False
    special: bool = False
    index: int = 0          # integers: valid indices below this (class targets)

    def make(self):
        d, shape = self.dtype, self.shape
        if self.index:
            return torch.randint(0, self.index, shape, dtype=d)
        if d is BOOL:
            t = torch.ones(shape, dtype=BOOL) if self.nonzero else torch.randint(0, 2, shape).bool()
        elif d is U8:
            t = torch.randint(1 if self.nonzero else 0, 10, shape, dtype=U8)
        elif not d.is_floating_point and not d.is_complex:
            t = torch.randint(-6, 7, shape, dtype=d)
            if self.nonzero:
                t = torch.where(t == 0, torch.ones_like(t), t)
        elif d.is_complex:
            t = (torch.randn(shape, dtype=C128) * 2).to(d)
        else:
            t = (torch.randn(shape, dtype=F64) * 3).to(d)
            if self.special and t.numel():
                flat = t.view(-1)
                vals = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5]
                for k in range(min(len(vals), flat.numel())):
                    flat[k] = vals[k]
        return t

    def __str__(self):
        return (f"T{list(self.shape)}{SHORT[self.dtype]}"
                + ("!0" if self.nonzero else "") + ("*" if self.special else "")
                + (f"<{self.index}" if self.index else ""))


def seed(text):
    """Seed the CPU generator from a case id.  (This is what torch.manual_seed
    does on a CPU-only run, without its CUDA/MPS/XPU side trips, which under
    pytest capture a stack trace per call and cost milliseconds.)"""
    torch.default_generator.manual_seed(zlib.crc32(text.encode()))


def make_value(spec, device="cpu"):
    """A case's argument: T specs made into tensors (on the CPU, from its
    seeded generator, so that every device sees the same values), then moved
    to `device`."""
    if type(spec) in (list, tuple):
        return type(spec)(make_value(v, device) for v in spec)
    if not isinstance(spec, T):
        return spec
    t = spec.make()
    return t if device == "cpu" else t.to(device)


def raises_on_cpu(fn, *args, **kwargs):
    """Does eager raise calling fn with these arguments on the CPU (tensors
    copied there)?  On CUDA, eager checks some values in the kernel with a
    device-side assert, which leaves the CUDA context unusable for the rest
    of the process (an index out of range), and checks others not at all
    (integer division by zero gives whatever the kernel computes): a call
    that raises on the CPU is therefore not run on CUDA, where nothing is
    left to compare or the run itself would break the next tests."""
    def to_cpu(v):
        if type(v) in (list, tuple):
            return type(v)(to_cpu(x) for x in v)
        return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    try:
        fn(*to_cpu(list(args)), **{k: to_cpu(v) for k, v in kwargs.items()})
    except Exception:   # noqa: BLE001 -- any exception
        return True
    return False


def fuzz_settings(device, base=None):
    """Hypothesis settings for a fuzzer's examples on `device`: `base` (the
    loaded profile by default) on the CPU; on CUDA the same with the "cuda"
    profile's fewer examples (conftest: each one launches kernels and
    synchronizes).  A test applies them to a @given function it defines and
    calls itself, since a test's own @settings cannot differ per device."""
    from hypothesis import settings
    base = base if base is not None else settings.default
    if device == "cpu":
        return settings(base)
    return settings(base, max_examples=settings.get_profile("cuda").max_examples)


def show(v):
    if isinstance(v, T):
        return str(v)
    if type(v) in (list, tuple):
        return "[" + ",".join(show(x) for x in v) + "]"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    return repr(v)


# --------------------------------------------------------------------------
# entry-point forms, derived from a row's functions / methods / inplace /
# nn_functions


def operator_for(dunder):
    """`__add__` -> (operator.add, False); `__radd__` -> (operator.add, True)."""
    base = dunder[2:-2]
    if hasattr(operator, base):
        return getattr(operator, base), False
    if base.startswith("r"):
        base = {"div": "truediv"}.get(base[1:], base[1:])
        return getattr(operator, base), True
    raise LookupError(dunder)


def is_dunder(name):
    return name.startswith("__") and name.endswith("__")


@dataclasses.dataclass(frozen=True)
class Form:
    """One way of calling a row, called with the row's operands in parameter
    order (operand 0 is the tensor `self`/`input`)."""
    label: str
    kind: str         # function | nn_function | method | operator | reflected | inplace
    name: str         # torch / torch.nn.functional / Tensor attribute
    inplace: bool     # mutates and returns operand 0
    primary: bool     # first entry point of its kind: the full case set
    swap: bool = False

    @property
    def is_operator(self):
        return self.kind in ("operator", "reflected") or self.kind == "inplace" and is_dunder(self.name)

    @property
    def takes_kwargs(self):
        return not self.is_operator and not is_dunder(self.name)

    @property
    def scalar_self_ok(self):
        """Operand 0 may be a non-tensor (torch.add(2, x))."""
        return self.kind in ("function", "nn_function")

    def __call__(self, *args, **kwargs):
        if self.kind == "function":
            return getattr(torch, self.name)(*args, **kwargs)
        if self.kind == "nn_function":
            return getattr(torch.nn.functional, self.name)(*args, **kwargs)
        if not self.is_operator:
            # x.add(y), x.add_(y), and dunders called directly: x.__radd__(y)
            return getattr(args[0], self.name)(*args[1:], **kwargs)
        op, _ = operator_for(self.name)
        if self.swap:
            return op(args[1], args[0])
        return op(*args)

    def __str__(self):
        return self.label


_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "pow": "**", "eq": "==",
           "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "matmul": "@",
           "iadd": "+=", "isub": "-=", "imul": "*=", "itruediv": "/=", "ipow": "**="}


def _operator_label(name, swap):
    op, _ = operator_for(name)
    if name == "__neg__":
        return "-x"
    if name == "__abs__":
        return "abs(x)"
    sym = _SYMBOL.get(op.__name__, op.__name__)
    return f"y {sym} x" if swap else f"x {sym} y"


def forms_of(row):
    """Every entry point of a row as a Form."""
    all_methods = {m for r in OPS for m in r.methods}
    out = []
    for i, f in enumerate(row.functions):
        out.append(Form(f"torch.{f}", "function", f, False, i == 0))
    for i, f in enumerate(getattr(row, "nn_functions", ())):
        out.append(Form(f"F.{f}", "nn_function", f, False, i == 0))
    first_method = True
    for m in row.methods:
        if is_dunder(m):
            _, swapped = operator_for(m)
            # the operator (a reflected one with the operands swapped: `2 - x`)
            out.append(Form(_operator_label(m, swapped), "reflected" if swapped else "operator",
                            m, False, True, swap=swapped))
            if swapped:
                # and the method called directly: x.__rsub__(y) reaches the
                # entry even when y is a tensor
                out.append(Form(f"Tensor.{m}", "method", m, False, True))
            elif len(row.params) > 1 and f"__r{m[2:]}" not in all_methods:
                # no __rX__ in the table (comparisons, @): `2 < x` reaches
                # x.__gt__(2), `e @ x` Tensor.__matmul__(e, x)
                out.append(Form(_operator_label(m, True), "reflected", m, False, True, swap=True))
        else:
            out.append(Form(f"Tensor.{m}", "method", m, False, first_method))
            first_method = False
    first_inplace = True
    for m in row.inplace:
        if is_dunder(m):
            out.append(Form(_operator_label(m, False), "inplace", m, True, True))
        else:
            out.append(Form(f"Tensor.{m}", "inplace", m, True, first_inplace))
            first_inplace = False
    return out


def returns_self(row, form, args, kwargs):
    """Does this call mutate and return its first argument?  In-place entry
    points do, and so does torch.nn.functional's `inplace=True`."""
    if form.inplace:
        return True
    if "inplace" in row.params:
        k = row.params.index("inplace")
        flag = args[k] if len(args) > k else kwargs.get("inplace", False)
        return flag is True
    return False


class fastlazy_disabled:
    """Context manager: fastlazy disabled inside (to ask eager alone)."""

    def __enter__(self):
        self.was = fastlazy.enabled()
        fastlazy.disable()

    def __exit__(self, *exc):
        if self.was:
            fastlazy.enable()


def first_arguments_of_calls(monkeypatch, owner, name):
    """The first argument of each call of owner.<name> from now on (the
    function wrapped for the test, still called)."""
    seen = []
    real = getattr(owner, name)

    def counted(*args):
        seen.append(args[0])
        return real(*args)
    monkeypatch.setattr(owner, name, counted)
    return seen


def run_in_threads(work, n):
    """work(k) for k in range(n), each on its own thread, all at once; the
    exceptions they raised (an empty list if none did)."""
    errors = []

    def run(k):
        try:
            work(k)
        except Exception as exc:      # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


class Square(torch.autograd.Function):
    """x * x as a custom autograd.Function (a Python forward and backward)."""
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 2 * a * g
