# The compiled core's interface: every constant it shares with Python, its
# types, and the cdef functions its parts (fastlazy/csrc/*.pxi, included by
# _core.pyx) call across files.
#
# The `cpdef enum`s are the one definition of each shared constant: Python
# modules read them from fastlazy._core (named enums as IntEnum classes, the
# anonymous one as module attributes) instead of copying the numbers.

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint16_t, uint64_t
from cpython.object cimport PyObject

# -- limits and reserved opcodes --

cpdef enum:
    # Tensors of more dimensions than this are not recorded; ops on them run
    # eagerly (counted as a fallback).
    MAX_NDIM = 8
    # Inputs of one node: tensor operands and scalar payloads (alpha, min, max),
    # or the tensor arguments of a generic call (torch.cat of up to 16;
    # nn.TransformerEncoderLayer's fused kernel takes 13 or 14 tensors).
    MAX_IN = 16
    # Opcodes: rows of fastlazy.optable.OPS, then the generic node's.
    MAX_OPS = 512
    GENERIC_OP = 511
    # Parameters of one op-table row.
    MAX_PARAMS = 16
    # dtype codes (csrc/dtypes.pxi): 0 bool ... 12 complex128
    NDTYPES = 13
    # An entry of a view's interned size list (csrc/view_rules.pxi) is a
    # constant size (>= -1), or SIZE_OF_DIM - d: the source's size at dim d.
    SIZE_OF_DIM = -2


cdef extern from "_entry.h":
    # How an entry point treats its first argument (written once, in C,
    # where the entry type reads it).
    cpdef enum Form "fl_form":
        FORM_CALL
        FORM_INPLACE
        FORM_WATCH
        FORM_WATCH_INPLACE


# Rules: what kind of shape/dtype logic an op needs.  Op-table rows name one.
cpdef enum Rule:
    R_UNARY = 0         # same dtype as the input
    R_UNARY_FLOAT = 1   # integral inputs compute in the default float dtype
    R_ABS = 2           # complex inputs give their real dtype
    R_BINARY = 3        # result_type of the operands (alpha checked)
    R_TRUEDIV = 4       # result_type, integral -> default float
    R_DIV = 5           # div with rounding_mode
    R_COMPARE = 6       # bool result
    R_POW = 7
    R_CLAMP = 8
    R_REDUCE = 9        # sum, mean, amax, amin: dim / keepdim / dtype
    R_SOFTMAX = 10      # softmax, log_softmax: dim / dtype
    R_MM = 11
    R_BMM = 12
    R_MATMUL = 13
    R_LINEAR = 14
    R_RTRUEDIV = 15     # other / self, as eager computes it: self.reciprocal() * other
    R_LAYER_NORM = 16   # normalized_shape is structure, read by the rule
    R_DROPOUT = 17      # the input itself when not training (eager returns it)
    R_BATCH_NORM = 18   # inference only: the running statistics are read, not written
    R_CONV2D = 19       # F.conv2d of a batch: stride, padding, dilation, groups are structure
    R_ADDMM = 20        # input + mat1 @ mat2 (beta and alpha at their defaults)
    R_MAX_POOL2D = 21   # F.max_pool2d without indices: its sizes are structure
    R_ADAPTIVE_AVG_POOL2D = 22  # to a fixed output size
    R_EMBEDDING = 23    # F.embedding as nn.Embedding calls it (no max_norm, dense)
    R_SDPA = 24         # F.scaled_dot_product_attention without dropout
    # views (csrc/view_rules.pxi): the result is a view of its input, placed
    # in its root's storage as eager places it
    R_VIEW = 25         # view and reshape of a tensor they can view: sizes interned
    R_TRANSPOSE = 26
    R_PERMUTE = 27
    R_UNSQUEEZE = 28
    R_SELECT = 29       # select and x[i]
    R_SLICE = 30        # narrow and x[a:b:c]
    R_CONTIGUOUS = 31   # the input itself where it is contiguous; else a copy
    R_CAT = 32          # torch.cat of up to MAX_IN tensors (csrc/view_rules.pxi)
    R_SPLIT = 33        # split and chunk: a tuple of slice steps (narrow's nodes)
    R_SQUEEZE = 34      # squeeze(), squeeze(dim), squeeze(dims): the dims it drops are structure
    R_UNFLATTEN = 35    # unflatten(dim, sizes): a view to sizes interned as R_VIEW's
    R_FLATTEN = 36      # flatten(start_dim, end_dim): a view with those dims merged,
                        # which are structure (the input itself where they are one)
    R_EXPAND = 37       # expand(*sizes): a view repeating dims of size 1 by stride 0;
                        # sizes interned as R_VIEW's, -1 where a dim is kept
    R_RESHAPE_COPY = 38  # no entry point: the copy R_VIEW's reshape rows record
                         # where no view can have the sizes
    R_NATIVE_MHA = 39   # torch._native_multi_head_attention as nn.MultiheadAttention's
                        # fast path calls it: self-attention, no mask, no weights
    R_GENERIC = 40      # no C rule: the meta-signature path (fastlazy.generic)
    R_COUNT = 41


