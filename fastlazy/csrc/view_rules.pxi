# C rules for the view ops models call at every layer: view and reshape,
# transpose, permute, unsqueeze, and contiguous.  Without them each new
# call signature -- every new batch size or sequence length -- is analysed
# by the generic path (0.3-0.5 ms a call), and a transformer's first call
# makes dozens of such analyses.
#
# A view's result is a LazyTensor placed in its root's storage exactly as
# eager places it (size, stride, storage offset: attach_view), so writes
# through it and eager's checks of them (fastlazy.mutation, views.py) work
# as for the generic path's views.  Where eager could not view the input
# (a view of a transposed tensor) or the call is anything else (keywords,
# a dtype view, a bad size or dim), the rule leaves it to the generic path,
# which records it if it is pure or raises eager's error.
#
# Graphs are shape-generic: a size that equals its source's size at the
# aligned dim is not a constant of the graph but the source's size read
# when the graph runs (as fastlazy.symbolic_sizes rewrites the generic
# path's programs), so one graph serves every batch size and sequence
# length.  The size lists are interned; the node's attr holds the index.

from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Check
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport INT64_MAX, UINT64_MAX
from libc.stdlib cimport calloc, free

# The interned lists, in C (a call looks its list up without building a
# Python object): each list's entries, MAX_NDIM words apiece, its length,
# and an open-addressing table of list index + 1 (0: empty) by hash.
cdef int64_t *_size_entries = NULL
cdef int8_t *_size_counts = NULL
cdef int _n_size_lists = 0, _size_lists_cap = 0
cdef int32_t *_size_table = NULL
cdef uint64_t _size_table_mask = 0
cdef list _size_lists = []          # the same lists as tuples, for the lowering


cdef inline uint64_t hash_sizes(int64_t *entries, int n) noexcept:
    cdef uint64_t h = mix(0x9E3779B97F4A7C15ULL, <uint64_t>n)
    for i in range(n):
        h = mix(h, <uint64_t>entries[i])
    return h


cdef int table_insert(int index) noexcept:
    cdef uint64_t k = hash_sizes(&_size_entries[index * MAX_NDIM], _size_counts[index])
    k &= _size_table_mask
    while _size_table[k]:
        k = (k + 1) & _size_table_mask
    _size_table[k] = index + 1
    return 0


cdef int grow_sizes() except -1:
    """Room for one more list, and a table at most half full."""
    global _size_entries, _size_counts, _size_lists_cap, _size_table, _size_table_mask
    cdef int cap = 2 * _size_lists_cap if _size_lists_cap else 64
    cdef int64_t *entries = <int64_t*>realloc(_size_entries, cap * MAX_NDIM * sizeof(int64_t))
    if entries == NULL:
        raise MemoryError()
    _size_entries = entries
    cdef int8_t *counts = <int8_t*>realloc(_size_counts, cap * sizeof(int8_t))
    if counts == NULL:
        raise MemoryError()
    _size_counts = counts
    cdef int32_t *table = <int32_t*>calloc(2 * cap, sizeof(int32_t))
    if table == NULL:
        raise MemoryError()
    free(_size_table)
    _size_table = table
    _size_table_mask = 2 * cap - 1
    _size_lists_cap = cap
    for i in range(_n_size_lists):
        table_insert(i)
    return 0


cdef int intern_sizes(int64_t *entries, int n) except -2:
    """The index of the size list among the interned ones (interning it);
    -1 when the attr's field cannot hold another."""
    global _n_size_lists
    cdef uint64_t k
    cdef int32_t found
    if _size_table != NULL:
        k = hash_sizes(entries, n) & _size_table_mask
        while True:
            found = _size_table[k]
            if found == 0:
                break
            found -= 1
            if _size_counts[found] == n and equal_sizes(&_size_entries[found * MAX_NDIM],
                                                        entries, n):
                return found
            k = (k + 1) & _size_table_mask
    if _n_size_lists >= 1 << ATTR_VIEW_SIZES_BITS:
        return -1
    if _n_size_lists >= _size_lists_cap:
        grow_sizes()
    cdef int index = _n_size_lists
    memcpy(&_size_entries[index * MAX_NDIM], entries, n * sizeof(int64_t))
    _size_counts[index] = n
    _size_lists.append(tuple([entries[i] for i in range(n)]))
    _n_size_lists += 1
    table_insert(index)
    return index


def interned_sizes(int index):
    """The size list a view rule interned at `index`: each entry a constant
    size (-1: inferred), or SIZE_OF_DIM - d for the source's size at dim d
    (node_program lowers it to aten.sym_size)."""
    return _size_lists[index]


cdef int read_ints(PyObject **args, Py_ssize_t nargs, bint sequence_only,
                   int64_t *values, int *n) except -1:
    """The ints after the tensor: spread out (x.view(2, 3)) or as one
    tuple, list or torch.Size (x.view((2, 3))); exact ints only (a bool, a
    tensor or a SymInt is the generic path's).  0 if they are not that."""
    cdef Py_ssize_t i, count
    cdef int overflow = 0
    if nargs == 2 and (type(<object>args[1]) is tuple or type(<object>args[1]) is list
                       or type(<object>args[1]) is _Size):
        seq = <object>args[1]
        count = len(seq)
        if count > MAX_NDIM:
            return 0
        for i in range(count):
            item = seq[i]
            if type(item) is not int:
                return 0
            values[i] = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow:
                return 0
        n[0] = <int>count
        return 1
    if sequence_only or nargs - 1 > MAX_NDIM:
        return 0
    for i in range(1, nargs):
        if type(<object>args[i]) is not int:
            return 0
        values[i - 1] = PyLong_AsLongLongAndOverflow(<object>args[i], &overflow)
        if overflow:
            return 0
    n[0] = <int>(nargs - 1)
    return 1


cdef inline int wrap_dim64(int64_t dim, int ndim) noexcept:
    """dim counted from the end made non-negative; -1 if out of range
    (eager raises: the generic path's)."""
    if dim < -ndim or dim >= ndim:
        return -1
    return <int>(dim + ndim if dim < 0 else dim)


cdef void place_of(LazyTensor t, int64_t *size, int64_t *stride, int64_t *offset) noexcept:
    """t's size, stride and offset in its root's storage: a view's own, or
    a root's contiguous layout."""
    cdef int i, nd = t.meta.ndim
    cdef int64_t step = 1
    if type(t.family) is Member:
        memcpy(size, (<Member>t.family).size_, nd * sizeof(int64_t))
        memcpy(stride, (<Member>t.family).stride_, nd * sizeof(int64_t))
        offset[0] = (<Member>t.family).offset
        return
    for i in range(nd - 1, -1, -1):
        size[i] = t.meta.shape[i]
        stride[i] = step
        step *= size[i] if size[i] > 1 else 1
    offset[0] = 0


cdef inline int view_meta(Meta *out, LazyTensor src) except -1:
    """A view's metadata before its rule changes the shape: src's, with
    requires_grad as autograd will have it."""
    memcpy(out, &src.meta, sizeof(Meta))
    out.requires_grad = src.meta.requires_grad and grad_enabled()
    return 0


cdef bint is_contiguous(int nd, int64_t *size, int64_t *stride) noexcept:
    """c10's is_contiguous: dims of size 1 may have any stride, and an
    empty tensor is contiguous."""
    cdef int64_t expected = 1
    cdef int i
    for i in range(nd):
        if size[i] == 0:
            return True
    for i in range(nd - 1, -1, -1):
        if size[i] != 1:
            if stride[i] != expected:
                return False
            expected *= size[i]
    return True


