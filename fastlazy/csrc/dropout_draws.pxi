# F.dropout in training, recorded here: the noise is drawn at the call by
# the calls eager's dropout makes, and the product recorded.
#
# fastlazy.random_ops explains why the draw happens at the call and how a
# device's dropout is found to draw its noise as
#     empty_like(x).bernoulli_(1 - p).div_(1 - p)
# (CPU's does; a fused kernel such as CUDA's does not).  For a call whose
# input that check accepts, this file does what random_ops._dropout does
# for it, without its Python frames: a transformer's training step makes a
# dozen such calls, and each spent ~9 us in Python around a draw eager
# makes too.  Anything else -- a view not laid out contiguously (whose noise
# must follow its strides), a pending result eager may not lay out
# contiguously (an elementwise op's, laid out as its operands are; a
# convolution's), a device or dtype that draws otherwise, a probability
# that is not a float strictly between 0 and 1 -- goes on to random_ops.

cdef object _draws_plainly = None    # random_ops.draws_plainly, set at boot
cdef dict _plain_draws = {}          # (device code, dtype code) -> its answer


def set_dropout_draws(draws_plainly):
    """Hand random_ops.draws_plainly(device_type, dtype) to the core (once,
    at boot): whether eager's dropout there draws its noise plainly."""
    global _draws_plainly
    _draws_plainly = draws_plainly


cdef bint elementwise_rule(int rule) noexcept:
    """Does eager lay out the result of an op of this rule as its operands
    are laid out (TensorIterator's ops)?"""
    return rule in (R_UNARY, R_UNARY_FLOAT, R_ABS, R_BINARY, R_TRUEDIV, R_DIV, R_COMPARE,
                    R_POW, R_CLAMP, R_RTRUEDIV)


def is_elementwise_rule(int rule):
    """elementwise_rule for Python (fastlazy.random_ops)."""
    return elementwise_rule(rule)


cdef bint contiguous_result_rule(int rule) noexcept:
    """Is eager's result of an op of this rule contiguous whatever its
    operands' layouts (matmuls, layer_norm, softmax, reductions, embedding,
    copies)?  Convolution and pooling take their input's memory format,
    attention its query's layout."""
    return rule in (R_MM, R_BMM, R_MATMUL, R_ADDMM, R_LINEAR, R_LAYER_NORM, R_SOFTMAX,
                    R_REDUCE, R_EMBEDDING, R_RESHAPE_COPY, R_CONTIGUOUS)


def is_contiguous_result_rule(int rule):
    """contiguous_result_rule for Python (fastlazy.layouts)."""
    return contiguous_result_rule(rule)


cdef bint contiguous_result_node(int op) noexcept:
    return 0 <= op < n_ops and contiguous_result_rule(op_rule[op])


cdef bint contiguous_view(LazyTensor x) noexcept:
    """Is x a view laid out contiguously (a view(), or a reshape of a
    contiguous result: GPT-2's projections)?  Its noise is then a
    contiguous tensor's, as for a result that is not a view."""
    if type(x.family) is not Member:
        return False
    cdef Member view = <Member>x.family
    return is_contiguous(view.ndim, view.size_, view.stride_)


cdef object training_dropout(PyObject **p):
    """F.dropout(x, p, training, inplace) in training with a float p in
    (0, 1): x times the noise drawn now, recorded; None where
    fastlazy.random_ops must take the call."""
    if _draws_plainly is None or type(<object>p[0]) is not LazyTensor or p[1] == NULL:
        return None
    prob = <object>p[1]
    if type(prob) is not float or not 0.0 < <double>prob < 1.0:
        return None
    if p[2] != NULL and <object>p[2] is not True:
        return None
    inplace = False if p[3] == NULL else <object>p[3]
    if type(inplace) is not bool:
        return None
    cdef LazyTensor x = <LazyTensor>p[0]
    if x.family is not None and not contiguous_view(x):
        # (a base with live views, or a view laid out otherwise)
        return None
    if x.family is None and x.value is None and x.seg is not None \
            and not contiguous_result_node(x.seg.nodes[x.idx].op):
        # an elementwise result takes its inputs' layout in eager, a
        # convolution its input's memory format, a generic op may be a
        # view: random_ops finds the layout out
        return None
    key = (x.meta.device, x.meta.dtype)
    plain = _plain_draws.get(key)
    if plain is None:
        plain = _plain_draws[key] = bool(_draws_plainly(x.device.type, x.dtype))
    if not plain:
        return None
    keep = 1.0 - <double>prob
    # random_ops._like: a value's own layout; a contiguous result (or a
    # contiguous view) is contiguous
    if x.value is not None:
        noise = torch.empty_like(x.value)
    else:
        noise = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    noise.bernoulli_(keep).div_(keep)
    return x.mul_(noise) if inplace else x * noise