# Op flags (an op-table row's `flags`).
cpdef enum OpFlag:
    OPF_NO_BOOL = 1        # a bool operand makes eager raise (sub)
    OPF_TENSORS_ONLY = 2   # every operand must be a tensor (maximum)
    OPF_INT_TO_INT64 = 8   # reductions: integral inputs accumulate in int64
    OPF_EMPTY_ERROR = 16   # reductions: eager raises on an empty reduction
    # calls the C rule does not take are the generic path's as a generic
    # row's are (no trial run): the rule covers a corner of a generic op
    # (batch_norm in inference), not an op whose other calls are corners
    OPF_RULE_IN_GENERIC = 32
    # a view rule's sizes or dims only as one sequence (torch.reshape(x,
    # shape)), not also spread out as Tensor.reshape(*shape) takes them
    OPF_SIZE_SEQUENCE = 64
    # split's row for chunk: the int is a number of pieces, not their size
    OPF_CHUNKS = 4
    # a view rule's row that copies where no view can have the sizes
    # (reshape), where the others leave the call to the generic path (view)
    OPF_COPIES = 128
    # the call returns (result, None): the op's second output is not asked for
    OPF_PAIR_WITH_NONE = 256
    # operands 1 and 2 are limits, lower then upper: eager raises where the
    # lower exceeds the upper (F.hardtanh's ValueError); the rule takes
    # both or neither
    OPF_ORDERED_LIMITS = 512


# dtype categories; a row's `cats` is a mask of them.
cpdef enum Category:
    CAT_BOOL = 1
    CAT_INT = 2
    CAT_FLOAT = 4
    CAT_COMPLEX = 8


# Node.flags
cpdef enum NodeFlag:
    NODE_CAST = 1     # in-place op: cast the result to the self dtype
    NODE_DETACH = 2   # recorded under no_grad with inputs requiring grad:
                      # the op reads detached inputs, so no gradient flows
    NODE_KEEPS_SHAPE = 4  # the result has its first operand's shape (no
                          # broadcast grew it): structure, since a backend
                          # may then compute it into that operand's storage
    NODE_DEAD = 8     # no LazyTensor holds it and no live node reads it: it
                      # can never be needed again (its inputs were let go)
    NODE_WRITTEN = 16  # the user's call wrote its first operand in place
                       # (x.mul_(2)): a graph that builds autograd history
                       # runs it so, as eager did (backends.base.as_written)
    NODE_LAID_OUT = 32  # eager lays its result out contiguously, as its
                        # producers showed (view_rules' laid_out_contiguously:
                        # a fact of the recorded node, kept so that each
                        # node's producers are walked once, not at each view)