cdef bint view_strides(int old_nd, int64_t *old_size, int64_t *old_stride,
                       int new_nd, int64_t *new_size, int64_t *new_stride) noexcept:
    """ATen's computeStride: the strides of a view of `new_size` over a
    tensor of that size and stride, False where no view can have it (eager's
    view raises, reshape copies)."""
    cdef int64_t numel = 1, chunk_base_stride, tensor_numel, view_numel
    cdef int i, tensor_d, view_d
    if old_nd == 0:
        for i in range(new_nd):
            new_stride[i] = 1
        return True
    for i in range(old_nd):
        numel *= old_size[i]
    if numel == 0:
        if old_nd == new_nd and equal_sizes(old_size, new_size, old_nd):
            memcpy(new_stride, old_stride, old_nd * sizeof(int64_t))
            return True
        for view_d in range(new_nd - 1, -1, -1):
            if view_d == new_nd - 1:
                new_stride[view_d] = 1
            else:
                new_stride[view_d] = (new_size[view_d + 1] if new_size[view_d + 1] > 1 else 1) \
                    * new_stride[view_d + 1]
        return True
    view_d = new_nd - 1
    chunk_base_stride = old_stride[old_nd - 1]
    tensor_numel = 1
    view_numel = 1
    for tensor_d in range(old_nd - 1, -1, -1):
        tensor_numel *= old_size[tensor_d]
        # the end of a chunk of dims that are contiguous among themselves
        if tensor_d == 0 or (old_size[tensor_d - 1] != 1 and
                             old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or new_size[view_d] == 1):
                new_stride[view_d] = view_numel * chunk_base_stride
                view_numel *= new_size[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if tensor_d > 0:
                chunk_base_stride = old_stride[tensor_d - 1]
                tensor_numel = 1
                view_numel = 1
    return view_d == -1


def computed_view_strides(old_size, old_stride, new_size):
    """view_strides from Python (the tests hold it to torch's): the
    strides, or None."""
    cdef int64_t os[MAX_NDIM]
    cdef int64_t ost[MAX_NDIM]
    cdef int64_t ns[MAX_NDIM]
    cdef int64_t nst[MAX_NDIM]
    if len(old_size) > MAX_NDIM or len(new_size) > MAX_NDIM or len(old_stride) != len(old_size):
        raise ValueError("sizes of at most MAX_NDIM dims, a stride per size")
    for i in range(len(old_size)):
        os[i], ost[i] = old_size[i], old_stride[i]
    for i in range(len(new_size)):
        ns[i] = new_size[i]
    if not view_strides(len(old_size), os, ost, len(new_size), ns, nst):
        return None
    return tuple([nst[i] for i in range(len(new_size))])


cdef bint numel_overflows(int64_t *sizes, int n) noexcept:
    """c10's safe_compute_numel: does the product of the sizes overflow
    (any partial product past 2**64, or the whole past INT64_MAX)?  Eager
    then refuses the tensor ("numel: integer multiplication overflow")."""
    cdef uint64_t prod = 1, size
    cdef bint overflow = False
    cdef int i
    for i in range(n):
        size = <uint64_t>sizes[i]
        if size != 0 and prod > UINT64_MAX // size:
            overflow = True
        prod *= size
    return overflow or prod > <uint64_t>INT64_MAX


cdef int infer_sizes(int64_t *sizes, int n, int64_t numel) noexcept:
    """Resolve one -1 among sizes as eager's infer_size does; 0 where eager
    raises (two -1s, a negative size, a product that does not divide or
    equal numel, a -1 beside a zero size)."""
    cdef int64_t known = 1
    cdef int i, inferred = -1
    for i in range(n):
        if sizes[i] == -1:
            if inferred >= 0:
                return 0
            inferred = i
        elif sizes[i] < 0:
            return 0
        else:
            if sizes[i] > 0 and known > INT64_MAX // sizes[i]:
                return 0
            known *= sizes[i]
    if inferred >= 0:
        if known == 0 or numel % known != 0:
            return 0
        sizes[inferred] = numel // known
        return 1
    return known == numel


cdef int matches_at(Meta *source, int64_t *sizes, int n, int offset) noexcept:
    cdef int i, d, count = 0
    for i in range(n):
        d = i + offset
        if 0 <= d < source.ndim and sizes[i] >= 0 and source.shape[d] == sizes[i]:
            count += 1
    return count


cdef enum:
    MAX_SIZE_SOURCES = 3    # nodes besides its source a view's sizes may be read from
    SIZE_SEARCH_NODES = 8   # nodes searched for them, the source's nearest first


cdef int find_size(Segment seg, int32_t start, int64_t value, int32_t *node) noexcept:
    """A dim of size `value` in node `start` or the nodes it was computed
    from (breadth first, inputs in order), that node in `node`; -1 if none
    of the first SIZE_SEARCH_NODES has one."""
    cdef int32_t queue[SIZE_SEARCH_NODES]
    cdef int head = 0, tail = 1, d, j, k
    cdef int32_t r
    cdef Node *nd
    queue[0] = start
    while head < tail:
        nd = &seg.nodes[queue[head]]
        for d in range(nd.meta.ndim):
            if nd.meta.shape[d] == value:
                node[0] = queue[head]
                return d
        head += 1
        for j in range(nd.nin):
            r = nd.inputs[j]
            if r < 0 or tail == SIZE_SEARCH_NODES:
                continue
            for k in range(tail):
                if queue[k] == r:
                    break
            else:
                queue[tail] = r
                tail += 1
    return -1


cdef int size_list_of(LazyTensor src, int64_t *given, int n, int64_t numel,
                      int32_t *sources, int *nsources) except -2:
    """The interned size list that computes `given` (the call's sizes, -1
    kept) when the graph runs, from the shapes of the source and of up to
    MAX_SIZE_SOURCES nodes it was computed from (`sources`, NULL: none):

    - a size equal to the source's at the aligned dim -- aligned from the
      left, or from the right where more sizes match so (rows of (batch *
      length, features) unflattened) -- is read from the source;
    - where more than one size is left and the source is pending, each of
      them (of 2 or more) that some dim of the source or of the nodes it was
      computed from has is read from there: x.view(length, batch, features)
      of rows of (length * batch, features) finds length and batch in the
      tensor before the rows were flattened, which its graph also holds;
    - of the sizes still left, the first becomes -1 (the element count
      divided by the rest) where the call gave no -1 and the source is not
      empty; the others are constants.

    Each choice gives this call's sizes, so the graph computes this call's
    view whatever it chose; choosing by what the sizes came from is what
    lets one graph serve the next batch size.  -1 where the interned lists
    are full."""
    cdef int64_t entries[MAX_NDIM]
    cdef bint left[MAX_NDIM]
    cdef Meta *source = &src.meta
    cdef int i, d, k, offset = 0, nleft = 0
    cdef int32_t node
    cdef bint free = numel > 0
    for i in range(n):
        if given[i] == -1:
            free = False
    if matches_at(source, given, n, source.ndim - n) > matches_at(source, given, n, 0):
        offset = source.ndim - n
    for i in range(n):
        d = i + offset
        left[i] = False
        if 0 <= d < source.ndim and given[i] >= 0 and source.shape[d] == given[i]:
            entries[i] = SIZE_OF_DIM - d
        else:
            entries[i] = given[i]
            if given[i] > 0:
                left[i] = True
                nleft += 1
    if nleft > 1 and sources != NULL and src.seg is not None:
        for i in range(n):
            if nleft == 1:
                break               # the last is the -1
            if not left[i] or given[i] < 2:
                continue
            d = find_size(src.seg, src.idx, given[i], &node)
            if d < 0:
                continue
            if node == src.idx:
                k = 0
            else:
                for k in range(nsources[0]):
                    if sources[k] == node:
                        k += 1
                        break
                else:
                    if nsources[0] == MAX_SIZE_SOURCES:
                        continue
                    sources[nsources[0]] = node
                    nsources[0] += 1
                    k = nsources[0]
            entries[i] = SIZE_OF_DIM - (k * MAX_NDIM + d)
            left[i] = False
            nleft -= 1
    for i in range(n):
        if left[i] and free:
            entries[i] = -1
            break
    return intern_sizes(entries, n)


cdef object record_sized_view(int op, LazyTensor src, Meta *out, int64_t *given, int n,
                              int64_t numel, int64_t *stride, int64_t offset):
    """record_view of a view or reshape to `given`, its sizes as
    size_list_of reads them (the nodes they are read from its node's
    inputs after the source); None where the interned lists are full."""
    cdef int32_t sources[MAX_SIZE_SOURCES]
    cdef int nsources = 0
    cdef int attr = size_list_of(src, given, n, numel, sources, &nsources)
    if attr < 0:
        return None
    if nsources:
        give_next_node(src.seg, sources, nsources)
        t = record_view(op, src, out, attr, stride, offset)
        if t is not None:
            return t
        # a flush ran before the node was appended (the source is a value
        # now): its sizes from the source alone
        attr = size_list_of(src, given, n, numel, NULL, NULL)
        if attr < 0:
            return None
    return record_view(op, src, out, attr, stride, offset)


cdef object view_call(object entry, int op, PyObject **args, Py_ssize_t nargs,
                      object kwnames, int form):
    """A call of a view row (its entry's op): recorded as a view of its
    input, or handed to the generic path."""
    cdef int rule = op_rule[op], i, n = 0, d0, d1, attr = 0
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t values[MAX_NDIM]
    cdef int64_t offset, numel
    cdef Meta out
    cdef bint seen[MAX_NDIM]
    if rule == R_FLATTEN:
        return flatten_call(entry, op, args, nargs, kwnames, form)
    if (kwnames is not None or form != FORM_CALL or nargs < 1
            or type(<object>args[0]) is not LazyTensor):
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern (keywords, count)")
    cdef LazyTensor src = <LazyTensor>args[0]
    cdef Meta *m = &src.meta
    if m.dtype == DT_COMPLEX32:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    place_as_eager_lays_out(src)

    # the rules that record one step of x[index]
    if rule == R_UNSQUEEZE:
        if nargs != 2 or m.ndim >= MAX_NDIM:
            return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
        d0 = wrap_dim(<object>args[1], m.ndim + 1)
        if d0 < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
        return unsqueeze_step(op, src, d0)
    if rule == R_SELECT or rule == R_SLICE:
        # select(dim, index), narrow(dim, start, length): ints
        if nargs != 3 + (rule == R_SLICE) or m.ndim == 0:
            return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
        for i in range(1, nargs):
            if type(<object>args[i]) is not int:
                return not_taken(entry, args, nargs, kwnames, form, "argument type")
        d0 = wrap_dim(<object>args[1], m.ndim)
        if d0 < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
        if rule == R_SELECT:
            found = select_step(op, src, d0, <object>args[2])
        else:
            found = narrow_step(op, src, d0, <object>args[2], <object>args[3])
        if found is None:
            return not_taken(entry, args, nargs, kwnames, form, "index out of range")
        return found
    # the rules that place their view themselves
    if rule == R_UNFLATTEN:
        return unflatten_call(entry, op, src, args, nargs, kwnames, form)
    if rule == R_EXPAND:
        return expand_call(entry, op, src, args, nargs, kwnames, form)
    if rule == R_SQUEEZE:
        return squeeze_call(entry, op, src, args, nargs, kwnames, form)

    place_of(src, size, stride, &offset)
    view_meta(&out, src)

    if rule == R_CONTIGUOUS:
        if nargs != 1:
            return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
        laid_out = src if type(src.family) is not Member else whole_view_root(src)
        if laid_out is not None and not root_laid_out_contiguously(laid_out):
            # a root's layout is not in its metadata: a value is held as
            # it is (channels last, or a non-contiguous tensor made lazy),
            # and a pending result is laid out as eager lays it out (an
            # elementwise op of a transposed tensor is transposed); a view
            # covering its root whole (`y.detach()`) is laid out as the
            # root is.  Copied where it is not contiguous, or its producers
            # do not tell (a generic call): where eager would return the
            # tensor itself, that is a copy of the same values, sizes and
            # strides.
            found = record_sized_view(reshape_copy_op, src, &out, m.shape, m.ndim,
                                      numel_of(m), NULL, 0)
            if found is None:
                return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
            return found
        if is_contiguous(m.ndim, size, stride):
            return src                  # as eager: the tensor itself
        return record_view(op, src, &out, 0, NULL, 0)

    if rule == R_VIEW:
        if not read_ints(args, nargs, op_flags[op] & OPF_SIZE_SEQUENCE, values, &n):
            return not_taken(entry, args, nargs, kwnames, form, "argument type")
        numel = numel_of(m)
        memcpy(out.shape, values, n * sizeof(int64_t))
        out.ndim = n
        if not infer_sizes(out.shape, n, numel):
            return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
        # (eager's layout of a root may have no view of the sizes where its
        # contiguous placement has one)
        eager_views = eager_could_view(src, n, out.shape)
        if eager_views and view_strides(m.ndim, size, stride, n, out.shape, new_stride):
            found = record_sized_view(op, src, &out, values, n, numel, new_stride, offset)
        elif op_flags[op] & OPF_COPIES:
            # as eager's reshape: a contiguous copy, a new tensor
            found = record_sized_view(reshape_copy_op, src, &out, values, n, numel, NULL, 0)
        elif not eager_views:
            raise RuntimeError(_NOT_VIEWABLE)
        else:
            return not_taken(entry, args, nargs, kwnames, form, "sizes it cannot view")
        if found is None:
            return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
        return found
    elif rule == R_TRANSPOSE:
        if nargs != 3 or m.ndim == 0:
            return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
        d0 = wrap_dim(<object>args[1], m.ndim)
        d1 = wrap_dim(<object>args[2], m.ndim)
        if d0 < 0 or d1 < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
        memcpy(new_stride, stride, m.ndim * sizeof(int64_t))
        out.shape[d0], out.shape[d1] = m.shape[d1], m.shape[d0]
        new_stride[d0], new_stride[d1] = stride[d1], stride[d0]
        attr = d0 | d1 << ATTR_DIM_BITS
    elif rule == R_PERMUTE:
        if not read_ints(args, nargs, op_flags[op] & OPF_SIZE_SEQUENCE, values, &n) \
                or n != m.ndim or n == 0:
            return not_taken(entry, args, nargs, kwnames, form, "argument type")
        memset(seen, 0, sizeof(seen))
        for i in range(n):
            d0 = wrap_dim64(values[i], n)
            if d0 < 0 or seen[d0]:
                return not_taken(entry, args, nargs, kwnames, form, "not a permutation")
            seen[d0] = True
            out.shape[i] = m.shape[d0]
            new_stride[i] = stride[d0]
            attr |= d0 << (ATTR_DIM_BITS * i)
        attr |= n << ATTR_PERMUTE_RANK_SHIFT
    else:
        return not_taken(entry, args, nargs, kwnames, form, "no view rule")
    if attr < 0:
        return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
    return record_view(op, src, &out, attr, new_stride, offset)


cdef LazyTensor whole_view_root(LazyTensor src):
    """The root of view src where src covers it whole, in its order
    (`y.detach()`, `y[:]`, `y.view_as(y)`): eager lays such a view out as
    it lays the root out, which its place in the root's contiguous layout
    does not show.  Else None."""
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t offset
    cdef int i
    if type(src.family) is not Member:
        return None
    cdef Member where = <Member>src.family
    cdef LazyTensor root = <LazyTensor>where.root
    if where.offset != 0 or where.ndim != root.meta.ndim:
        return None
    place_of(root, size, stride, &offset)
    for i in range(where.ndim):
        if where.size_[i] != size[i] or size[i] > 1 and where.stride_[i] != stride[i]:
            return None
    return root


cdef bint root_laid_out_contiguously(LazyTensor root) except -1:
    """Is this root (not a view) contiguous in eager: its value, or its
    pending result as its recorded producers lay it out
    (fastlazy.layouts; False where they do not tell)?"""
    if root.value is not None:
        return root.value.is_contiguous()
    if root.seg is None or one_dim_or_less(&root.meta) \
            or contiguous_result_node(root.seg.nodes[root.idx].op):
        # (a result of at most one dim of more than one element is laid out
        # contiguously, as eager_layout takes it)
        return True
    strides = _hooks.pending_strides(root)
    return strides is not None and is_contiguous_tuple(root.meta.ndim, root.meta.shape, strides)


cdef int place_as_eager_lays_out(LazyTensor src, bint exact=False) except -1:
    """Before the first view of src: a root eager lays out other than
    contiguously (eager_layout: a pending result, or one computed already
    and so laid out, a channels-last value) becomes a view of its storage
    in eager's order (fastlazy.mutation.lay_out_as_eager), so that its
    views are placed, and view() and reshape() of them judged, as eager's
    are.  Not a leaf that requires grad (it stays a leaf), nor a value that
    views another tensor (an eager fallback's view, written through).  A
    root that has views already keeps their places.  1 where src became
    such a view.  exact: for as_strided, which addresses the storage
    itself, the strides eager gives are asked wherever eager_layout would
    take a result as contiguous without asking."""
    if type(src.family) is Member:
        return 0
    if src.value is not None:
        value = src.value
        if value.is_contiguous() or value.requires_grad and value.is_leaf \
                or value._is_view() or value.is_conj() or value.is_neg():
            return 0
    elif src.seg is None:
        return 0
    if type(src.family) is Family and (<Family>src.family).has_live_views():
        return 0
    strides = eager_layout(src, exact)
    if strides is not None and _hooks.lay_out_as_eager(src, strides):
        return 1
    return 0


def place_as_eager(LazyTensor t, bint exact=False):
    """place_as_eager_lays_out, for a view the generic path records: True
    where t became a view of its storage in eager's order."""
    return place_as_eager_lays_out(t, exact) == 1


# eager's view() error where no view of the sizes exists in the layout
_NOT_VIEWABLE = ("view size is not compatible with input tensor's size and stride (at least "
                 "one dimension spans across two contiguous subspaces). Use .reshape(...) "
                 "instead.")


cdef bint eager_could_view(LazyTensor src, int n, int64_t *sizes) except -1:
    """Could eager view root src at these sizes, in the layout eager gives
    it?  A root is placed contiguously (its views' places are in that
    layout), but eager lays out an elementwise op of a transposed tensor,
    or a generic call's result, as its operands are: where that layout is
    known and has no view of the sizes, eager's view() raises and its
    reshape() copies.  True for a view (its place is its layout) but one
    covering its root whole, which is laid out as the root is, and
    where the layout is contiguous or not known."""
    cdef int64_t eager_stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int i
    strides = eager_layout(src)
    if strides is None:
        return True
    for i in range(src.meta.ndim):
        eager_stride[i] = strides[i]
    return view_strides(src.meta.ndim, src.meta.shape, eager_stride, n, sizes, new_stride)


cdef object eager_layout(LazyTensor src, bint exact=False):
    """The strides eager gives root src, where they are not contiguous and
    are known: a value held so (a result read earlier); a pending result
    of an op that lays it out as its operands are (elementwise ops,
    convolution, pooling, batch norm, cat) with an operand laid out
    otherwise (a transposed view, a channels-last value); a generic call's
    result that its real runs laid out otherwise (a linalg result is
    column-major).  fastlazy.layouts works the strides out.  Else None
    (attention's result, laid out as its query is, is taken as
    contiguous; exact: asked, as for anything else)."""
    if type(src.family) is Member:
        src = whole_view_root(src)
        if src is None:
            return None
    if src.value is not None:
        value = src.value
        return None if value.is_contiguous() else tuple(value.stride())
    if src.seg is None or one_dim_or_less(&src.meta):
        return None
    cdef Segment seg = <Segment>src.seg
    cdef int op = seg.nodes[src.idx].op
    if not (op == GENERIC_OP or seg.nodes[src.idx].flags & NODE_WRITTEN
            or 0 <= op < n_ops and follows_operands(op_rule[op])):
        return None
    if seg.nodes[src.idx].flags & NODE_LAID_OUT:
        return None
    cdef int8_t *known = <int8_t*>calloc(seg.n, sizeof(int8_t))
    if known == NULL:
        raise MemoryError()
    try:
        if laid_out_contiguously(seg, src.idx, known, LAYOUT_DEPTH):
            return None
    finally:
        free(known)
    if op == GENERIC_OP and not exact and not seg.nodes[src.idx].flags & NODE_WRITTEN \
            and generic_keeps_contiguous(seg.nodes[src.idx].attr) \
            and not generic_follows_operands(seg.nodes[src.idx].attr):
        # a generic call of operands laid out otherwise is taken as
        # contiguous, not asked: GPT-2's attention in training is one, of a
        # transposed query, at every step (80 us a question).  But not a
        # pointwise call, a cast or a clone, laid out as its operands are
        # (`x.t().clone()`, `x.t().float()`), which is asked
        return None
    strides = _hooks.pending_strides(src)
    if strides is None or is_contiguous_tuple(src.meta.ndim, src.meta.shape, strides):
        return None
    return strides


# fastlazy.layouts.generic_keeps_contiguous and generic_follows_operands,
# set at boot, and their answers by node attr (a generic program and which
# of its outputs: a few per model)
cdef object _generic_keeps_contiguous = None
cdef object _generic_follows_operands = None
cdef dict _generic_contiguous = {}
cdef dict _generic_following = {}


def set_generic_layouts(keeps_contiguous, follows_operands):
    """Hand fastlazy.layouts' questions about a generic node's layout to
    the core (once, at boot): keeps_contiguous(attr), is the result a
    generic node of this attr computes, of contiguous operands, a new
    contiguous tensor?  follows_operands(attr), is it laid out from its
    operands' layouts as its meta kernels lay it out (pointwise calls,
    casts, clones, views)?"""
    global _generic_keeps_contiguous, _generic_follows_operands
    _generic_keeps_contiguous = keeps_contiguous
    _generic_follows_operands = follows_operands
    _generic_contiguous.clear()
    _generic_following.clear()


cdef bint generic_keeps_contiguous(int32_t attr) except -1:
    """_generic_keeps_contiguous's answer for a node attr, asked once."""
    return generic_answer(_generic_keeps_contiguous, _generic_contiguous, attr)


cdef bint generic_follows_operands(int32_t attr) except -1:
    """_generic_follows_operands's answer for a node attr, asked once."""
    return generic_answer(_generic_follows_operands, _generic_following, attr)


cdef bint generic_answer(object question, dict answers, int32_t attr) except -1:
    found = answers.get(attr)
    if found is None:
        found = question is not None and bool(question(attr))
        if len(answers) >= 65536:
            answers.clear()
        answers[attr] = found
    return found is True


cdef enum:
    LAYOUT_DEPTH = 64       # producers followed before the layouts module is asked
    LAYOUT_UNKNOWN = 0, LAYOUT_CONTIGUOUS = 1, LAYOUT_OTHER = 2


cdef bint follows_operands(int rule) noexcept:
    """Does eager lay out a result of this rule as its operands are laid
    out: TensorIterator's ops, and the ops that take their input's memory
    format?"""
    return elementwise_rule(rule) or rule in (R_CONV2D, R_MAX_POOL2D, R_ADAPTIVE_AVG_POOL2D,
                                              R_BATCH_NORM, R_CAT)


cdef bint keeps_contiguous(int rule) noexcept:
    """Is a view of this rule of a contiguous tensor contiguous (view,
    reshape, unsqueeze, squeeze, flatten, unflatten)?"""
    return rule in (R_VIEW, R_UNSQUEEZE, R_SQUEEZE, R_FLATTEN, R_UNFLATTEN)


cdef bint one_dim_or_less(Meta *m) noexcept:
    """At most one dim of more than one element (or none at all): every
    layout of such a tensor is contiguous."""
    cdef int i, big = 0
    for i in range(m.ndim):
        if m.shape[i] == 0:
            return True
        if m.shape[i] > 1:
            big += 1
    return big <= 1


cdef bint operands_laid_out_contiguously(Segment seg, Node *nd, int8_t *known,
                                         int depth) except -1:
    """Is every tensor operand of node nd laid out contiguously in eager
    (laid_out_contiguously)?"""
    cdef int j
    for j in range(nd.nin):
        if not input_laid_out_contiguously(seg, nd.inputs[j], known, depth):
            return False
    return True


cdef bint input_laid_out_contiguously(Segment seg, int32_t r, int8_t *known,
                                      int depth) except -1:
    """Is node input r (a slot where negative, else a node) laid out
    contiguously in eager (a slot's tensor by its value, a number always)?"""
    if r < 0:
        value = seg.inputs[~r]
        return not isinstance(value, TensorType) or value.is_contiguous()
    return laid_out_contiguously(seg, r, known, depth)


cdef bint laid_out_contiguously(Segment seg, int32_t index, int8_t *known,
                                int depth) except -1:
    """Does eager lay node `index`'s result out contiguously, by its
    producers alone?  Results contiguous whatever their operands (matmuls,
    normalizations...); a live view placed contiguously in a root so laid
    out; an op that follows its operands' layout (follows_operands), or a
    generic call that keeps contiguous operands' results contiguous
    (generic_keeps_contiguous), of operands all so laid out; an in-place
    call's, of the tensor it writes so laid out.  False where that does not
    show it (fastlazy.layouts may still work it out).  `known` caches each
    node's answer (the graph is a DAG: a residual block reaches its input
    twice)."""
    if seg.nodes[index].flags & NODE_LAID_OUT:
        return True
    if known[index] != LAYOUT_UNKNOWN:
        return known[index] == LAYOUT_CONTIGUOUS
    cdef Node *nd = &seg.nodes[index]
    cdef bint found
    cdef Member view
    if contiguous_result_node(nd.op):
        found = True
    elif depth == 0:
        found = False
    elif nd.owner != NULL and type((<LazyTensor>nd.owner).family) is Member:
        view = <Member>(<LazyTensor>nd.owner).family
        found = is_contiguous(view.ndim, view.size_, view.stride_) \
            and root_contiguous(seg, <LazyTensor>view.root, known, depth - 1)
    elif nd.flags & NODE_WRITTEN and nd.nin > 0:
        # an in-place call (its functional form): eager writes the tensor,
        # whose layout it keeps (a resize_ to another shape: contiguously)
        found = not nd.flags & NODE_KEEPS_SHAPE \
            or input_laid_out_contiguously(seg, nd.inputs[0], known, depth - 1)
    elif nd.op == GENERIC_OP:
        found = generic_keeps_contiguous(nd.attr) \
            and operands_laid_out_contiguously(seg, nd, known, depth - 1)
    elif 0 <= nd.op < n_ops and (follows_operands(op_rule[nd.op])
                                 or keeps_contiguous(op_rule[nd.op])):
        # (a view no tensor holds any more, of a rule that keeps a
        # contiguous input contiguous: its input decides)
        found = operands_laid_out_contiguously(seg, nd, known, depth - 1)
    else:
        found = False
    known[index] = LAYOUT_CONTIGUOUS if found else LAYOUT_OTHER
    if found:
        nd.flags |= NODE_LAID_OUT
    return found


cdef bint root_contiguous(Segment seg, LazyTensor root, int8_t *known, int depth) except -1:
    """Is a view's root laid out contiguously in eager: its value, or its
    node in this segment?"""
    if root.value is not None:
        return root.value.is_contiguous()
    if root.seg is not seg:
        return False
    return laid_out_contiguously(seg, root.idx, known, depth)


cdef bint is_contiguous_tuple(int ndim, int64_t *size, tuple strides) except -1:
    cdef int64_t stride[MAX_NDIM]
    cdef int i
    for i in range(ndim):
        stride[i] = strides[i]
    return is_contiguous(ndim, size, stride)


cdef object unflatten_call(object entry, int op, LazyTensor src, PyObject **args,
                           Py_ssize_t nargs, object kwnames, int form):
    """x.unflatten(dim, sizes): a view (one dim split in several always is
    one) whose other dims are read from the source when the graph runs, and
    whose split sizes are the call's (a -1 among them kept)."""
    cdef int64_t sizes[MAX_NDIM]
    cdef int64_t entries[MAX_NDIM]
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t offset
    cdef int k = 0, i, d, nd = src.meta.ndim
    cdef Meta out
    if nargs != 3 or nd == 0 or not read_ints(args + 1, 2, True, sizes, &k) or k == 0:
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
    d = wrap_dim(<object>args[1], nd)
    if d < 0 or nd - 1 + k > MAX_NDIM:
        return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
    # the split sizes as the call gave them (a -1 kept), before infer_sizes
    # fills its -1
    memcpy(&entries[d], sizes, k * sizeof(int64_t))
    if not infer_sizes(sizes, k, src.meta.shape[d]):
        return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    out.ndim = nd - 1 + k
    for i in range(out.ndim):
        if i < d:
            out.shape[i] = src.meta.shape[i]
            entries[i] = SIZE_OF_DIM - i
        elif i < d + k:
            out.shape[i] = sizes[i - d]
        else:
            out.shape[i] = src.meta.shape[i - k + 1]
            entries[i] = SIZE_OF_DIM - (i - k + 1)
    view_strides(nd, size, stride, out.ndim, out.shape, new_stride)
    cdef int attr = intern_sizes(entries, out.ndim)
    if attr < 0:
        return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
    return record_view(op, src, &out, attr, new_stride, offset)


cdef object expand_call(object entry, int op, LazyTensor src, PyObject **args,
                        Py_ssize_t nargs, object kwnames, int form):
    """x.expand(*sizes): a view whose dims of size 1, and new leading dims,
    repeat by a stride of 0, placed as eager's inferExpandGeometry places
    it.  A size that keeps its dim (-1, or the source's own) is -1 in the
    interned list, so the graph reads it off the source when it runs; the
    others are the call's.  Sizes eager refuses: the generic path's."""
    cdef int64_t given[MAX_NDIM]
    cdef int64_t entries[MAX_NDIM]
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t offset, sz, st, target
    cdef int n = 0, i, d, nd = src.meta.ndim
    cdef Meta out
    if nd == 0 or not read_ints(args, nargs, False, given, &n) or n < nd:
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    out.ndim = n
    for i in range(n - 1, -1, -1):
        d = i - (n - nd)
        if d >= 0:
            sz, st = size[d], stride[d]
        else:
            sz, st = 1, out.shape[i + 1] * new_stride[i + 1]
        target = given[i]
        entries[i] = target
        if d >= 0 and (target == -1 or target == sz):
            target = sz
            entries[i] = -1
        elif target < 0:
            return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
        if sz != target:
            if sz != 1:
                return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
            sz, st = target, 0
        out.shape[i] = sz
        new_stride[i] = st
    if numel_overflows(out.shape, n):
        return not_taken(entry, args, nargs, kwnames, form, "sizes eager refuses")
    cdef int attr = intern_sizes(entries, n)
    if attr < 0:
        return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
    return record_view(op, src, &out, attr, new_stride, offset)


cdef object _str_start_dim = "start_dim"
cdef object _str_end_dim = "end_dim"


cdef object flatten_call(object entry, int op, PyObject **args, Py_ssize_t nargs,
                         object kwnames, int form):
    """torch.flatten(x, start_dim=0, end_dim=-1) and x.flatten(...): a view
    with the dims from start_dim to end_dim merged into one, where they can
    be viewed so (else the generic path, which copies as eager's reshape
    does); the input itself where they are one dim, as eager returns it.
    The dims are the node's attr and the sizes are not: one graph serves
    every input shape."""
    cdef PyObject *dims[2]
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t offset
    cdef int nd, start, end, i, k
    cdef Meta out
    if (form != FORM_CALL or not 1 <= nargs <= 3
            or type(<object>args[0]) is not LazyTensor):
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern (keywords, count)")
    cdef LazyTensor src = <LazyTensor>args[0]
    nd = src.meta.ndim
    if nd == 0 or src.meta.dtype == DT_COMPLEX32:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    place_as_eager_lays_out(src)
    dims[0] = args[1] if nargs > 1 else NULL
    dims[1] = args[2] if nargs > 2 else NULL
    if kwnames is not None:
        for k in range(len(<tuple>kwnames)):
            name = (<tuple>kwnames)[k]
            i = 0 if name == _str_start_dim else 1 if name == _str_end_dim else -1
            if i < 0 or dims[i] != NULL:
                return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
            dims[i] = args[nargs + k]
    # (wrap_dim refuses named dims and bools: the generic path, where eager decides)
    start = wrap_dim(<object>dims[0], nd) if dims[0] != NULL else 0
    end = wrap_dim(<object>dims[1], nd) if dims[1] != NULL else nd - 1
    if start < 0 or end < 0 or start > end:
        return not_taken(entry, args, nargs, kwnames, form, "dims eager refuses")
    if start == end:
        return src
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    out.ndim = nd - (end - start)
    for i in range(nd):
        if i <= start:
            out.shape[i] = size[i]
        elif i <= end:
            out.shape[start] *= size[i]
        else:
            out.shape[i - (end - start)] = size[i]
    if not eager_could_view(src, out.ndim, out.shape):
        # eager's layout of the root has no such view: flatten copies, as
        # reshape does
        found = record_sized_view(reshape_copy_op, src, &out, out.shape, out.ndim,
                                  numel_of(&src.meta), NULL, 0)
        if found is None:
            return not_taken(entry, args, nargs, kwnames, form, "interned size lists full")
        return found
    if not view_strides(nd, size, stride, out.ndim, out.shape, new_stride):
        return not_taken(entry, args, nargs, kwnames, form, "dims it cannot view")
    return record_view(op, src, &out, start | end << ATTR_DIM_BITS, new_stride, offset)


cdef object squeeze_call(object entry, int op, LazyTensor src, PyObject **args,
                         Py_ssize_t nargs, object kwnames, int form):
    """x.squeeze(), x.squeeze(dim), x.squeeze(dims): a view without the
    chosen dims of size 1 (every one, where none is named).  The dims it
    drops are the node's attr: a dim of size 1 at one shape and not at
    another is another graph."""
    cdef int64_t dims[MAX_NDIM]
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t offset
    cdef int nd = src.meta.ndim, k = 0, i, d, chosen = 0, drop = 0
    cdef Meta out
    if nd == 0:
        return not_taken(entry, args, nargs, kwnames, form, "a 0-dim tensor")
    if nargs == 1:
        chosen = (1 << nd) - 1
    elif nargs == 2 and type(<object>args[1]) is int:
        d = wrap_dim(<object>args[1], nd)
        if d < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
        chosen = 1 << d
    elif nargs == 2 and read_ints(args, 2, True, dims, &k):
        for i in range(k):
            d = wrap_dim64(dims[i], nd)
            if d < 0 or chosen >> d & 1:
                return not_taken(entry, args, nargs, kwnames, form, "dims eager refuses")
            chosen |= 1 << d
    else:
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    out.ndim = 0
    for i in range(nd):
        if chosen >> i & 1 and size[i] == 1:
            drop |= 1 << i
        else:
            out.shape[out.ndim] = size[i]
            stride[out.ndim] = stride[i]
            out.ndim += 1
    return record_view(op, src, &out, drop, stride, offset)


cdef object record_view(int op, LazyTensor src, Meta *out, int attr, int64_t *stride,
                        int64_t offset):
    """Record the node; where stride is given, make its tensor a view of
    src's root at that place (offset: in the root's storage)."""
    cdef Operand ops[1]
    ops[0].kind = K_LAZY
    ops[0].obj = <PyObject*>src
    ops[0].m = &src.meta
    cdef int flags = NODE_DETACH if src.meta.requires_grad and not out.requires_grad else 0
    t = record(op, ops, 1, out, attr, flags, None)
    if t is None:
        return None                 # record()'s: give_next_node's segment is gone
    if stride != NULL:
        attach_view(t, src, out.ndim, out.shape, stride, offset, 0)
    return t


# -- select, slice, and x[index] ----------------------------------------------

cdef object view_of_value(LazyTensor src, Meta *out, int64_t *stride, int64_t offset):
    """A select or slice of a tensor whose root holds its value (a dataset
    made lazy, a result already computed) as a LazyTensor holding eager's
    view of that value, placed in the root as a recorded view would be;
    None where the node is recorded instead.

    Why: the node would hold the index or bounds, so a loop over a lazy
    dataset (`X[i:i + batch]`) recorded a new graph structure at every
    offset -- 200 offsets, 200 graphs, each analysed and run once per
    pass.  As a held value the slice is an input of the graph that reads
    it, the same graph at every offset, and the generic calls that take
    it key it by its layout alone (is_held), so that they are analysed
    once, not once per offset.  Costs an eager as_strided call (about
    1 us) where recording costs 0.1 us.

    Only a root laid out contiguously (its views' places are in that
    layout), not conjugated nor negated, that requires no grad (the view
    would carry as_strided's backward, not slicing's), and a view of the
    root's dtype that neither detaches nor conjugates (its member flags)."""
    if src.meta.requires_grad:
        # (a leaf made of a view, x[1:].requires_grad_() or
        # x.detach().requires_grad_(): its root's value requires no grad,
        # but a slice of it must carry the leaf's)
        return None
    family = src.family
    if type(family) is Member:
        if (<Member>family).flags:
            return None
        root = <LazyTensor>(<Member>family).root
    else:
        root = src
    value = (<LazyTensor>root).value
    if value is None or (<LazyTensor>root).seg is not None \
            or (<LazyTensor>root).meta.dtype != out.dtype:
        return None             # (a dtype view's place counts its own elements)
    if value.requires_grad or not root_laid_out_contiguously(root) or value.is_conj() \
            or value.is_neg():
        return None
    view = value.as_strided(tuple([out.shape[i] for i in range(out.ndim)]),
                            tuple([stride[i] for i in range(out.ndim)]),
                            value.storage_offset() + offset)
    cdef LazyTensor t = try_wrap(view)
    if t is None:
        return None
    attach_view(t, src, out.ndim, out.shape, stride, offset, 0)
    (<Member>t.family).held = view
    return t


cdef object select_step(int op, LazyTensor src, int dim, object index_arg):
    """src.select(dim, index) (dim in range), recorded; None where eager
    raises (the index out of range) or the attr cannot hold the index.
    The index is kept as given -- x[:, -1] is the last row at every
    length."""
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t offset, n = src.meta.shape[dim], index, i
    cdef int overflow = 0, k
    cdef Meta out
    index = PyLong_AsLongLongAndOverflow(index_arg, &overflow)
    if overflow or not -ATTR_SELECT_INDEX_BIAS <= index < ATTR_SELECT_INDEX_BIAS:
        return None
    i = index + n if index < 0 else index
    if not 0 <= i < n:
        return None
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    for k in range(dim, src.meta.ndim - 1):
        out.shape[k] = src.meta.shape[k + 1]
    out.ndim = src.meta.ndim - 1
    memcpy(new_stride, stride, dim * sizeof(int64_t))
    memcpy(&new_stride[dim], &stride[dim + 1], (out.ndim - dim) * sizeof(int64_t))
    holding = view_of_value(src, &out, new_stride, offset + i * stride[dim])
    if holding is not None:
        return holding
    return record_view(op, src, &out, dim | <int>(index + ATTR_SELECT_INDEX_BIAS) << ATTR_DIM_BITS,
                       new_stride, offset + i * stride[dim])


cdef object slice_step(int op, LazyTensor src, int dim, int64_t start, bint start_open,
                       int64_t end, bint end_open, int64_t step, bint whole_is_src):
    """src[..., start:end:step] at dim (step > 0), recorded with eager's
    clamping; where the slice takes every element, `src` itself if
    whole_is_src (one step of an index), else a view of all of it (narrow
    and split of the whole dim, x[:]: new tensors in eager).  A bound
    that reaches past the dim's first or last element is recorded as None
    (open), so x[:, :length] of a tensor of that length is the same graph
    at every length; others are kept as given (negative ones count from
    the end when the graph runs, as in eager).  None where the attr cannot
    hold the slice."""
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t offset, n = src.meta.shape[dim], s, e
    cdef int64_t entries[3]
    cdef Meta out
    s = 0 if start_open else (start + n if start < 0 else start)
    s = 0 if s < 0 else (n if s > n else s)
    e = n if end_open else (end + n if end < 0 else end)
    e = s if e < s else (n if e > n else e)
    start_open = s == 0
    end_open = e == n
    if whole_is_src and start_open and end_open and step == 1:
        return src
    entries[0] = 0 if start_open else start
    entries[1] = 0 if end_open else end
    entries[2] = step
    cdef int index = intern_sizes(entries, 3)
    if index < 0 or index >= 1 << (ATTR_VIEW_SIZES_BITS - ATTR_DIM_BITS):
        return None
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    out.shape[dim] = (e - s + step - 1) // step
    offset += s * stride[dim]
    stride[dim] *= step
    holding = view_of_value(src, &out, stride, offset)
    if holding is not None:
        return holding
    cdef int attr = dim | index << ATTR_DIM_BITS
    if start_open:
        attr |= ATTR_SLICE_START_OPEN
    if end_open:
        attr |= ATTR_SLICE_END_OPEN
    return record_view(op, src, &out, attr, stride, offset)


cdef object narrow_step(int op, LazyTensor src, int dim, object start_arg, object length_arg):
    """src.narrow(dim, start, length) as a slice; None where eager raises."""
    cdef int overflow = 0
    cdef int64_t n = src.meta.shape[dim]
    cdef int64_t start = PyLong_AsLongLongAndOverflow(start_arg, &overflow)
    if overflow:
        return None
    cdef int64_t length = PyLong_AsLongLongAndOverflow(length_arg, &overflow)
    if overflow or not -n <= start <= n:
        return None
    if start < 0:
        start += n
    if length < 0 or start > n - length:
        return None
    return slice_step(op, src, dim, start, False, start + length, False, 1, False)


cdef object getitem_view(LazyTensor self, object idx):
    """self[idx] for basic indexing -- ints, slices of ints, None and one
    Ellipsis -- recorded as select, slice and unsqueeze steps; None for any
    other index (tensors, lists, bools, a step <= 0, an int out of range,
    a 0-dim tensor's x[...]): the generic path's."""
    cdef tuple items
    if type(idx) is tuple:
        items = idx
    else:
        items = (idx,)
    cdef Py_ssize_t k, count = len(items)
    cdef int consumed = 0, d = 0, steps = 0, overflow = 0
    cdef bint ellipsis = False
    cdef int64_t start, end, step
    if self.meta.dtype == DT_COMPLEX32 or count > MAX_NDIM:
        return None
    place_as_eager_lays_out(self)
    for k in range(count):
        item = items[k]
        if type(item) is int or type(item) is slice:
            consumed += 1
        elif item is Ellipsis:
            if ellipsis:
                return None
            ellipsis = True
        elif item is not None:
            return None
    if consumed > self.meta.ndim or self.meta.ndim + count - consumed > MAX_NDIM:
        return None
    t = self
    for k in range(count):
        item = items[k]
        if type(item) is int:
            t = select_step(select_op, <LazyTensor>t, d, item)
            steps += 1
        elif type(item) is slice:
            start = end = 0
            step = 1
            sl = <slice>item
            if sl.start is not None:
                if type(sl.start) is not int:
                    return None
                start = PyLong_AsLongLongAndOverflow(sl.start, &overflow)
            if sl.stop is not None:
                if type(sl.stop) is not int:
                    return None
                end = PyLong_AsLongLongAndOverflow(sl.stop, &overflow)
            if sl.step is not None:
                if type(sl.step) is not int:
                    return None
                step = PyLong_AsLongLongAndOverflow(sl.step, &overflow)
            if overflow or step <= 0:
                return None
            before = t
            t = slice_step(slice_op, <LazyTensor>t, d, start, sl.start is None, end,
                           sl.stop is None, step, True)
            if t is not before:
                steps += 1
            d += 1
        elif item is None:
            t = unsqueeze_step(unsqueeze_op, <LazyTensor>t, d)
            steps += 1
            d += 1
        else:
            d += self.meta.ndim - consumed
        if t is None:
            return None
    if steps == 0:
        # x[:], x[...]: a new view of all of x in eager, not x
        return slice_step(slice_op, self, 0, 0, True, 0, True, 1, False) \
            if self.meta.ndim else None
    return t


cdef object index_as_tuple(object idx):
    """The index as eager reads it: a list shorter than 32 holding a
    tensor, a sequence, a slice, None or ... is a tuple of its items
    (treatSequenceAsTuple, NumPy's old rule: x[[t0, t1]] is x[t0, t1], a
    list of ints alone is one advanced index).  Anything else as given."""
    if type(idx) is not list or not 0 < len(<list>idx) < 32:
        return idx
    for item in <list>idx:
        if (isinstance(item, TensorType) or PySequence_Check(item) or type(item) is slice
                or item is None or item is Ellipsis):
            return tuple(<list>idx)
    return idx


cdef object unsqueeze_step(int op, LazyTensor src, int d0):
    """src.unsqueeze(d0), d0 in range."""
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    cdef int64_t new_stride[MAX_NDIM]
    cdef int64_t offset
    cdef Meta out
    cdef int i
    place_of(src, size, stride, &offset)
    view_meta(&out, src)
    for i in range(src.meta.ndim, d0, -1):
        out.shape[i] = src.meta.shape[i - 1]
        new_stride[i] = stride[i - 1]
    out.shape[d0] = 1
    # eager's stride for the new dim: 1 past the last dim, else that of the
    # dim it comes before times that dim's size
    new_stride[d0] = 1 if d0 >= src.meta.ndim else src.meta.shape[d0] * stride[d0]
    memcpy(new_stride, stride, d0 * sizeof(int64_t))
    out.ndim = src.meta.ndim + 1
    return record_view(op, src, &out, d0, new_stride, offset)


# -- cat ---------------------------------------------------------------------

cdef object _str_dim = "dim"


cdef int dim_argument(PyObject **args, Py_ssize_t nargs, object kwnames, Py_ssize_t position,
                      PyObject **dim) except -1:
    """The dim of a call whose last parameter is `dim`, at `position`:
    given positionally or as the one keyword (dim=), or NULL where not
    given; 0 for any other keyword."""
    dim[0] = args[position] if nargs > position else NULL
    if kwnames is not None:
        if nargs != position or len(<tuple>kwnames) != 1 or (<tuple>kwnames)[0] != _str_dim:
            return 0
        dim[0] = args[position]
    return 1


cdef object cat_call(object entry, int op, PyObject **args, Py_ssize_t nargs, object kwnames,
                     int form):
    """torch.cat(tensors, dim=0) of 1..MAX_IN tensors of one rank (>= 1),
    equal sizes but at dim, one device: a node of its own (not a view),
    in the tensors' result dtype.  Anything else -- more tensors (the
    generic path nests them), the legacy empty 1-d operand, sizes eager
    refuses -- is the generic path's."""
    cdef PyObject *dim_arg = NULL
    cdef Operand ops[MAX_IN]
    cdef Meta out
    cdef Py_ssize_t n, k
    cdef int i, d, nd
    if (form != FORM_CALL or not 1 <= nargs <= 2
            or not dim_argument(args, nargs, kwnames, 1, &dim_arg)):
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
    seq = <object>args[0]
    if type(seq) is not tuple and type(seq) is not list:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    n = len(seq)
    if n > MAX_IN:
        return nested_cat(entry, op, seq, dim_arg, args, nargs, kwnames, form)
    if n < 1:
        return not_taken(entry, args, nargs, kwnames, form, "tensor count")
    cdef bint lazy = False
    for k in range(n):
        item = seq[k]
        if classify(&ops[k], <PyObject*>item) != 1 or not is_tensor(&ops[k]):
            return not_taken(entry, args, nargs, kwnames, form, "argument type")
        lazy = lazy or ops[k].kind == K_LAZY
    # eager skips empty 1-d tensors in the shape checks (a cache's first
    # torch.cat([torch.tensor([]), keys])), not in the result dtype
    cdef Py_ssize_t ref = -1
    for k in range(n):
        if not (ops[k].m.ndim == 1 and ops[k].m.shape[0] == 0):
            ref = k
            break
    if not lazy or ref < 0 or ops[ref].m.ndim == 0:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    nd = ops[ref].m.ndim
    d = 0
    if dim_arg != NULL:
        d = wrap_dim(<object>dim_arg, nd)
        if d < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
    memcpy(&out, ops[ref].m, sizeof(Meta))
    out.shape[d] = 0
    for k in range(n):
        if ops[k].m.ndim == 1 and ops[k].m.shape[0] == 0:
            continue
        if ops[k].m.ndim != nd:
            return not_taken(entry, args, nargs, kwnames, form, "ranks differ")
        for i in range(nd):
            if i != d and ops[k].m.shape[i] != ops[ref].m.shape[i]:
                return not_taken(entry, args, nargs, kwnames, form, "sizes differ")
        out.shape[d] += ops[k].m.shape[d]
    if not common_device(&out, ops, <int>n):
        return not_taken(entry, args, nargs, kwnames, form, "devices differ")
    out.dtype = result_type(ops, <int>n)
    if out.dtype == DT_UNDEF:
        return not_taken(entry, args, nargs, kwnames, form, "dtypes")
    cdef int flags = 0
    if not out.requires_grad:
        for k in range(n):
            if ops[k].m.requires_grad:
                flags = NODE_DETACH
    return record(op, ops, <int>n, &out, d | <int>n << ATTR_DIM_BITS, flags, None)


cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject **args, size_t nargsf,
                               PyObject *kwnames)


