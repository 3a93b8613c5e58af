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


def test_enable_again_installs_the_same_entries_unless_torch_changed():
    """enable() after disable() puts back the entries it made before (a
    `with fastlazy.enable():` around each step pays no rebuild, ~10 ms,
    and finds warm caches); a function someone replaced while fastlazy was
    disabled gets a new entry, which calls theirs."""
    fastlazy.enable()
    add, mul, abs_ = torch.add, torch.mul, torch.Tensor.abs
    fastlazy.disable()
    fastlazy.enable()
    assert torch.add is add and torch.mul is mul and torch.Tensor.abs is abs_
    fastlazy.disable()
    calls = []
    original = torch.mul

    def theirs(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    torch.mul = theirs
    try:
        fastlazy.enable()
        assert torch.mul is not mul and torch.mul is not theirs
        torch.mul(torch.ones(1), 2)
        assert len(calls) == 1
        fastlazy.disable()
        assert torch.mul is theirs
    finally:
        torch.mul = original
    fastlazy.enable()
    assert torch.mul is not theirs and torch.mul.__wrapped__ is original
    assert torch.Tensor.abs is not abs_       # rebuilt with the rest
    fastlazy.disable()


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


def test_a_module_holding_an_entry_point_is_copied_and_pickled_as_with_torchs():
    """A module built under enable() may keep a patched function
    (activation=F.gelu; HuggingFace's activations keep F.gelu):
    nn.TransformerEncoder deep-copies its layer while it is built, and
    torch.save pickles it.  A copy keeps the entry; a pickle holds torch's
    own function, which loads without fastlazy."""
    import copy
    import io
    import pickle
    import torch.nn.functional as F
    fastlazy.enable()
    try:
        assert type(F.gelu).__name__ == "Entry"       # (the case at hand)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, activation=F.gelu, dropout=0.0)
        encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        assert encoder.layers[1].activation is F.gelu
        assert copy.copy(torch.tanh) is torch.tanh and copy.deepcopy(F.gelu) is F.gelu
        assert pickle.loads(pickle.dumps(F.gelu)) is F.gelu.__wrapped__
        assert pickle.loads(pickle.dumps(torch.Tensor.add)) is torch.Tensor.add.__wrapped__
        buffer = io.BytesIO()
        torch.save(encoder, buffer)
        x = torch.randn(1, 3, 16)
        want = encoder(x)
    finally:
        fastlazy.disable()
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.layers[0].activation is F.gelu      # torch's own, fastlazy disabled
    torch.testing.assert_close(loaded(x), want)
    assert copy.deepcopy(layer).activation is layer.activation


def test_enable_again_leaves_dynamos_skip_list_as_it_was():
    # enable() puts fastlazy's files on dynamo's skip list once a process:
    # a list grown at every enable() recompiles a longer pattern each time
    import torch._dynamo.trace_rules as rules
    was = fastlazy.enabled()
    fastlazy.enable()
    count = len(rules.SKIP_DIRS)
    for _ in range(3):
        fastlazy.disable()
        fastlazy.enable()
    assert len(rules.SKIP_DIRS) == count
    assert any(d.endswith("fastlazy/route.py") for d in rules.SKIP_DIRS)
    if not was:
        fastlazy.disable()
