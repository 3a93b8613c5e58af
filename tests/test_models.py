"""Unmodified nn modules with LazyTensor inputs: eager's outputs, losses and
gradients, in eval and in training, on the CPU and on CUDA (the `device`
fixture: eager on the same device is the oracle)."""
import pytest
import torch
from torch import nn

import fastlazy
from fastlazy import metrics

pytestmark = pytest.mark.usefixtures("lazy_on")


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.SiLU(),
                         nn.Linear(32, 32), nn.LeakyReLU(0.1), nn.Linear(32, 4),
                         nn.LogSoftmax(dim=-1))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Linear(8, 4))


def transformer():
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                      dropout=0.0, batch_first=True)


MODELS = {"mlp": (mlp, (8, 16)), "cnn": (cnn, (2, 3, 8, 8)),
          "transformer": (transformer, (2, 5, 32))}


def run(model, x, lazy, train):
    model.train(train)
    inp = x.to("lazy") if lazy else x
    out = model(inp)
    loss = out.float().pow(2).mean()
    if train:
        model.zero_grad()
        loss.backward()
    return (out.to_eager() if lazy else out), loss.item(), [p.grad.clone() for p in model.parameters()] if train else []


def assert_matches_eager(make, shape, train, device="cpu"):
    """Output, loss and (training) gradients of one model, eager vs lazy."""
    torch.manual_seed(0)
    model = make().to(device)
    x = torch.randn(*shape).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    want = run(model, x, lazy=False, train=train)
    model.load_state_dict(state)            # batchnorm running stats
    got = run(model, x, lazy=True, train=train)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1] == pytest.approx(want[1], rel=1e-4)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_model_matches_eager(name, train, device):
    assert_matches_eager(*MODELS[name], train, device)


