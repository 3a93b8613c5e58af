# dtype codes and type promotion, as C tables.
#
# The tables are not written by hand: init_dtypes() fills them by asking torch
# (torch.promote_types, torch.can_cast) for every pair once at import, so the
# rules follow the installed torch exactly, version by version.

cdef enum:
    DT_UNDEF = -1
    DT_INT32 = 4            # (positions in init_dtypes' names)
    DT_INT64 = 5
    DT_COMPLEX32 = 10

cdef list DTYPES = []                 # code -> torch.dtype
cdef PyObject *dtype_ptr[NDTYPES]     # code -> borrowed torch.dtype, for identity search
cdef int8_t promote_table[NDTYPES][NDTYPES]
cdef bint can_cast_table[NDTYPES][NDTYPES]
cdef int8_t category[NDTYPES]
cdef int8_t itemsize[NDTYPES]        # bytes per element
cdef int8_t to_complex[NDTYPES]       # float dtype -> its complex counterpart
cdef int8_t to_real[NDTYPES]          # complex dtype -> its real counterpart
cdef list int_min = [0] * NDTYPES     # integral dtypes' ranges, from torch.iinfo
cdef list int_max = [0] * NDTYPES
cdef object _get_default_dtype = torch.get_default_dtype


cdef void init_dtypes() except *:
    names = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16",
             "bfloat16", "float32", "float64", "complex32", "complex64",
             "complex128")
    DTYPES[:] = [getattr(torch, n) for n in names]
    cdef int i, j
    for i in range(NDTYPES):
        d = DTYPES[i]
        dtype_ptr[i] = <PyObject*>d
        itemsize[i] = d.itemsize
        if d is torch.bool:
            category[i] = CAT_BOOL
        elif d.is_complex:
            category[i] = CAT_COMPLEX
        elif d.is_floating_point:
            category[i] = CAT_FLOAT
        else:
            category[i] = CAT_INT
    for i in range(NDTYPES):
        to_complex[i] = DT_UNDEF
        to_real[i] = DT_UNDEF
        for j in range(NDTYPES):
            promote_table[i][j] = DTYPES.index(torch.promote_types(DTYPES[i], DTYPES[j]))
            can_cast_table[i][j] = torch.can_cast(DTYPES[i], DTYPES[j])
    for i in range(1, 6):
        int_min[i] = torch.iinfo(DTYPES[i]).min
        int_max[i] = torch.iinfo(DTYPES[i]).max
    for real, cplx in (("float16", "complex32"), ("float32", "complex64"),
                       ("float64", "complex128")):
        to_complex[names.index(real)] = names.index(cplx)
        to_real[names.index(cplx)] = names.index(real)


cdef inline int dtype_code(object dtype):
    """Code of a torch.dtype, or DT_UNDEF for one the rules do not cover
    (quantized, float8, unsigned wider than 8 bits): those ops run eagerly."""
    cdef PyObject *p = <PyObject*>dtype
    cdef int i
    for i in range(NDTYPES):
        if dtype_ptr[i] == p:
            return i
    return DT_UNDEF


cdef inline int promote(int a, int b) noexcept:
    if a == DT_UNDEF:
        return b
    if b == DT_UNDEF:
        return a
    return promote_table[a][b]


cdef int default_float() except -2:
    # Read at each use: torch.set_default_dtype may change it between ops.
    return dtype_code(_get_default_dtype())


cdef inline bint is_complex(int d) noexcept:
    return d >= 0 and category[d] == CAT_COMPLEX

cdef inline bint is_float(int d) noexcept:
    return d >= 0 and category[d] == CAT_FLOAT

cdef inline bint is_integral(int d) noexcept:
    # bool counts as integral, as in c10::isIntegralType(t, includeBool=true)
    return d >= 0 and category[d] <= CAT_INT


cdef int combine_categories(int higher, int lower) except -2:
    # c10's combine_categories (TensorIterator result_type): the operand
    # class that ranks higher (dim tensors > 0-dim tensors > Python scalars)
    # wins unless the lower one is of a higher category.
    if is_complex(higher):
        return higher
    if is_complex(lower):
        if is_float(higher):
            return to_complex[higher]
        return lower
    if is_float(higher):
        return higher
    if higher == 0 or is_float(lower):  # 0 is bool
        return promote(higher, lower)
    if higher != DT_UNDEF:
        return higher
    return lower