cdef object nested_cat(object entry, int op, object seq, PyObject *dim_arg, PyObject **args,
                       Py_ssize_t nargs, object kwnames, int form):
    """torch.cat of more than MAX_IN tensors (a dense block's growing list)
    as the generic path nests it (generic._record_nested): the cat of each
    group of MAX_IN, then the cat of those (nested again if they are
    many) -- the same nodes, recorded here without Python.  Only tensors of
    one dtype, rank (>= 1), device and size but at dim, some lazy: with
    mixed dtypes a group's cat would round to the group's own result
    dtype first; other lists, and eager's errors, are the generic path's."""
    cdef Operand o
    cdef Meta ref
    cdef Py_ssize_t n = len(seq), k, start
    cdef int i, d = 0
    cdef bint lazy = False
    for k in range(n):
        item = seq[k]
        if classify(&o, <PyObject*>item) != 1 or not is_tensor(&o):
            return not_taken(entry, args, nargs, kwnames, form, "argument type")
        if k == 0:
            memcpy(&ref, o.m, sizeof(Meta))
            if ref.ndim == 0:
                return not_taken(entry, args, nargs, kwnames, form, "argument type")
            if dim_arg != NULL:
                d = wrap_dim(<object>dim_arg, ref.ndim)
                if d < 0:
                    return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
        elif o.m.ndim != ref.ndim or o.m.dtype != ref.dtype or o.m.device != ref.device:
            return not_taken(entry, args, nargs, kwnames, form, "mixed tensors")
        else:
            for i in range(ref.ndim):
                if i != d and o.m.shape[i] != ref.shape[i]:
                    return not_taken(entry, args, nargs, kwnames, form, "sizes differ")
        lazy = lazy or o.kind == K_LAZY
    if not lazy:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    cdef PyObject *argv[2]
    cdef Py_ssize_t nargv = 1 if dim_arg == NULL else 2
    if dim_arg != NULL:
        argv[1] = dim_arg
    # the dim as the entry had it: positional, or the keyword dim=
    cdef object names = kwnames
    if names is not None:
        nargv = 1
    parts = []
    for start in range(0, n, MAX_IN):
        group = list(seq[start:start + MAX_IN])
        argv[0] = <PyObject*>group
        if not any([type(t) is LazyTensor for t in group]):
            # eager's cat, as the entry gives a list it finds no LazyTensor in
            parts.append(PyObject_Vectorcall(<object>fl_entry_orig(entry), argv, nargv,
                                             <PyObject*>names if names is not None else NULL))
            continue
        parts.append(cat_call(entry, op, argv, nargv, names, form))
    argv[0] = <PyObject*>parts
    return cat_call(entry, op, argv, nargv, names, form)


