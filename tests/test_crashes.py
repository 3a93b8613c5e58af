"""Calls that once crashed the process: each runs in a subprocess with a
timeout, so a crash fails the test instead of the suite.

Tensor methods that call Python back (apply_, map_, map2_) or read a
tensor's memory must never run on the generic path's fake tensors, which
have no memory: with bad arguments they raise eager's error at the call,
with good ones they give eager's value."""
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import torch, fastlazy
    fastlazy.enable()
    t = torch.rand(3)
    keep = t.clone()
    lazy = fastlazy.lazy(t) if {materialized} else fastlazy.lazy(t) * 1
    try:
        got = lazy.{call}
    except Exception as exc:
        got = exc
    try:
        want = (keep.clone() * 1).{call}
    except Exception as exc:
        want = exc
    if isinstance(want, Exception):
        assert type(got) is type(want), (got, want)
        print("raised", type(got).__name__)
    else:
        value = got.to_eager() if type(got) is fastlazy.LazyTensor else got
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(want)), (value, want)
        print("value")
    assert torch.equal(t, keep), "the eager tensor a LazyTensor was made from was written"
""")

CALLS = ["apply_(None)", "apply_(1)", "apply_('abc')", "apply_(lambda v: v * 2)",
         "map_(torch.rand(3), None)", "map_(torch.ones(3), lambda a, b: a + b)",
         "map2_(torch.rand(3), torch.rand(3), None)", "data_ptr() > 0", "tolist()",
         "element_size()"]


@pytest.mark.parametrize("materialized", [True, False])
@pytest.mark.parametrize("call", CALLS)
def test_no_crash_and_eagers_result(call, materialized):
    program = PROGRAM.format(call=call, materialized=materialized)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"


LEGACY_CONSTRUCTOR = textwrap.dedent("""
    import torch, fastlazy
    fastlazy.enable()
    x = torch.rand(3)
    lazy = fastlazy.lazy(x.clone()) * 1
    alias = torch.Tensor(lazy)              # eager: an alias of its argument
    alias.mul_(2)
    assert torch.equal(lazy.to_eager(), x * 2), "torch.Tensor(x) is not x's alias"
    mixed = torch.Tensor([fastlazy.lazy(torch.tensor(1.5)), 2.0])   # data: read
    assert torch.equal(mixed, torch.Tensor([1.5, 2.0])), mixed
    double = torch.Tensor(fastlazy.lazy(torch.ones(2, dtype=torch.float64)))
    assert double.dtype == torch.float64 and type(double) is fastlazy.LazyTensor
    print("ok")
""")


def test_the_legacy_tensor_constructor_takes_a_lazy_tensor():
    """torch.Tensor(x) parses x as a C tensor (a LazyTensor answers
    isinstance(x, torch.Tensor)): it crashed the process."""
    done = subprocess.run([sys.executable, "-c", LEGACY_CONSTRUCTOR], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "ok"


# torch's argument parser reads the at::Tensor of any object isinstance()
# calls a tensor where a signature lets a 0-dim tensor stand for a number:
# remainder's (Scalar self, Tensor other) overload is tried before (Tensor,
# Scalar), renorm's maxnorm (torch's factories, threshold's value, histc's
# bins and the others of conversions.NUMBER_ARGUMENTS read theirs).
NUMBER_PARAMETERS = textwrap.dedent("""
    import torch, fastlazy
    fastlazy.enable()
    x, i, s = torch.tensor([7., -7., 3.]), torch.tensor([7, -7, 3]), torch.tensor(2.)
    lx, li, ls = (fastlazy.lazy(t) * 1 for t in (x, i, s))
    for got, want in [(torch.remainder(lx, 3), torch.remainder(x, 3)),
                      (torch.remainder(3, lx), torch.remainder(3, x)),
                      (torch.bitwise_and(li, 3), torch.bitwise_and(i, 3)),
                      (torch.bitwise_or(3, li), torch.bitwise_or(3, i)),
                      (torch.pow(2, lx), torch.pow(2, x)),
                      (torch.xlogy(3, lx), torch.xlogy(3, x)),
                      (torch.clamp(x, min=ls), torch.clamp(x, min=s)),
                      (x.clone().fill_(ls), x.clone().fill_(s)),
                      # factories read a number given as a 0-dim tensor, as eager does
                      (torch.full((2,), ls), torch.full((2,), s)),
                      (torch.arange(li.sum()), torch.arange(i.sum())),
                      (torch.zeros((li.sum(), 2)), torch.zeros((i.sum(), 2))),
                      (torch.tril_indices(li.sum(), 2), torch.tril_indices(i.sum(), 2)),
                      # and so do the functions of conversions.NUMBER_ARGUMENTS
                      (torch.threshold(lx, 0.0, ls), torch.threshold(x, 0.0, s)),
                      (torch.histc(x, bins=li.sum()), torch.histc(x, bins=i.sum()))]:
        got = got.to_eager() if type(got) is fastlazy.LazyTensor else got
        torch.testing.assert_close(got, want, equal_nan=True)
    # a LazyTensor given for a number elsewhere: torch's own TypeError, not a crash
    for call in (lambda: torch.renorm(x[None], 2, 0, maxnorm=ls),):
        try:
            call()
        except TypeError as exc:
            assert "LazyTensor" in str(exc), exc
        else:
            raise AssertionError("a LazyTensor was taken for a number")
    print("ok")
""")


def test_a_lazy_tensor_where_a_signature_takes_a_number_is_not_read_as_a_tensor():
    done = subprocess.run([sys.executable, "-c", NUMBER_PARAMETERS], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "ok"
