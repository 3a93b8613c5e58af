"""The fast tier's packed convolutions (fastlazy.packed_convs): an inference
graph's convolutions run with their weights packed once for oneDNN, where
that is faster than ATen's own choice, with eager's shapes, dtypes and
strides and eager's values to rounding, whatever happens to the parameters.

Whether a convolution is packed, and the trial between the plain and the
packed program, are decided by timing; these tests decide both for
packing (`packed_wins`), so that what runs is what the test set up, except
where they test the timing itself with a gap no loaded machine closes.
"""
import gc

import pytest
import torch
from torch import nn

import fastlazy
from fastlazy import graph_cache, packed_convs, tiering

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)

pytestmark = pytest.mark.skipif(not packed_convs.enabled(),
                                reason="needs the step executor and oneDNN")

TOLERANCE = dict(rtol=1e-4, atol=1e-5)
RUNS = packed_convs.PLAN_AT + 2 * (packed_convs.TRIAL_RUNS + 1) + 3   # past the trial


@pytest.fixture
def engine(monkeypatch):
    """The default engine, no background compile, an empty cache, zeroed
    counters."""
    before = fastlazy.backend()
    fastlazy.mark_step()
    fastlazy.set_backend("auto")
    monkeypatch.setattr(tiering.ENGINE, "hot_after", 10 ** 9)
    graph_cache.clear()
    fastlazy.metrics.reset()
    yield
    fastlazy.mark_step()
    graph_cache.clear()
    fastlazy.set_backend(before)


@pytest.fixture
def packed_wins(engine, monkeypatch):
    """Every convolution is packed, and every trial keeps the packed
    program."""
    def decide(trial):
        trial.call = trial._packed
    monkeypatch.setattr(packed_convs._Trial, "_decide", decide)
    monkeypatch.setattr(packed_convs, "_packing_pays", lambda weight, w, packed: True)


def _net(seed=0, channels=32):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, stride=2, padding=1, bias=False), nn.ReLU(),
        nn.Conv2d(channels, channels, 1),
        nn.Conv2d(channels, 8, (3, 1), padding=(1, 0), dilation=(2, 1))).eval()


def _counter(name):
    return fastlazy.metrics.counters()[name]


def _runs(net, x, n=RUNS):
    """n runs of net on x (lazy), each checked against eager's; after the
    run that plans the packing, its reorders beside the user's thread waited for."""
    with torch.no_grad():
        want = net(x)
        for k in range(n):
            got = net(x.to("lazy")).to_eager()
            torch.testing.assert_close(got, want, **TOLERANCE)
            assert got.stride() == want.stride()
            if k + 1 == packed_convs.PLAN_AT:
                assert tiering.wait(120)
    return got


def test_packed_program_gives_eagers_values_and_strides(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    assert _counter("packed_conv_trials") == 1
    # the graph that ran is the packed one: it calls the packed op
    (program,) = graph_cache.programs.values()
    assert program._fast.call == program._fast._packed
    assert len(program._fast.packed) == 4
    assert all(p.numel() > 0 for p in program._fast.packed)


def test_a_convolution_packing_does_not_pay_for_runs_atens(packed_wins, monkeypatch):
    # the 1x1 judged slower packed: its packed weight is empty, the op
    # calls ATen's convolution, and a write to its weight (which makes the
    # trial pack its packed weights again) packs it still not
    monkeypatch.setattr(packed_convs, "_packing_pays",
                        lambda weight, w, packed: w.shape[-2:] != (1, 1))
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    trial = program._fast
    assert trial.call == trial._packed
    assert [p.numel() == 0 for p in trial.packed] == [False, False, True, False]
    with torch.no_grad():
        net[5].weight.mul_(2)
    repacks = _counter("packed_conv_repacks")
    _runs(net, x, 2)
    assert _counter("packed_conv_repacks") == repacks + 3
    assert trial.packed[2].numel() == 0


def test_the_packed_op_without_a_packed_weight_is_atens_convolution(engine):
    op = packed_convs.step_executor.packed_conv_op()
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3), torch.randn(6)
    got = op(x, w, packed_convs.NOT_PACKED, b, [1, 0], [2, 1], [1, 2], 2)
    assert torch.equal(got, torch.conv2d(x, w, b, [2, 1], [1, 0], [1, 2], 2))