def test_mlp_records_most_ops():
    torch.manual_seed(0)
    model = mlp().eval()
    out = model(torch.randn(1, 16).to("lazy"))
    out.to_eager()
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 0 and c["nodes_recorded"] == 8 and c["flushes"] == 1


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_models_record_in_one_graph(name, device):
    """Conv, pooling, batch norm (eval), attention: all recorded, one flush."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().eval().to(device)
    x = torch.randn(*shape).to(device)
    out = model(x.to("lazy"))
    assert not out.is_materialized
    torch.testing.assert_close(out.to_eager(), model(x), rtol=1e-4, atol=1e-5)
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 0 and c["flushes"] == 1


def test_training_step_records_everything_batch_norm_included(device):
    torch.manual_seed(0)
    model = cnn().train().to(device)
    x = torch.randn(2, 3, 8, 8).to(device)
    loss = model(x.to("lazy")).pow(2).mean()
    loss.backward()
    # On CUDA eager's training batch norm is cuDNN's kernel, which the
    # functional kernel fastlazy records does not match bit for bit: it runs
    # eagerly there (fastlazy.running_stats)
    assert dict(metrics.fallbacks_by_op) == ({} if device == "cpu" else {"F.batch_norm": 1})
    if device == "cpu":
        assert metrics.counters()["flushes"] == 1


def test_batch_norm_running_statistics_update_at_the_call(device):
    torch.manual_seed(0)
    lazy_bn, eager_bn = nn.BatchNorm2d(3).train().to(device), nn.BatchNorm2d(3).train().to(device)
    x = torch.randn(4, 3, 5, 5).to(device)
    lazy_bn(x.to("lazy") * 2)              # nothing read yet
    eager_bn(x * 2)
    torch.testing.assert_close(lazy_bn.running_mean, eager_bn.running_mean)
    torch.testing.assert_close(lazy_bn.running_var, eager_bn.running_var)


def test_no_grad_and_inference_mode_are_honoured():
    torch.manual_seed(0)
    model = mlp()
    with torch.no_grad():
        out = model(torch.randn(2, 16).to("lazy"))
        assert not out.requires_grad
    assert not out.to_eager().requires_grad
    with torch.inference_mode():
        out = model(torch.randn(2, 16).to("lazy")).to_eager()
    assert not out.requires_grad


def test_functional_captured_before_enable_still_records():
    # nn modules keep references to F.relu & co. taken at import; those call
    # handle_torch_function with the (now patched) module global
    fastlazy.disable()
    import torch.nn.functional as F
    relu = F.relu
    fastlazy.enable()
    x = fastlazy.lazy(torch.randn(5))
    r = relu(x)
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 0 and c["nodes_recorded"] == 1
    assert torch.equal(r.to_eager(), torch.relu(x.to_eager()))


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.memory = nn.Parameter(torch.randn(2, 3, 16))

    def forward(self, x):
        return self.layer(x, self.memory)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x)          # need_weights=True
        return out + weights.sum()


class _First(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)[0]


MORE_MODELS = {
    "lstm": (lambda: _First(nn.LSTM(8, 16, batch_first=True)), (2, 5, 8)),
    # 11 tensors in one call (8 weights): recorded as one node
    "lstm_2_layers": (lambda: _First(nn.LSTM(8, 16, num_layers=2, batch_first=True)),
                      (2, 5, 8)),
    # GRU's cells add in place into their own intermediates: still recorded
    "gru": (lambda: _First(nn.GRU(8, 16)), (5, 2, 8)),
    "attention_weights": (_Attention, (2, 5, 16)),
    "conv1d_groupnorm": (lambda: nn.Sequential(nn.Conv1d(4, 8, 3), nn.GroupNorm(2, 8),
                                               nn.Mish()), (2, 4, 10)),
    "upsample": (lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2,
                                                                         mode="bilinear")),
                 (1, 3, 4, 4)),
    "pixel_shuffle": (lambda: nn.Sequential(nn.Conv2d(4, 8, 1), nn.PixelShuffle(2)),
                      (1, 4, 3, 3)),
    "decoder": (_Decoder, (2, 5, 16)),
    "instance_norm": (lambda: nn.InstanceNorm2d(3, affine=True), (2, 3, 5, 5)),
}


@pytest.mark.parametrize("name", list(MORE_MODELS))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_more_modules_match_eager_and_record(name, train, device):
    assert_matches_eager(*MORE_MODELS[name], train, device)
    # cuDNN's recurrent kernel has no fake-tensor implementation to trace
    # (NotImplementedError): on CUDA the recurrent modules run eagerly
    recurrent_op = {"lstm": "lstm", "lstm_2_layers": "lstm", "gru": "gru"}.get(name)
    eager = {recurrent_op: 1} if device == "cuda" and recurrent_op else {}
    assert dict(metrics.fallbacks_by_op) == eager


def _encoder():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                       batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2)


def test_transformer_encoder_with_a_padding_mask_gives_eagers_zeros():
    """In inference with a padding mask, eager's TransformerEncoder runs on a
    nested tensor and pads its output with zeros; a LazyTensor input gets
    the same output (recorded lazily, it took the ordinary path, whose
    padded positions hold values), and the call is counted as run eagerly.
    Without a mask, or in training, it is recorded."""
    torch.manual_seed(0)
    encoder = _encoder().eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False, False, False, True, True], [False, False, False, False, True]])
    with torch.no_grad():
        want = encoder(x, src_key_padding_mask=pad)
        assert (want[0, 3:] == 0).all()                        # eager's fast path
        got = encoder(fastlazy.lazy(x), src_key_padding_mask=fastlazy.lazy(pad))
        assert type(got) is fastlazy.LazyTensor
        torch.testing.assert_close(got.to_eager(), want)
        assert dict(metrics.fallbacks_by_op) == {"TransformerEncoder.forward": 1}
        metrics.reset()
        unmasked = encoder(fastlazy.lazy(x))
        torch.testing.assert_close(unmasked.to_eager(), encoder(x), rtol=1e-4, atol=1e-5)
    encoder.train()
    lazy_out = encoder(fastlazy.lazy(x), src_key_padding_mask=pad)
    torch.testing.assert_close(lazy_out.to_eager(), encoder(x, src_key_padding_mask=pad),
                               rtol=1e-4, atol=1e-5)
    assert not metrics.fallbacks_by_op, dict(metrics.fallbacks_by_op)
