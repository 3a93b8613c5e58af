"""Sizes read from the inputs when a graph runs (fastlazy/symbolic_sizes.py):
the size patterns of real models give one graph structure for every batch
size and sequence length, and any view's sizes -- whatever the guess --
give eager's values."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

import fastlazy
from fastlazy import graph_cache

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)


@pytest.fixture
def fresh(backend):
    fastlazy.mark_step()
    graph_cache.clear()
    fastlazy.metrics.reset()
    yield backend


def flatten_head(x, w):
    return torch.flatten(torch.relu(x), 1) @ w


def attention_shapes(x, w):
    """HuggingFace's split into heads and back (batch, seq, hidden)."""
    b, s, h = x.shape
    q = (x @ w).view(b, s, 4, -1).transpose(1, 2)
    scores = (q @ q.transpose(-1, -2)).softmax(-1)
    return (scores @ q).transpose(1, 2).contiguous().view(b, s, h)


def rows_and_back(x, w):
    """GPT-2's Conv1D: rows (batch * seq, hidden), then x.view(size_out)."""
    size_out = x.size()[:-1] + (w.shape[1],)
    return torch.addmm(w[0], x.view(-1, x.size(-1)), w).view(size_out)


def attention_over_rows(x, mha):
    """nn.MultiheadAttention on (length, batch, features): its projections
    fold the leading dims into rows for one matmul and unflatten them after
    it, with sizes the matmul's rows no longer show (ViT's attention)."""
    return mha(x, x, x, need_weights=False)[0]


torch.manual_seed(0)
_MHA = torch.nn.MultiheadAttention(16, 4).eval()


# (the attention's fixed sizes -- length 7, batch 6, 4 heads of 4 -- are
# none of the sizes the test runs: see
# test_a_size_that_coincides_with_another_costs_one_more_structure)
CASES = [
    (attention_over_rows, lambda n: torch.randn(7, n, 16), _MHA),
    (attention_over_rows, lambda n: torch.randn(n, 6, 16), _MHA),
    (flatten_head, lambda n: torch.randn(n, 8, 1, 1), torch.randn(8, 3)),
    (attention_shapes, lambda n: torch.randn(2, n, 16), torch.randn(16, 16)),
    (attention_shapes, lambda n: torch.randn(n, 5, 16), torch.randn(16, 16)),
    (rows_and_back, lambda n: torch.randn(1, n, 16), torch.randn(16, 24)),
]


@pytest.mark.parametrize("fn, make, w", CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_one_graph_structure_for_every_size(fresh, fn, make, w):
    # (sizes from 2: at size 1 some calls are no-ops -- contiguous() of a
    # transposed (b, 1, h, d) -- and the graph is another structure, as
    # torch.compile specializes sizes 0 and 1)
    for n in (2, 3, 5, 8, 13):
        x = make(n)
        got = fn(fastlazy.lazy(x), w).to_eager()
        torch.testing.assert_close(got, fn(x, w))
    counters = fastlazy.metrics.counters()
    assert counters["cache_misses"] == 1, fastlazy.metrics.report()


@pytest.mark.parametrize("make", [lambda n: torch.randn(5, n, 16), lambda n: torch.randn(n, 3, 16)])
def test_a_size_that_coincides_with_another_costs_one_more_structure(fresh, make):
    """nn.MultiheadAttention's body views its heads with sizes it computed
    from its input's shape; the view rule finds each in the dims of the
    tensors the view was computed from, by value.  Where the batch equals
    the length (5, 3 here), the value names either, and the graph that reads
    the other one is another structure: right values, one more compile."""
    for n in (2, 3, 5, 8, 13):
        x = make(n)
        got = attention_over_rows(fastlazy.lazy(x), _MHA).to_eager()
        torch.testing.assert_close(got, attention_over_rows(x, _MHA))
    assert fastlazy.metrics.counters()["cache_misses"] == 2, fastlazy.metrics.report()


@st.composite
def view_cases(draw):
    """A tensor shape and a view of it: the same elements regrouped, with
    sizes that often coincide with the input's by accident."""
    factors = draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=5))
    shape = draw(st.permutations(factors))
    target = list(draw(st.permutations(factors)))
    cut = draw(st.integers(0, len(target)))
    if cut < len(target) - 1:        # merge two neighbours
        target[cut:cut + 2] = [target[cut] * target[cut + 1]]
    if draw(st.booleans()):
        target[draw(st.integers(0, len(target) - 1))] = -1
    return list(shape), target


@given(view_cases(), st.sampled_from(["view", "reshape"]))
def test_any_view_gives_eagers_values(case, method):
    shape, target = case
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)

    def f(t):
        return getattr(t * 2, method)(target) + 1
    torch.testing.assert_close(f(fastlazy.lazy(x)).to_eager(), f(x), rtol=0, atol=0)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(1, 3))
def test_expand_gives_eagers_values(shape, extra):
    x = torch.randn(shape)
    target = [extra, *shape]

    def f(t):
        return (t + 1).expand(target) * 2
    torch.testing.assert_close(f(fastlazy.lazy(x)).to_eager(), f(x), rtol=0, atol=0)


def test_unflattened_rows_keep_eagers_values_when_sizes_swap_or_coincide(fresh):
    """The rows a matmul made of (length, batch) are unflattened from
    those two dims' sizes, read when the graph runs: shapes that swap the
    two, or make them equal (where the pass does not guess their order),
    still give eager's values."""
    for shape in [(5, 2, 16), (2, 5, 16), (4, 4, 16), (5, 3, 16), (3, 5, 16), (6, 6, 16)]:
        x = torch.randn(shape)
        got = attention_over_rows(fastlazy.lazy(x), _MHA).to_eager()
        torch.testing.assert_close(got, attention_over_rows(x, _MHA))
