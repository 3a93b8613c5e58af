"""Errors and debugging output say what was wrong and what to do (issue 17,
items 2 and 5)."""
import subprocess
import sys
import traceback

import pytest
import torch

import fastlazy
from fastlazy import LazyTensor


def run(code):
    """`code` in a fresh interpreter (enable() is process-wide)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("call", ["torch.rand(2).to('lazy')",
                                  "torch.nn.Linear(2, 3).to('lazy')",
                                  "torch.rand(2, device='lazy')"])
def test_lazy_device_without_enable_says_to_call_enable(call):
    done = run(f"import torch, fastlazy\n{call}\n")
    assert done.returncode != 0
    assert "fastlazy is not enabled" in done.stderr and "fastlazy.enable()" in done.stderr
    assert "Facebook employee" not in done.stderr


def test_model_to_lazy_leaves_the_module_eager():
    """Modules stay eager: model.to("lazy") moves nothing, a dtype given
    with it still applies, and the model runs on lazy inputs."""
    done = run(
        "import torch, fastlazy\n"
        "fastlazy.enable()\n"
        "m = torch.nn.Linear(2, 3)\n"
        "assert m.to('lazy') is m and m.to(device='lazy') is m\n"
        "assert type(m.weight) is torch.nn.Parameter and m.weight.device.type == 'cpu'\n"
        "assert m.to('lazy', torch.float64).weight.dtype == torch.float64\n"
        "y = m(torch.rand(4, 2, dtype=torch.float64).to('lazy'))\n"
        "assert type(y) is fastlazy.LazyTensor and y.shape == (4, 3)\n"
        "try:\n"
        "    torch.rand(2, device='lazy')\n"
        "except RuntimeError as e:\n"
        "    assert \"t.to('lazy')\" in str(e) and 'fastlazy.lazy(t)' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n")
    assert done.returncode == 0, done.stderr


@pytest.fixture
def on():
    was = fastlazy.enabled()
    fastlazy.enable()
    # site recording takes effect from the next graph: compute one
    (fastlazy.lazy(torch.ones(1)) + 1).to_eager()
    yield
    fastlazy.mark_step()
    if not was:
        fastlazy.disable()


@pytest.mark.parametrize("call", [
    lambda x: x @ torch.rand(4, 5),
    lambda x: x.view(7),
    lambda x: torch.nn.functional.conv2d(x, torch.rand(1, 1, 3, 3)),
    lambda x: torch.cat([x, torch.rand(3, 4)]),
    lambda x: x + torch.rand(4),
], ids=["matmul", "view", "conv2d", "cat", "add"])
def test_shape_errors_are_eagers_alone(on, call):
    with pytest.raises(RuntimeError) as eager:
        call(torch.rand(2, 3))
    with pytest.raises(RuntimeError) as lazy:
        call(fastlazy.lazy(torch.rand(2, 3)))
    assert str(lazy.value) == str(eager.value)
    assert lazy.value.__context__ is None or lazy.value.__suppress_context__
    text = "".join(traceback.format_exception(lazy.value))
    assert "During handling" not in text and "Unsafe" not in text


def embedding_step(weight, i):
    idx = fastlazy.lazy(torch.tensor([0, i])) + 0
    e = torch.nn.functional.embedding(idx, weight)      # the recording line
    return e * 2


@pytest.mark.parametrize("backend", ["torchscript", "native", "eager"])
@pytest.mark.parametrize("cached", [False, True], ids=["first run", "cache hit"])
def test_value_error_at_a_read_names_the_op_and_its_recording_line(on, backend, cached):
    before = fastlazy.backend()
    fastlazy.set_backend(backend)
    fastlazy.debug.record_sites(True)
    (fastlazy.lazy(torch.ones(1)) + 1).to_eager()
    try:
        weight = torch.rand(3, 2)
        if cached:
            embedding_step(weight, 1).to_eager()
        y = embedding_step(weight, 5)
        with pytest.raises(IndexError, match="index out of range") as info:
            y.to_eager()
    finally:
        fastlazy.debug.record_sites(False)
        fastlazy.set_backend(before)
    text = "".join(traceback.format_exception(info.value))
    line = embedding_step.__code__.co_firstlineno + 2
    assert f"raised by F.embedding (2x2 torch.float32) recorded at {__file__}:{line}" in text
    assert "computed when a value was read at " + __file__ in text
    assert "TorchScript" not in text and "During handling" not in text


def test_value_error_without_sites_says_how_to_get_them(on):
    y = embedding_step(torch.rand(3, 2), 7)
    with pytest.raises(IndexError) as info:
        y.to_eager()
    text = "".join(traceback.format_exception(info.value))
    assert "raised by F.embedding" in text
    assert "FASTLAZY_SITES=1" in text and "FASTLAZY_SYNC=1" in text


def test_metrics_report_names_the_compile_site_of_a_script_beside_the_package(tmp_path):
    """A script whose name starts like the package's directory
    (fastlazy_demo.py) is the user's, not fastlazy's own code."""
    script = tmp_path / "fastlazy_demo.py"
    script.write_text("import torch, fastlazy\n"
                      "fastlazy.enable()\n"
                      "a = torch.rand(4, 4).to('lazy')\n"
                      "print((a * 2 + 1).sum().item())\n"
                      "print(fastlazy.metrics.report())\n")
    import os
    package_parent = os.path.dirname(os.path.dirname(fastlazy.__file__))
    link = os.path.join(package_parent, "fastlazy_demo_test_messages.py")
    with open(link, "w") as f:
        f.write(script.read_text())
    try:
        done = subprocess.run([sys.executable, link], capture_output=True, text=True,
                              timeout=120, cwd=package_parent)
    finally:
        os.remove(link)
    assert done.returncode == 0, done.stderr
    assert "@ <unknown>" not in done.stdout
    assert f"first graph @ {link}:4" in done.stdout


def test_dump_ir_of_one_tensor_and_of_a_computed_one(on):
    x = fastlazy.lazy(torch.rand(2, 3))
    y = x * 3 + 1
    text = fastlazy.debug.dump_ir(y, "text")
    assert "mul(" in text and "add(" in text
    assert not y.is_materialized                    # dumping computes nothing
    assert "aten::mul" in fastlazy.debug.dump_ir(y, "backend")
    y.to_eager()
    assert "aten::mul" in fastlazy.debug.dump_ir([y], "backend")   # the code that ran
    with pytest.raises(ValueError, match="nothing to compile"):
        fastlazy.debug.dump_ir([x], "backend")


def test_data_ptr_of_a_pending_tensor_warns_nothing(on, recwarn):
    y = fastlazy.lazy(torch.rand(2, 3)) * 2
    assert y.data_ptr() == y.to_eager().data_ptr()
    assert not [w for w in recwarn if "FakeTensor" in str(w.message)]
    assert type(y) is LazyTensor


@pytest.mark.parametrize("convert", [float, int, bool], ids=lambda f: f.__name__)
def test_a_number_read_from_a_tensor_that_requires_grad_warns_as_eagers(on, convert):
    # (eager warns for float() only: "Converting a tensor with
    # requires_grad=True to a scalar may lead to unexpected behavior")
    w = torch.ones(1, requires_grad=True)

    def warnings_of(x):
        with pytest.warns() if convert is float else _no_warnings() as seen:
            convert((x * w).sum())
        return [str(m.message)[:40] for m in seen]
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)             # (eager's warning is one per process)
    try:
        assert warnings_of(fastlazy.lazy(torch.ones(1))) == warnings_of(torch.ones(1))
    finally:
        torch.set_warn_always(before)


class _no_warnings:
    def __enter__(self):
        import warnings
        self._catch = warnings.catch_warnings(record=True)
        seen = self._catch.__enter__()
        warnings.simplefilter("always")
        return seen

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def test_readme_example_report_names_its_compile_site():
    """The README's ten lines print metrics.report(): its compile is named
    by the snippet's line, not '<unknown>'."""
    import pathlib
    import re
    readme = pathlib.Path(__file__).resolve().parent.parent / "README.md"
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
                 if "metrics.report()" in b)
    done = run(block)
    assert done.returncode == 0, done.stderr
    assert "first graph @ <string>:" in done.stdout and "<unknown>" not in done.stdout