def test_a_graph_no_convolution_of_which_gains_is_not_packed(packed_wins, monkeypatch):
    monkeypatch.setattr(packed_convs, "_packing_pays", lambda weight, w, packed: False)
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    assert program._fast.call == program._fast.plain and program._fast.packed is None
    assert _counter("packed_conv_trials") == 0


def test_a_view_of_a_packed_convolutions_result_has_eagers_strides(packed_wins):
    # oneDNN writes channels-last: a view that needs eager's layout must work
    torch.manual_seed(1)
    conv = nn.Conv2d(4, 6, 3).eval()
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        want = conv(x).view(6, -1).sum(1)
        for k in range(RUNS):
            got = conv(x.to("lazy")).view(6, -1).sum(1).to_eager()
            torch.testing.assert_close(got, want, **TOLERANCE)
            if k + 1 == packed_convs.PLAN_AT:
                assert tiering.wait(120)
    assert _counter("packed_conv_trials") == 1


def test_layouts_follow_the_weight_and_input_of_each_call(packed_wins):
    # weights both channels-last and contiguous by their strides (1x1,
    # depthwise, one input channel): eager asks their suggested format,
    # channels-last, and lays its result out so (_runs checks strides)
    for conv in (nn.Conv2d(8, 16, 1), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                 nn.Conv2d(1, 16, 3, padding=1)):
        graph_cache.clear()
        conv = conv.eval().to(memory_format=torch.channels_last)
        _runs(conv, torch.randn(2, conv.in_channels, 16, 16))
    assert _counter("packed_conv_trials") == 3
    # a model made channels-last after its weights were packed
    graph_cache.clear()
    torch.manual_seed(6)
    conv = nn.Conv2d(4, 8, 3, padding=1).eval()
    x = torch.randn(1, 4, 8, 8)
    _runs(conv, x)
    conv.to(memory_format=torch.channels_last)
    assert _runs(conv, x, 3).is_contiguous(memory_format=torch.channels_last)


def test_results_with_a_dim_of_one_have_eagers_strides(packed_wins):
    # oneDNN's channels-last result of one channel, or of a 1x1 image, is
    # also contiguous, but its strides are not eager's: the next
    # convolution would take it for channels-last
    torch.manual_seed(7)
    _runs(nn.Sequential(nn.Conv2d(8, 1, 3), nn.Conv2d(1, 16, 3, padding=1)).eval(),
          torch.randn(2, 8, 7, 7))
    graph_cache.clear()
    _runs(nn.Conv2d(8, 16, 3).eval(), torch.randn(1, 8, 3, 3))
    assert _counter("packed_conv_trials") == 2


def test_every_write_through_data_is_packed_again(packed_wins):
    # a write through `.data` bumps no version counter: the core's watch
    # tells of it, once per watch
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    for _ in range(3):
        with torch.no_grad():
            net[0].weight.data.mul_(2)
        _runs(net, x, 2)


def test_no_call_waits_for_the_packing(packed_wins, monkeypatch):
    """The weights are packed on a thread beside the user's: the calls
    meanwhile run the plain program."""
    import threading
    import time
    release = threading.Event()
    real_pack = packed_convs._Weight.pack

    def slow_pack(self, w):
        release.wait(60)
        return real_pack(self, w)
    monkeypatch.setattr(packed_convs._Weight, "pack", slow_pack)
    net, x = _net(), torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        want = net(x)
        start = time.perf_counter()
        for _ in range(packed_convs.PLAN_AT + 3):
            torch.testing.assert_close(net(x.to("lazy")).to_eager(), want, **TOLERANCE)
        assert time.perf_counter() - start < 30
        (program,) = graph_cache.programs.values()
        trial = program._fast
        assert trial.call == trial.plain and trial.packed is None
        assert _counter("packed_conv_trials") == 0
        release.set()
        assert tiering.wait(120)
        assert trial.packed is not None and _counter("packed_conv_trials") == 1
    _runs(net, x)
    assert trial.call == trial._packed