# Node.attr: the structural arguments of a node, packed.
#   reductions: bits 0-7 dim mask, KEEPDIM, DIM_GIVEN, bits 10-14 dtype code + 1
#   softmax:    bits 0-3 dim, bits 10-14 dtype code + 1
#   layer_norm: bits 0-3 len(normalized_shape)
#   conv2d:     per spatial dim (height, then width) stride - 1 (4 bits:
#               a ViT's 16x16 patches), padding (3 bits) and dilation - 1
#               (1 bit) from bit
#               CONV_STRIDE_SHIFT, CONV_PADDING_SHIFT, CONV_DILATION_SHIFT;
#               groups - 1 in bits CONV_GROUPS_SHIFT+ (its row has no choice)
#   max_pool2d: per spatial dim kernel - 1 and stride - 1 (3 bits), padding
#               and dilation - 1 (2 bits), from POOL_*_SHIFT; POOL_CEIL_MODE
#   adaptive_avg_pool2d: output height - 1, width - 1 (8 bits each, bit 0+)
#   embedding:  padding_idx + 1 (0: none) in bits 0-15
#   sdpa:       SDPA_CAUSAL, SDPA_GQA; the scale's index among the interned
#               floats (0: None) in bits SDPA_SCALE_SHIFT+
#   view, reshape, expand: the index of its size list among the interned ones
#               (csrc/view_rules.pxi), bits 0..VIEW_SIZES_BITS-1
#   transpose:  the two dims, 3 bits each; unsqueeze: the dim (4 bits)
#   flatten:    start_dim, end_dim (wrapped), 3 bits each
#   permute:    dim i in bits 3i..3i+2, the rank in bits PERMUTE_RANK_SHIFT+
#   select:     the dim (3 bits), the index + SELECT_INDEX_BIAS from bit 3
#   slice:      the dim (3 bits), from bit 3 the index of its interned
#               (start, end, step); SLICE_START_OPEN, SLICE_END_OPEN: None
#   cat:        the dim (3 bits), the number of tensors from bit 3
#   every row:  bit ABSENT_SHIFT + i: optional operand i was not given (a
#               row whose operands are all required may use these bits);
#               bits CHOICE_SHIFT..+3: index of the choice param's value
#   generic:    bits 0-19 lowering id, bits GENERIC_OUT_SHIFT+: output index
cpdef enum:  # AttrLayout
    ATTR_DIM_MASK = 0xFF
    ATTR_SMALL_MASK = 15
    ATTR_KEEPDIM = 1 << 8
    ATTR_DIM_GIVEN = 1 << 9
    ATTR_DTYPE_SHIFT = 10
    ATTR_DTYPE_MASK = 31
    ATTR_ABSENT_SHIFT = 16
    ATTR_GENERIC_OUT_SHIFT = 20
    ATTR_CHOICE_SHIFT = 24
    ATTR_CONV_STRIDE_SHIFT = 0
    ATTR_CONV_STRIDE_BITS = 4
    ATTR_CONV_PADDING_SHIFT = 8
    ATTR_CONV_PADDING_BITS = 3
    ATTR_CONV_DILATION_SHIFT = 14
    ATTR_CONV_DILATION_BITS = 1
    ATTR_CONV_GROUPS_SHIFT = 20
    ATTR_CONV_GROUPS_BITS = 11
    ATTR_POOL_KERNEL_SHIFT = 0
    ATTR_POOL_KERNEL_BITS = 3
    ATTR_POOL_STRIDE_SHIFT = 6
    ATTR_POOL_STRIDE_BITS = 3
    ATTR_POOL_PADDING_SHIFT = 12
    ATTR_POOL_PADDING_BITS = 2
    ATTR_POOL_DILATION_SHIFT = 20
    ATTR_POOL_DILATION_BITS = 2
    ATTR_POOL_CEIL_MODE = 1 << 24
    ATTR_ADAPTIVE_SIZE_BITS = 8
    ATTR_EMBEDDING_PADDING_BITS = 16
    ATTR_SDPA_CAUSAL = 1
    ATTR_SDPA_GQA = 2
    ATTR_SDPA_SCALE_SHIFT = 4
    ATTR_SDPA_SCALE_BITS = 12
    ATTR_VIEW_SIZES_BITS = 24
    ATTR_DIM_BITS = 3
    ATTR_PERMUTE_RANK_SHIFT = 24
    ATTR_SELECT_INDEX_BIAS = 1 << 26
    ATTR_SLICE_START_OPEN = 1 << 27
    ATTR_SLICE_END_OPEN = 1 << 28


