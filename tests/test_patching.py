"""enable()/disable() touch torch exactly as promised."""
import itertools
import subprocess
import sys

import pytest
import torch

import fastlazy
from fastlazy import patching

OWNERS = {"torch": torch, "Tensor": torch.Tensor, "F": torch.nn.functional}
ATTRS = sorted({(next(k for k, v in OWNERS.items() if v is owner), attr)
                for owner, attr, _, _ in itertools.chain(patching.entry_points(),
                                                         patching._inplace_methods())}
               | {("Tensor", "to")})


def owner_of(name):
    return OWNERS[name]


def snapshot():
    return {(t, a): (getattr(owner_of(t), a), a in vars(owner_of(t))) for t, a in ATTRS}


@pytest.fixture(autouse=True)
def start_disabled():
    was = fastlazy.enabled()
    fastlazy.disable()
    yield
    if was:
        fastlazy.enable()


def test_every_table_entry_point_is_patched_and_restored():
    before = snapshot()
    fastlazy.enable()
    assert fastlazy.enabled()
    for (t, a), (orig, _) in before.items():
        assert getattr(owner_of(t), a) is not orig, a
    fastlazy.disable()
    assert snapshot() == before
    for (t, a), (orig, own) in before.items():
        assert getattr(owner_of(t), a) is orig
        assert (a in vars(owner_of(t))) == own


def test_enable_is_idempotent_and_repeatable():
    before = snapshot()
    for _ in range(3):
        fastlazy.enable()
        fastlazy.enable()
        first = torch.add
        fastlazy.enable()
        assert torch.add is first
        fastlazy.disable()
        fastlazy.disable()
        assert snapshot() == before


def test_context_manager_and_nesting():
    before = snapshot()
    with fastlazy.enable():
        with fastlazy.enable():
            pass
        assert fastlazy.enabled()      # the inner one did not disable
    assert not fastlazy.enabled() and snapshot() == before


def test_a_later_patch_by_someone_else_is_kept():
    fastlazy.enable()

    def theirs(*args, **kwargs):
        return "theirs"

    torch.mul = theirs
    try:
        fastlazy.disable()
        assert torch.mul is theirs
        assert torch.add(torch.ones(1), 1).item() == 2
    finally:
        torch.mul = torch._C._VariableFunctions.mul


def test_operators_still_work_after_disable():
    fastlazy.enable()
    fastlazy.disable()
    a = torch.ones(2)
    assert torch.equal(a + a, torch.full((2,), 2.0)) and torch.equal(2 - a, torch.ones(2))
    assert (a == a).all()


def test_import_alone_changes_nothing_in_torch():
    code = (
        "import torch\n"
        "before = dict(vars(torch.Tensor))\n"
        "base = dict(vars(torch._C.TensorBase))\n"
        "tb = dict(vars(torch))\n"
        "import fastlazy\n"
        "assert dict(vars(torch.Tensor)) == before\n"
        "assert all(vars(torch.Tensor)[n] is v for n, v in before.items())\n"
        "assert all(vars(torch._C.TensorBase)[n] is v for n, v in base.items())\n"
        "assert all(getattr(torch, n) is v for n, v in tb.items() if n != 'fastlazy')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_eager_code_unchanged_under_enable():
    a, b = torch.rand(3), torch.rand(3)
    expected = [a + b, a.add(b, alpha=2), torch.sub(a, b), a / b, a.to(torch.float64)]
    with fastlazy.enable():
        got = [a + b, a.add(b, alpha=2), torch.sub(a, b), a / b, a.to(torch.float64)]
        out = torch.empty(3)
        torch.add(a, b, out=out)
        assert torch.equal(out, a + b)
        assert all(type(g) is torch.Tensor for g in got)
        with pytest.raises(TypeError):
            torch.maximum(a, 2)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
