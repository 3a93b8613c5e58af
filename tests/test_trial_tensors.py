"""The trial tensors kept between trial runs (fastlazy/trial_tensors.py)."""
import threading

import torch

from fastlazy import trial_tensors


def _make(fill=0):
    return trial_tensors.maker(torch.Generator().manual_seed(0), fill)


def test_a_second_trial_run_of_the_same_sizes_draws_nothing():
    trial_tensors.clear()
    first = _make()((1000, 128), torch.float32, "cpu")
    again = _make()((1000, 128), torch.float32, "cpu")
    assert again is first
    assert 0 <= float(first.min()) and float(first.max()) < 1


def test_arguments_of_one_trial_run_never_alias():
    trial_tensors.clear()
    make = _make()
    a = make((4, 4), torch.float32, "cpu")
    b = make((4, 4), torch.float32, "cpu")
    assert a is not b and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_a_tensor_written_by_a_trial_run_is_not_handed_out_again():
    trial_tensors.clear()
    first = _make(fill=0)((3,), torch.int64, "cpu")
    first.add_(5)                                        # the trial wrote it
    again = _make(fill=0)((3,), torch.int64, "cpu")
    assert again is not first and again.tolist() == [0, 0, 0]
    first = _make()((2, 3), torch.float32, "cpu")
    first.t_()                                           # an in-place view op
    again = _make()((2, 3), torch.float32, "cpu")
    assert again is not first and again.shape == (2, 3)


def test_integer_fills_and_requires_grad_are_each_calls_own():
    trial_tensors.clear()
    zeros = _make(fill=0)((5,), torch.int64, "cpu")
    ones = _make(fill=1)((5,), torch.int64, "cpu")
    assert zeros.tolist() == [0] * 5 and ones.tolist() == [1] * 5
    leaf = _make()((2,), torch.float32, "cpu", requires_grad=True)
    assert leaf.requires_grad
    assert not _make()((2,), torch.float32, "cpu").requires_grad


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(trial_tensors, "CACHE_BYTES", 4096)
    trial_tensors.clear()
    for n in range(1, 20):
        _make()((n, 64), torch.float32, "cpu")          # n * 256 bytes
    assert trial_tensors.kept() < 19
    big = _make()((4096,), torch.float32, "cpu")         # larger than the cache
    assert _make()((4096,), torch.float32, "cpu") is not big


def test_each_thread_keeps_its_own():
    trial_tensors.clear()
    mine = _make()((8,), torch.float32, "cpu")
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(_make()((8,), torch.float32, "cpu")))
    thread.start()
    thread.join()
    assert theirs[0] is not mine


def test_trial_tensors_made_under_inference_mode_are_kept_and_checked():
    """torch.inference_mode() makes inference tensors, which have no version
    counter: the cache must still check the ones it hands out."""
    trial_tensors.clear()
    with torch.inference_mode():
        first = _make(fill=0)((3,), torch.int64, "cpu")
        assert not first.is_inference()
        first.add_(1)                                    # the trial wrote it
        again = _make(fill=0)((3,), torch.int64, "cpu")
    assert again is not first and again.tolist() == [0, 0, 0]


def test_a_new_signature_under_inference_mode_gets_eagers_values(lazy_on):
    """A call's first analysis under torch.inference_mode() (a trial run)."""
    import fastlazy
    torch.manual_seed(0)
    conv, x = torch.nn.Conv2d(3, 5, 3), torch.randn(1, 3, 9, 11)   # a signature no test has
    trial_tensors.clear()
    with torch.inference_mode():
        want = conv(x)
        got = conv(fastlazy.lazy(x)).to_eager()
    torch.testing.assert_close(got, want)