# How a view's values follow from its place in its root's storage
# (Member.flags; a generic signature's view result carries its own):
#   DETACHED: a view of a .detach() -- autograd does not see writes through it
#   CONJ: the values are the conjugates of the elements at that place (a
#         conj() view: eager's conjugate bit); for a real view of a complex
#         root (x.conj().imag) the elements that are imaginary parts negated
cpdef enum ViewFlag:
    VIEW_DETACHED = 1
    VIEW_CONJ = 2


# Python scalar kinds (an operand's `scalar`, and the low bits of a scalar
# slot's key).
cpdef enum ScalarType:
    SC_BOOL = 0
    SC_INT = 1
    SC_FLOAT = 2
    SC_COMPLEX = 3


# Slot keys: what a graph needs to know of an external input.
#   tensor: SLOT_TENSOR | dtype+1 | ndim << 8 | device << 16 | requires_grad << 24
#   scalar: SLOT_SCALAR | ScalarType, or SLOT_SCALAR | SLOT_BOOL_CONSTANT | value
#           (a bool is a constant of the graph)
cpdef enum SlotKey:
    SLOT_TENSOR = 1 << 29
    SLOT_SCALAR = 1 << 30
    SLOT_BOOL_CONSTANT = 16


# -- types --

ctypedef struct Meta:
    int8_t dtype          # dtype code (see csrc/dtypes.pxi); -1 for a Python scalar
    int8_t ndim
    int8_t device         # device code: 0 cpu, 1 + index for cuda:index
    int8_t requires_grad
    int8_t inference      # pending: recorded in inference mode (an inference
                          # tensor once computed); a value answers for itself
    int64_t shape[MAX_NDIM]

ctypedef struct Node:
    uint64_t hash[2]      # structural hash of the DAG ending here (128 bits)
    int32_t inputs[MAX_IN]  # >= 0: node index; < 0: external slot ~ref
    int16_t op            # opcode (row of fastlazy.optable.OPS, or GENERIC_OP)
    int8_t nin
    int8_t flags          # NodeFlag
    int32_t uses          # consumers recorded so far (for dropping dead tails)
    int32_t attr          # AttrLayout
    Meta meta
    PyObject *owner       # the LazyTensor holding this value (borrowed), or NULL

# One argument of a call, sorted by csrc/operands.pxi.
cdef enum OperandKind:
    K_ABSENT = 0      # optional argument not given, or None where the row allows it
    K_LAZY = 1
    K_TENSOR = 2      # eager torch.Tensor
    K_SCALAR = 3      # Python bool, int, float or complex

ctypedef struct Operand:
    int kind
    int scalar         # ScalarType, for K_SCALAR
    PyObject *obj      # borrowed argument
    Meta *m            # metadata (points into `own` or into a LazyTensor)
    int64_t version    # K_TENSOR: its _version, or VERSION_UNREAD (operands.pxi)
    Meta own


cdef class NodeRecord:
    """One recorded node, as the backends and debugging tools read it."""
    cdef readonly int32_t index
    cdef readonly int op          # opcode: a row of the op table, or GENERIC_OP
    cdef readonly tuple inputs    # ('node', i) | ('slot', k)
    cdef readonly int32_t attr    # packed as AttrLayout says
    cdef readonly int flags       # NodeFlag
    cdef readonly object dtype
    cdef readonly tuple shape
    cdef readonly bint live       # a LazyTensor holds it
    cdef readonly bint requires_grad
    cdef readonly int32_t uses    # consumers among the nodes it was taken with