def test_the_packed_program_is_compiled_beside_the_users_thread(packed_wins, monkeypatch):
    """The call that plans the packing only finds the candidates: the
    packed program's compile (a millisecond or more of a graph's second
    call) runs on the thread beside the user's."""
    import threading
    compiled_on = []
    backend = packed_convs.backends.get("torchscript")
    real_compile = backend.compile

    def compile(view):
        compiled_on.append(threading.get_ident())
        return real_compile(view)
    net, x = _net(), torch.randn(1, 3, 12, 12)
    with torch.no_grad():
        for _ in range(packed_convs.PLAN_AT - 1):
            net(x.to("lazy")).to_eager()
        monkeypatch.setattr(backend, "compile", compile)
        net(x.to("lazy")).to_eager()          # plans the packing
    assert tiering.wait(120)
    assert len(compiled_on) == 1 and compiled_on[0] != threading.get_ident()
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    assert program._fast.call == program._fast._packed


def test_channels_last_input_and_weight_keep_eagers_layout(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    got = _runs(net, x)
    assert got.is_contiguous(memory_format=torch.channels_last)
    graph_cache.clear()
    conv = nn.Conv2d(3, 5, 3).eval().to(memory_format=torch.channels_last)
    got = _runs(conv, torch.randn(1, 3, 9, 9))
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_written_parameters_are_packed_again(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    with torch.no_grad():
        net[0].weight.mul_(0.5)               # bumps the version counter
    _runs(net, x, 2)
    assert _counter("packed_conv_repacks") >= 1
    repacks = _counter("packed_conv_repacks")
    net[3].weight.data.add_(0.25)             # through .data: no version bump
    _runs(net, x, 2)
    assert _counter("packed_conv_repacks") > repacks
    net[6].weight.data = torch.randn_like(net[6].weight)     # new memory
    _runs(net, x, 2)


def test_other_parameters_and_sizes_run_the_plain_program(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    trial, plain_runs = program._fast, []
    plain = trial.plain
    trial.plain = lambda *inputs: (plain_runs.append(1), plain(*inputs))[1]
    other = _net(seed=5)                      # the same graph structure
    _runs(other, x, 3)
    _runs(net, torch.randn(1, 3, 16, 16), 3)  # another size, the same structure
    _runs(net, x, 2)
    assert len(graph_cache.programs) == 1
    assert trial.packed is not None and trial.foreign_runs == 3 and len(plain_runs) == 6


def test_packing_is_given_up_when_other_parameters_keep_coming(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    for seed in range(packed_convs.MAX_FOREIGN_RUNS + 1):
        _runs(_net(seed=10 + seed), x, 1)
    (program,) = graph_cache.programs.values()
    assert program._fast.packed is None and program._fast.call == program._fast.plain
    _runs(net, x, 2)


def test_a_dropped_models_packed_weights_are_let_go(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    trial = program._fast
    del net
    gc.collect()
    assert trial.packed is None


def test_swap_tensors_of_a_packed_parameter(packed_wins):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    torch.utils.swap_tensors(net[0].weight, nn.Parameter(torch.randn_like(net[0].weight)))
    _runs(net, x, 3)


def test_training_graphs_and_switched_off_are_not_packed(engine, monkeypatch):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    for _ in range(RUNS):
        net(x.to("lazy")).sum().to_eager()    # records autograd history
    assert _counter("packed_conv_trials") == 0
    monkeypatch.setenv("FASTLAZY_PACKED_CONVS", "0")
    _runs(net, x)
    assert _counter("packed_conv_trials") == 0


@pytest.fixture
def threads():
    """torch.set_num_threads for the test (the thread that packs beside
    the user's takes its count from it); the count before restored."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_convolutions_are_judged_by_their_times(engine, threads, monkeypatch):
    # on one intra-op thread, 16 channels of 16x16 through a 1x1: ATen's
    # GEMM took 5 us, the packed call 25 us (copying oneDNN's channels-last
    # result back included); a 16x16 patch embedding (ATen's oneDNN call
    # reorders its weight at every call) 88 against 43 us
    threads(1)
    judged = []
    real = packed_convs._packing_pays
    monkeypatch.setattr(packed_convs, "_packing_pays",
                        lambda *args: judged.append(real(*args)) or judged[-1])
    torch.manual_seed(4)
    _runs(nn.Conv2d(16, 16, 1).eval(), torch.randn(1, 16, 16, 16))
    assert judged == [False] and _counter("packed_conv_trials") == 0
    graph_cache.clear()
    _runs(nn.Conv2d(3, 128, 16, stride=16).eval(), torch.randn(1, 3, 64, 64))
    assert judged == [False, True] and _counter("packed_conv_trials") == 1


def test_judging_draws_no_random_numbers(engine, threads):
    # the judge runs beside the user's thread: a draw there would move the
    # user's random stream (a dropout mask after an evaluation pass)
    threads(1)
    torch.manual_seed(8)
    conv, x = nn.Conv2d(3, 128, 16, stride=16).eval(), torch.randn(1, 3, 64, 64)
    want = torch.rand(4)
    torch.manual_seed(8)
    conv, x = nn.Conv2d(3, 128, 16, stride=16).eval(), torch.randn(1, 3, 64, 64)
    _runs(conv, x)            # (waits for the packing and judging)
    assert _counter("packed_conv_trials") == 1
    assert torch.equal(torch.rand(4), want)


def test_with_several_threads_sizes_decide(engine, threads, monkeypatch):
    threads(2)
    monkeypatch.setattr(packed_convs.step_executor, "conv_times_op", None)   # never timed
    torch.manual_seed(5)
    _runs(nn.Conv2d(16, 16, 1).eval(), torch.randn(1, 16, 16, 16))
    assert _counter("packed_conv_trials") == 0
    graph_cache.clear()
    _runs(nn.Conv2d(512, 512, 3, padding=1).eval(), torch.randn(1, 512, 2, 2))
    assert _counter("packed_conv_trials") == 1


def test_the_trial_keeps_the_faster_program(engine, threads, monkeypatch):
    # batch 1, 512 channels of 2x2: ATen's im2col path takes about ten
    # times oneDNN's with the weight packed (both in the convolution's own
    # timing and in the graph's trial); on one intra-op thread, whose runs
    # a loaded machine does not stall as it stalls a team of threads that
    # wait for each other
    threads(1)
    torch.manual_seed(2)
    conv = nn.Conv2d(512, 512, 3, padding=1).eval()
    _runs(conv, torch.randn(1, 512, 2, 2))
    assert _counter("packed_conv_graphs") == 1
    graph_cache.clear()
    fastlazy.metrics.reset()
    # slower by far more than a loaded machine's scheduling delays (a CI run
    # beside two other jobs on 2 cores saw the plain program's runs take
    # over 10 ms more than the packed one's)
    monkeypatch.setattr(packed_convs._Trial, "_packed",
                        lambda self, *inputs: (__import__("time").sleep(0.1), self.plain(*inputs))[1])
    _runs(conv, torch.randn(1, 512, 2, 2))
    assert _counter("packed_conv_trials") == 1 and _counter("packed_conv_graphs") == 0


def test_a_packed_program_that_fails_leaves_the_plain_one(packed_wins, monkeypatch):
    net, x = _net(), torch.randn(1, 3, 12, 12)
    _runs(net, x)
    (program,) = graph_cache.programs.values()
    trial = program._fast

    def refuses(*inputs):
        raise RuntimeError("oneDNN refuses")
    monkeypatch.setattr(trial, "packed_call", refuses)
    _runs(net, x, 2)
    assert trial.packed is None and _counter("packed_conv_failures") == 1