cdef object call_row(object entry, tuple args, dict kwargs):
    """The call of entry's row (through its rule, as the entry's own call
    would go), for a call whose LazyTensors sit inside a list (torch.cat)."""
    cdef PyObject *argv[MAX_PARAMS]
    cdef Py_ssize_t n = len(args), k
    keys = tuple(kwargs)
    values = [kwargs[key] for key in keys]      # alive for the call
    if n + len(keys) > MAX_PARAMS:
        return generic_call_of(entry, args, kwargs)
    for k in range(n):
        argv[k] = <PyObject*>args[k]
    for k in range(len(keys)):
        argv[n + k] = <PyObject*>values[k]
    return lazy_call(entry, argv, n, keys if keys else None)


# -- split and chunk ---------------------------------------------------------

cdef object split_call(object entry, int op, PyObject **args, Py_ssize_t nargs, object kwnames,
                       int form):
    """x.split(size or sizes, dim=0) and x.chunk(chunks, dim=0) of a
    LazyTensor: a tuple of slices of the dim, each a view recorded as
    narrow's (the row of the opcode slice_op), as eager's split makes
    them.  Where autograd records them the generic path takes the call:
    eager's pieces are then the views of one multi-output op, which may not
    be written in place, and a slice may.  Also the generic path's: sizes
    eager refuses, an empty dim, keywords but dim."""
    cdef PyObject *dim_arg = NULL
    cdef int64_t sizes[64]
    cdef int64_t n, size, start, total = 0
    cdef int pieces = 0, overflow = 0, d = 0, k
    if (form != FORM_CALL or not 2 <= nargs <= 3 or type(<object>args[0]) is not LazyTensor
            or not dim_argument(args, nargs, kwnames, 2, &dim_arg)):
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern")
    cdef LazyTensor src = <LazyTensor>args[0]
    if src.meta.ndim == 0 or src.meta.dtype == DT_COMPLEX32 or \
            src.meta.requires_grad and grad_enabled():
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    place_as_eager_lays_out(src)
    if dim_arg != NULL:
        d = wrap_dim(<object>dim_arg, src.meta.ndim)
        if d < 0:
            return not_taken(entry, args, nargs, kwnames, form, "dim out of range")
    n = src.meta.shape[d]
    arg = <object>args[1]
    if n == 0:
        return not_taken(entry, args, nargs, kwnames, form, "empty dim")
    if type(arg) is int:
        size = PyLong_AsLongLongAndOverflow(arg, &overflow)
        if overflow or size <= 0:
            return not_taken(entry, args, nargs, kwnames, form, "size")
        if op_flags[op] & OPF_CHUNKS:
            size = (n + size - 1) // size          # chunk: the split size it makes
        while total < n and pieces < 64:
            sizes[pieces] = size if n - total > size else n - total
            total += sizes[pieces]
            pieces += 1
    elif (type(arg) is list or type(arg) is tuple) and not op_flags[op] & OPF_CHUNKS:
        if not 1 <= len(arg) <= 64:
            return not_taken(entry, args, nargs, kwnames, form, "sizes")
        for item in arg:
            if type(item) is not int:
                return not_taken(entry, args, nargs, kwnames, form, "sizes")
            size = PyLong_AsLongLongAndOverflow(item, &overflow)
            if overflow or size < 0:
                return not_taken(entry, args, nargs, kwnames, form, "sizes")
            sizes[pieces] = size
            total += size
            pieces += 1
    else:
        return not_taken(entry, args, nargs, kwnames, form, "argument type")
    if total != n:
        return not_taken(entry, args, nargs, kwnames, form, "sizes")
    cdef tuple result = PyTuple_New(pieces)
    start = 0
    for k in range(pieces):
        piece = slice_step(slice_op, src, d, start, False, start + sizes[k], False, 1, False)
        if piece is None:
            return not_taken(entry, args, nargs, kwnames, form, "interned slices full")
        Py_INCREF(piece)
        PyTuple_SET_ITEM(result, k, piece)
        start += sizes[k]
    return result