cdef class Segment:
    cdef Node *nodes
    cdef int32_t n
    cdef int32_t cap
    cdef readonly uint64_t epoch
    cdef readonly list inputs # external values: tensors and Python scalars
    cdef uint64_t *slot_keys  # per slot: its SlotKey
    cdef uint64_t *slot_hash  # per slot: hash of its key and, where the backend
                              # compiles per shape, of its shape
    cdef int64_t *slot_version  # per slot: the tensor's _version when recorded, or -1
    cdef int32_t *slot_uses   # per slot: references from nodes not dead; at 0 the
                              # slot's value is let go (inputs[k] = None)
    cdef int32_t nslots
    cdef int32_t slot_cap
    cdef int state
    cdef object lock          # held while a thread runs this segment
    cdef unsigned long runner # the thread running it (a re-entrant read on that
                              # thread must not wait for itself)
    cdef object error         # the exception a failed flush raised
    cdef object sites         # per node: recording site, when tracing is on
    cdef list after_run       # callables to run once the graph has run (after_run())
    cdef set slot_addresses   # the slots' storage addresses, filled when first
                              # asked (may_read), for the first slots_seen slots
    cdef Py_ssize_t slots_seen
    cdef bint slot_unknown    # some slot's storage could not be told
    cdef int default_dtype    # the default dtype's code when it opened (-1: not
                              # yet read): its nodes' dtypes were found under it
    cdef object __weakref__

    cdef Node *append(self) except NULL
    cdef int32_t add_slot(self, object value, uint64_t key, Meta *m, int64_t version) except -1
    cdef void release(self) noexcept
    cdef void drop_owner(self, int32_t idx) noexcept
    cdef void kill(self, int32_t idx) noexcept
    cdef int check_versions(self, tuple slots) except -1
    cdef NodeRecord record_of(self, int32_t i)
    cdef bint may_read(self, object written) except -1


cdef class LazyTensor:
    # Where torch's C++ reads a tensor's at::Tensor (THPVariable.cdata):
    # kept holding a stand-in's, since LazyTensor answers isinstance(x,
    # torch.Tensor) and torch's argument parser unpacks such an object
    # wherever an argument may be a 0-dim tensor (tensor.pxi).  First, so
    # that it sits where THPVariable's does (no vtable: no cdef methods).
    cdef void *variable_words[2]
    cdef Segment seg          # pending: the segment holding our node
    cdef int32_t idx          # pending: our node's index in seg
    cdef object value         # materialized torch.Tensor, or None
    cdef Meta meta
    cdef object _device       # torch.device, built on first request
    cdef readonly object program  # the compiled Program that produced value
    cdef uint64_t slot_epoch  # segment epoch in which `slot` is valid
    cdef int32_t slot         # external slot of our value in that segment
    cdef public object family # views.Family (a base with live views) or
                              # views.Member (a view of one), else None
    cdef dict attributes      # what user code set on it (t.tag = 1), or None
    cdef bint retains_grad    # retain_grad() was called: each value it holds
                              # from now on retains its grad (an in-place op
                              # gives it a new one, as eager's moves the hook)
    cdef object leaf_of       # pending: the eager leaf that requires grad
                              # whose update under no_grad it holds (an
                              # optimizer's step); its value becomes that
                              # leaf's successor (tensor.pxi take_leaf)
    cdef object __weakref__


