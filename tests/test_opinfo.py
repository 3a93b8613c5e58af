"""PyTorch's own op catalogue (OpInfo) run lazily against eager.

Every OpInfo op with float32 samples on the CPU runs on LazyTensor inputs and
must give eager's result: recorded by a C rule where the op table has one,
by the generic path (fake-tensor signatures) where the op is pure, through
the eager fallback otherwise.  A summary line reports how many ops
recorded natively, fell back, and failed.
"""
import collections
import types

import pytest
import torch
from torch.utils._pytree import tree_map

import fastlazy

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")

SAMPLES_PER_OP = 2
RESULTS = collections.Counter()
FAILED = []

# Ops whose OpInfo sample functions or comparison do not apply to a value
# wrapper (they inspect storage, strides or memory layout, or compare
# identity), not recorded-op semantics.
SKIP = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
        "empty_permuted", "as_strided", "as_strided_scatter", "as_strided_copy",
        "item", "equal", "allclose", "isclose", "is_nonzero", "resize_", "resize_as_",
        "nonzero_static", "to_sparse", "storage_offset", "stride", "data_ptr",
        "_unsafe_masked_index", "_unsafe_masked_index_put_accumulate", "bernoulli",
        "normal", "rand_like", "randn_like", "randint_like", "uniform", "multinomial",
        "cauchy", "exponential", "geometric", "log_normal", "randint",
        "nn.functional.dropout", "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout", "nn.functional.dropout2d",
        "nn.functional.dropout3d", "nn.functional.rrelu", "torch.ops.aten._efficientzerotensor"}


def ops():
    for op in common.op_db:
        if op.name in SKIP or op.variant_test_name:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        yield op


def _lazy(x):
    return fastlazy.lazy(x) if isinstance(x, torch.Tensor) and x.layout == torch.strided \
        and not x.is_complex() and x.dim() <= 8 else x


def _eager(x):
    return x.to_eager() if isinstance(x, fastlazy.LazyTensor) else x


def _compare(got, want):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=1e-5)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _compare(g, w)
    else:
        assert got == want or (got != got and want != want)


# The backends whose lowering of captured programs differs most from eager's
# calls: TorchScript IR, and the native backend's steps (the eager backend
# calls the same aten ops one by one, as the differential suite checks).
# The summary counts the first.
OPINFO_BACKENDS = ("torchscript", "native")


@pytest.mark.parametrize("backend", OPINFO_BACKENDS, indirect=True)
@pytest.mark.parametrize("op", list(ops()), ids=lambda op: op.name)
def test_opinfo_op(op, backend, lazy_on):
    counted = backend == OPINFO_BACKENDS[0]
    samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:SAMPLES_PER_OP]
    if not samples:
        pytest.skip("no samples")
    for sample in samples:
        torch.manual_seed(0)
        try:
            want = op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # eager rejects its own sample: skip it
            RESULTS["eager raises"] += counted
            continue
        fastlazy.metrics.reset()
        args = tree_map(_lazy, (sample.input, sample.args, sample.kwargs))
        torch.manual_seed(0)
        fn = op.op
        if isinstance(fn, (types.MethodDescriptorType, types.WrapperDescriptorType)):
            # an unbound TensorBase method only accepts TensorBase instances;
            # on a LazyTensor the same method is its own attribute
            fn = getattr(fastlazy.LazyTensor, fn.__name__)
        try:
            got = tree_map(_eager, fn(args[0], *args[1], **args[2]))
            _compare(got, want)
        except Exception as exc:
            RESULTS["failed"] += 1
            FAILED.append(f"{op.name} ({backend}): {type(exc).__name__}: {str(exc)[:120]}")
            raise
    c = fastlazy.metrics.counters()
    RESULTS["fallback" if not c["nodes_recorded"] else
            "partly" if c["fallbacks"] else
            "generic" if c["generic_calls"] else "native"] += counted


def test_opinfo_summary(request):
    """Prints the summary (run last by name order within the module)."""
    total = sum(v for k, v in RESULTS.items() if k in ("native", "generic", "partly", "fallback"))
    print(f"\nOpInfo ({OPINFO_BACKENDS[0]}): {total} ops passed: {RESULTS['native']} recorded by C rules, "
          f"{RESULTS['generic']} by the generic path, {RESULTS['partly']} partly recorded, "
          f"{RESULTS['fallback']} through the fallback; {RESULTS['failed']} failed "
          f"(on any of {', '.join(OPINFO_BACKENDS)})")
    for line in FAILED:
        print("  FAILED", line)
