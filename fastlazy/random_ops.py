"""Random calls, recorded: the random draw happens at the call, eagerly, and
only the arithmetic around it is recorded.

A random op cannot go through the generic path: its aten program would draw
anew every time the graph runs, and not in eager's order.  But the draws of
the commonest ones depend on the input's metadata alone, not its values:

- dropout (`F.dropout`, `dropout1d/2d/3d`, `torch.dropout`,
  `torch.feature_dropout`) multiplies its input by noise it draws from the
  input's shape, dtype and device.  The same call on a tensor of ones of that
  metadata returns exactly that noise (1 * n == n) and advances the
  generator exactly as the real call would; the input times the noise is
  then recorded, and gives eager's values bit for bit, its gradient too
  (dropout's backward is the same product).  Where the device's dropout is
  made of the plain calls (CPU: empty_like(x).bernoulli_(1 - p).div_(1 - p),
  then x times that), the noise is drawn by those calls themselves, without
  the tensor of ones and its product: a transformer's training step makes
  a dozen such draws.  Checked once per device type and dtype against the
  call itself (same noise, same generator state after), so a torch whose
  dropout draws otherwise keeps the call on ones.  The core draws and
  records F.dropout's plain noise itself (csrc/dropout_draws.pxi) for an
  input that is neither a view nor an elementwise op's pending result; this
  module takes every other call.
- `rand_like`, `randn_like`, `randint_like` fill a tensor of the input's
  metadata: the call on an empty tensor of that metadata is the result.
- In-place fills (`x.uniform_()`, `normal_`, `bernoulli_` with a number,
  `exponential_`, `random_`...: `nn.init`'s) draw into such a tensor, and
  x's write of it is recorded (`x.copy_`).

A draw fills its tensor in memory order, so the tensor it fills is laid
out as eager's empty_like(x) would be (_like): a value's layout, a view's
strides, or the layout eager gives a pending result (TensorIterator's rule
for elementwise ops, followed back through the recorded nodes).

So seeded programs stay bit-equal to eager while the graph is not split.
Calls these rules do not cover go on to the generic path, which lifts the
random fills it finds in a captured program the same way (capture.Draw:
attention's dropout) and runs the rest eagerly (a probability that is a
tensor, arguments eager must judge).
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from fastlazy import _core, layouts, views
from fastlazy._core import LazyTensor

NOT_HANDLED = object()

# torch's builtins have no inspectable signature: their parameters, as their
# schemas name them
_BUILTIN_PARAMS = {torch._C._VariableFunctions.dropout: ("input", "p", "train"),
                   torch._C._VariableFunctions.feature_dropout: ("input", "p", "train")}


def record(func, args, kwargs):
    """The result of a random call whose draw was made here, or
    NOT_HANDLED (the caller goes on to the generic path)."""
    rule = _RULES.get(func)
    if rule is None:
        return NOT_HANDLED
    return rule(func, args, kwargs)


def _bind(func, args, kwargs):
    """{parameter: argument} of a call, in the parameters' order (the ones
    given); None if the arguments do not bind (eager judges the call)."""
    names = _BUILTIN_PARAMS.get(func) or _plain_params(func)
    if names is None:
        try:
            return dict(_signature(func).bind(*args, **kwargs).arguments)
        except (TypeError, ValueError):
            return None
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(zip(names, args))
    if any(k in bound for k in kwargs):
        return None
    bound.update(kwargs)
    return {k: bound[k] for k in names if k in bound}


# inspect.signature builds the Signature anew at each call (~20 us for
# F.dropout, which a transformer's training step calls a dozen times)
_signature = functools.lru_cache(maxsize=None)(inspect.signature)


@functools.lru_cache(maxsize=None)
def _plain_params(func):
    """The parameter names of a Python function whose parameters all take
    a position or a keyword (F.dropout's), which binding by hand maps as
    Signature.bind would, in a tenth of its time; else None."""
    params = _signature(func).parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params)


# dropouts whose noise is one bernoulli draw per element: the parameter
# naming the probability, and the one naming the training flag, with their
# defaults (None: the call must give it)
_PLAIN_DROPOUT = {F.dropout: ("p", 0.5, "training", True),
                  torch._C._VariableFunctions.dropout: ("p", None, "train", None)}


def _noise(func, bound, x):
    """Eager's dropout noise for this call drawn by the calls eager's
    dropout makes (see the module's docstring), or None where that does not
    apply: another kind of dropout, a probability of 0, 1 or not a float,
    not training, or a device and dtype whose dropout draws otherwise."""
    plain = _PLAIN_DROPOUT.get(func)
    if plain is None or bound.get("inplace", False) not in (False, True):
        return None
    p, training = bound.get(plain[0], plain[1]), bound.get(plain[2], plain[3])
    if type(p) is not float or not 0.0 < p < 1.0 or training is not True \
            or not draws_plainly(x.device.type, x.dtype):
        return None
    return _like(x).bernoulli_(1 - p).div_(1 - p)


@functools.lru_cache(maxsize=None)
def draws_plainly(device_type, dtype):
    """Does eager's dropout on this device type and dtype draw its noise as
    empty_like(x).bernoulli_(1 - p).div_(1 - p)?  Tried once, on a small
    tensor from a generator state restored afterwards: the same noise and
    the same generator state after both."""
    if device_type != "cpu":
        return False             # (CUDA's dropout is a fused kernel of its own)
    state = torch.random.get_rng_state()
    try:
        x = torch.ones(4, 33, dtype=dtype)
        want = torch.dropout(x, 0.25, True)
        want_state = torch.random.get_rng_state()
        torch.random.set_rng_state(state)
        got = torch.empty_like(x).bernoulli_(0.75).div_(0.75)
        return torch.equal(got, want) and torch.equal(torch.random.get_rng_state(), want_state)
    except RuntimeError:          # (no bernoulli_ for this dtype: eager's call judges)
        return False
    finally:
        torch.random.set_rng_state(state)


def _like(x, compute=True):
    """An uninitialized tensor as empty_like(x) would make it in eager: x's
    metadata, and x's strides where x is a non-overlapping, dense view (a
    random fill then puts each number where eager's would go).  A
    LazyTensor holding a value has that value's layout; a pending result
    has the layout eager gives it as far as its recorded producers tell
    (fastlazy.layouts), and where they do not, it is computed first (a split
    of the graph, rather than other numbers than eager's for the same seed)
    -- or, not `compute`, None is returned."""
    shape = tuple(x.shape)
    if x.family is None:
        strides = None if x.is_materialized else layouts.pending_strides(x)
        if strides is None:
            if not (compute or x.is_materialized):
                return None
            # a value's own layout (a channels-last tensor is held as it is)
            return torch.empty_like(x.to_eager())
        return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
    where = views.geometry(x)
    if where is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    # a view that skips or repeats elements: eager's empty_like lays the
    # result out densely in the view's order of strides (infer_dense_strides)
    strides = where[1]
    if not views.dense(shape, strides):
        strides = layouts.iterator_strides(shape, [(shape, strides)])
    return torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)


def _dropout(func, args, kwargs):
    bound = _bind(func, args, kwargs)
    if bound is None or not bound:
        return NOT_HANDLED
    names = list(bound)
    x = bound[names[0]]
    if type(x) is not LazyTensor:
        return NOT_HANDLED
    if any(type(v) is LazyTensor for k, v in bound.items() if k != names[0]):
        return NOT_HANDLED
    inplace = bound.get("inplace", False) is True
    noise = _noise(func, bound, x)
    if noise is None:
        call = dict(bound)
        # the noise's layout matters only where it is drawn: an eval-mode
        # or p=0 dropout of a pending result whose layout its producers do
        # not tell (any result recorded under autocast) must not compute it
        like = _like(x, compute=False)
        if like is None and not _may_draw(bound):
            like = torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)
        call[names[0]] = (_like(x) if like is None else like).fill_(1)
        if "inplace" in call:
            call["inplace"] = False
        # eager's own checks (p out of range...) raise here, at the call
        noise = func(**call)
        if noise is call[names[0]]:
            return x                  # not training, or p == 0: the input itself
    return x.mul_(noise) if inplace else x * noise


def _may_draw(bound):
    """Might a dropout call with these bound arguments draw noise?  Not in
    eval mode (training or train False) nor with a probability of 0, where
    eager returns its input."""
    training = bound.get("training", bound.get("train", True))
    p = bound.get("p", 0.5)
    return not (training is False or (type(p) in (int, float) and p == 0))


def _fill_like(func, args, kwargs):
    if not args or type(args[0]) is not LazyTensor:
        return NOT_HANDLED
    if any(type(v) is LazyTensor for v in (*args[1:], *kwargs.values())):
        return NOT_HANDLED
    return _core.lazy_or_eager(func(_like(args[0]), *args[1:], **kwargs))


def _fill_in_place(func, args, kwargs):
    """x.uniform_(...), x.normal_(...)...: the numbers drawn here into a
    tensor laid out as x is (_like), so each lands where eager's fill of x
    in memory order puts it, and x's write of them recorded (x.copy_)."""
    if not args or type(args[0]) is not LazyTensor:
        return NOT_HANDLED
    if any(type(v) is LazyTensor for v in (*args[1:], *kwargs.values())):
        return NOT_HANDLED       # (bernoulli_ of a tensor of probabilities)
    x = args[0]
    if x.requires_grad and torch.is_grad_enabled():
        return NOT_HANDLED       # (eager refuses a leaf before it draws anything)
    like = _like(x, compute=False)
    if like is None:
        # a pending result whose layout its producers do not tell: the
        # generic path lifts the fill, drawn in the order of its result
        return NOT_HANDLED
    drawn = func(like, *args[1:], **kwargs)     # eager's checks raise here
    return x.copy_(drawn)


_RULES = {}
for _name in ("uniform_", "normal_", "bernoulli_", "exponential_", "geometric_",
              "log_normal_", "cauchy_", "random_"):
    _RULES[getattr(torch.Tensor, _name)] = _fill_in_place
for _f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d):
    _RULES[_f] = _dropout
for _name in ("dropout", "feature_dropout"):
    _RULES[getattr(torch._C._VariableFunctions, _name)] = _dropout
for _name in ("rand_like", "randn_like", "randint_like"):
    _RULES[getattr(torch._C._VariableFunctions, _name)] = _fill_like