cdef class Hooks:
    """The Python functions the core calls up into, installed once by
    fastlazy's boot (`_core.install(hooks)`)."""
    # a call with a LazyTensor and no C rule that takes it:
    # (func, name, args, kwargs, inplace, ruled[, prepared]) -> result, where
    # prepared is the signature key and tensors the core has already built
    cdef public object record_call
    # a call to run eagerly: (func, name, args, kwargs, inplace, reason) -> result
    cdef public object run_eagerly
    # LazyTensor.to: (tensor, args, kwargs) -> result
    cdef public object tensor_to
    # writes through views: check_leaf(t), check_write(t, operands)
    # (fastlazy.views); after_mutation(t) (fastlazy.mutation)
    cdef public object check_leaf
    cdef public object check_write
    cdef public object after_mutation
    # a leaf's written value becomes its successor: (new, old) (fastlazy.leaves)
    cdef public object succeed_leaf
    # a node that builds autograd history reads an inference tensor:
    # (op, attr, result dtype, [(operand, is inference)]) raises eager's
    # error if the node would save it (fastlazy.inference_saves)
    cdef public object check_saved_inference
    # the graph cache: compile_and_run(seg, key, outs) on a miss;
    # recover(seg, index, error) after a failed run; `programs` the cache
    # itself (key -> Program), read by the core on a hit
    cdef public object compile_and_run
    cdef public object recover
    cdef public object programs
    # the default dtype changed where fastlazy's setter did not see it
    # (while disabled): forget_signatures() drops what was found under the
    # old one (fastlazy.generic)
    cdef public object forget_signatures
    # a graph's run raised: (seg, outs, error) -> the exception to raise
    # (eager's, from the node that raised it; fastlazy.failures)
    cdef public object graph_failed
    # () -> "file:line" of the user's call
    cdef public object site_of_call
    # a pending result's eager strides as its recorded producers tell them,
    # or None (fastlazy.layouts.pending_strides)
    cdef public object pending_strides
    # (root, strides): make a pending root eager lays out in those strides
    # a view of its storage in that order, before its first view
    # (fastlazy.mutation.lay_out_as_eager)
    cdef public object lay_out_as_eager
    # a Python function of torch's called with LazyTensors:
    # (func, args, kwargs) -> (True, result) where its body was run and
    # recorded, (False, None) where it is to be recorded whole
    cdef public object run_body
    # the exception the generic path's signatures raise for a call they do
    # not describe, and the argument types that describe themselves
    cdef public object unsafe
    cdef public object atoms
    # LazyTensor.backward runs the engine inside backward_scope(), a
    # context manager (fastlazy.cpu_pool.scope: large buffers pooled)
    cdef public object backward_scope


# -- functions the parts share --

# csrc/operands.pxi
cdef int meta_from_tensor(Meta *m, object t) except -1
cdef int classify(Operand *o, PyObject *p) except -1
# csrc/rules.pxi
cdef int apply_rule(int op, Operand *ops, int nops, PyObject **p, Meta *out,
                    int *attr) except -1
# csrc/segment.pxi
cdef Segment peek_segment()
cdef void retarget(LazyTensor t, Segment seg, int32_t idx) noexcept
cdef LazyTensor record(int op, Operand *ops, int nops, Meta *out, int attr,
                       int flags, LazyTensor rebind)
# csrc/tensor.pxi
cdef object materialize(LazyTensor t)
cdef void detach_handle(LazyTensor t, object value) noexcept
cdef LazyTensor try_wrap(object value)
cdef LazyTensor wrap_value(object value)
# csrc/dispatch.pxi
cdef object lazy_call(object entry, PyObject **args, Py_ssize_t nargs, object kwnames)

# csrc/generic_record.pxi
cdef object record_by_signature(object func, object name, tuple pos, dict kw, bint ruled,
                                object fast)
cpdef tuple signature_key(object func, tuple args, dict kwargs, list tensors, bint ruled,
                          object autocast)
# csrc/flush.pxi
cdef int flush(Segment seg, int reason) except -1
cdef int run_segment_for(LazyTensor t) except -1
cdef int flush_pending(PyObject *written) except -1
