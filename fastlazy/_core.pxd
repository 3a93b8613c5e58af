# Declarations shared by every part of the compiled core (see _core.pyx).
# Only types live here: the node struct, the tensor metadata struct, and the
# fields of the two extension types.

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint64_t
from cpython.object cimport PyObject

cdef enum:
    # Tensors of more dimensions than this are not recorded; ops on them run
    # eagerly (counted as a fallback).
    MAX_NDIM = 8
    # Inputs of one node: tensor operands and scalar payloads (alpha, min, max),
    # or the tensor arguments of a generic call (torch.cat of up to 8).
    MAX_IN = 8

ctypedef struct Meta:
    int8_t dtype          # dtype code (see dtypes.pxi); -1 for a Python scalar
    int8_t ndim
    int8_t device         # device code: 0 cpu, 1 + index for cuda:index
    int8_t requires_grad
    int64_t shape[MAX_NDIM]

ctypedef struct Node:
    uint64_t hash[2]      # structural hash of the DAG ending here (128 bits)
    int32_t inputs[MAX_IN]  # >= 0: node index; < 0: external slot ~ref
    int16_t op            # opcode (row of fastlazy.optable.OPS)
    int8_t nin
    int8_t flags          # NODE_* flags, e.g. in-place cast to self dtype
    int32_t uses          # consumers recorded so far (for dropping dead tails)
    int32_t attr          # structural argument (rounding mode); bit 16+i: operand i absent
    Meta meta
    PyObject *owner       # the LazyTensor holding this value (borrowed), or NULL


cdef class Segment:
    cdef Node *nodes
    cdef int32_t n
    cdef int32_t cap
    cdef readonly uint64_t epoch
    cdef readonly list inputs # external values: tensors and Python scalars
    cdef readonly list input_keys  # per slot: a small int describing its type
    cdef uint64_t *slot_hash  # per slot: hash of its type (C mirror of input_keys)
    cdef int64_t *slot_version  # per slot: the tensor's _version when recorded, or -1
    cdef int32_t nslots
    cdef int32_t slot_cap
    cdef int state
    cdef object lock          # held while another thread runs this segment
    cdef object error         # the exception a failed flush raised
    cdef object sites         # per node: recording site, when tracing is on
    cdef object __weakref__

    cdef Node *append(self) except NULL
    cdef int32_t add_slot(self, object value, uint64_t key, Meta *m) except -1
    cdef void release(self) noexcept
    cdef void drop_owner(self, int32_t idx) noexcept
    cdef int check_versions(self, tuple slots) except -1


cdef class LazyTensor:
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
    cdef object __weakref__

    cdef int _wrap_dim(self, dim) except -1
