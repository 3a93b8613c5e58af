/* Guards: the stand-ins for torch's Python-level functions and tensor
 * attributes that fastlazy must see only in a rare case, but that eager
 * code calls all the time: an optimizer's zero_grad sets every parameter's
 * `grad`, its step enters `record_function` (a torch.ops call), every
 * `loss.backward()` goes through torch.autograd.backward, and
 * torch.nn.functional asks has_torch_function on each call.  A Python
 * wrapper costs 0.2-1 us a call: about 4 % of a small model's eager
 * training step under enable(), where P4 allows 3 %.
 *
 * A Guard forwards the argument vector untouched to the original (as an
 * Entry does, _entry.h) unless its condition holds, and then hands the same
 * vector to a Python function, `slow`, which does the rare work:
 *
 *   GUARD_LAZY    an argument holds a LazyTensor (in a list, tuple or dict
 *                 too): slow reads them first (torch.autograd.backward)
 *   GUARD_DATA    an argument is a LazyTensor, or a list or tuple with one
 *                 among its items or along its first elements (torch's
 *                 constructors and factories: a list of a million floats
 *                 is not scanned whole, as torch.tensor must stay as cheap);
 *                 otherwise the eager tensor out= names (`torch.zeros(...,
 *                 out=t)`, a factory no watch entry stands for: this guard
 *                 does) is written, so pending nodes reading it run first
 *   GUARD_WRITES  the calling thread has nodes pending, or storages are
 *                 watched: slow computes what the call may write first
 *                 (torch.ops calls)
 *   GUARD_GATES   some thread's gate has a "no" to give (python_bodies'
 *                 has_torch_function gates): slow answers
 *
 * A TensorAttr stands in for a C attribute of torch.Tensor (`grad`,
 * `data`): reads go straight to torch's own descriptor; a write goes to
 * `slow(tensor, value)` when the value is a LazyTensor (or, with
 * `writes` set, while nodes are pending or storages watched), else to
 * torch's setter.  Both need _entry.h's fl_lazy_type and flags.
 */
#include <Python.h>
#include <structmember.h>

enum fl_guard_when {
    GUARD_LAZY = 0,
    GUARD_WRITES = 1,
    GUARD_GATES = 2,
    GUARD_DATA = 3
};

/* Gates with a "no" to give, over all threads (python_bodies.OneNo). */
static int fl_gates_open = 0;
/* Whether an eager write may matter now, asked once FL_CHECK_WRITES is
 * set: a storage is watched, or the calling thread has nodes pending
 * (fl_pending stays set once several threads have recorded). */
static int (*fl_writes_matter)(void) = NULL;
/* functools.partial, whose arguments fallback.materialize reads too */
static PyTypeObject *fl_partial_type = NULL;

static int fl_holds_lazy(PyObject *v, int depth);

static int
fl_items_hold_lazy(PyObject *seq, int depth)
{
    PyObject *fast = PySequence_Fast(seq, "");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int found = 0;
    for (Py_ssize_t i = 0; i < n && !found; i++)
        found = fl_holds_lazy(items[i], depth + 1);
    Py_DECREF(fast);
    return found;
}

/* Is v a LazyTensor, or does it hold one where fallback.materialize looks
 * (lists, tuples, dict values, a functools.partial's arguments)? */
static int
fl_holds_lazy(PyObject *v, int depth)
{
    PyTypeObject *t = Py_TYPE(v);
    if (t == fl_lazy_type)
        return 1;
    if (depth > 32)
        return 0;
    if (t == &PyList_Type || t == &PyTuple_Type)
        return fl_items_hold_lazy(v, depth);
    if (t == &PyDict_Type) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(v, &pos, &key, &value)) {
            int found = fl_holds_lazy(value, depth + 1);
            if (found)
                return found;
        }
        return 0;
    }
    if (t == fl_partial_type) {
        int found = 0;
        PyObject *args = PyObject_GetAttrString(v, "args");
        if (args == NULL)
            return -1;
        found = fl_holds_lazy(args, depth + 1);
        Py_DECREF(args);
        if (found)
            return found;
        PyObject *keywords = PyObject_GetAttrString(v, "keywords");
        if (keywords == NULL)
            return -1;
        found = fl_holds_lazy(keywords, depth + 1);
        Py_DECREF(keywords);
        return found;
    }
    return 0;
}

/* GUARD_DATA's look at one argument, and conversions.py's (a LazyTensor
 * at the top of `v`, among its top-level items, or along its first
 * elements: not every element, as torch.tensor of a million floats must
 * stay as cheap).  The walk along the first elements is bounded only
 * against a list that holds itself. */
#define FL_DATA_DEPTH (1 << 16)
static int
fl_data_lazy(PyObject *v)
{
    PyTypeObject *t = Py_TYPE(v);
    if (t == fl_lazy_type)
        return 1;
    if (t != &PyList_Type && t != &PyTuple_Type)
        return 0;
    Py_ssize_t n = t == &PyList_Type ? PyList_GET_SIZE(v) : PyTuple_GET_SIZE(v);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = t == &PyList_Type ? PyList_GET_ITEM(v, i) : PyTuple_GET_ITEM(v, i);
        if (Py_TYPE(item) == fl_lazy_type)
            return 1;
    }
    /* along the first elements: torch.tensor([[x0, x1]]) */
    PyObject *first = v;
    for (int depth = 0; depth < FL_DATA_DEPTH; depth++) {
        t = Py_TYPE(first);
        if (t == fl_lazy_type)
            return 1;
        if (t == &PyList_Type && PyList_GET_SIZE(first) > 0)
            first = PyList_GET_ITEM(first, 0);
        else if (t == &PyTuple_Type && PyTuple_GET_SIZE(first) > 0)
            first = PyTuple_GET_ITEM(first, 0);
        else
            return 0;
    }
    return 0;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;      /* the original torch callable */
    PyObject *slow;      /* called in its place when the condition holds */
    PyObject *dict;
    PyObject *weakrefs;
    int when;            /* enum fl_guard_when */
} FLGuard;

static PyObject *
fl_guard_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    FLGuard *g = (FLGuard *)self;
    int slow = 0;
    if (g->when == GUARD_LAZY) {
        Py_ssize_t total = PyVectorcall_NARGS(nargsf) + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        for (Py_ssize_t i = 0; i < total && !slow; i++) {
            slow = fl_holds_lazy(args[i], 0);
            if (slow < 0)
                return NULL;
        }
    } else if (g->when == GUARD_DATA) {
        Py_ssize_t total = PyVectorcall_NARGS(nargsf) + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        for (Py_ssize_t i = 0; i < total && !slow; i++)
            slow = fl_data_lazy(args[i]);
        if (!slow && FL_CHECK_WRITES
                && fl_flush_out(args, PyVectorcall_NARGS(nargsf), kwnames) < 0)
            return NULL;
    } else if (g->when == GUARD_WRITES) {
        if (FL_CHECK_WRITES) {
            slow = fl_writes_matter();
            if (slow < 0)
                return NULL;
        }
    } else {
        slow = fl_gates_open > 0;
    }
    return PyObject_Vectorcall(slow ? g->slow : g->orig, args, nargsf, kwnames);
}

static int
fl_guard_traverse(FLGuard *g, visitproc visit, void *arg)
{
    Py_VISIT(g->orig);
    Py_VISIT(g->slow);
    Py_VISIT(g->dict);
    return 0;
}

static int
fl_guard_clear(FLGuard *g)
{
    Py_CLEAR(g->orig);
    Py_CLEAR(g->slow);
    Py_CLEAR(g->dict);
    return 0;
}

static void
fl_guard_dealloc(FLGuard *g)
{
    PyObject_GC_UnTrack(g);
    if (g->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)g);
    fl_guard_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyObject *
fl_guard_repr(FLGuard *g)
{
    return PyUnicode_FromFormat("<fastlazy guard of %R>", g->orig);
}

static PyObject *
fl_guard_get_orig_attr(FLGuard *g, void *name)
{
    return PyObject_GetAttrString(g->orig, (const char *)name);
}

/* Copied and pickled as torch's own function is (a module holding
 * torch.zeros is deep-copied: an EMA model): a copy is the guard itself, a
 * pickle the original (as Entry's, _entry.h). */
static PyObject *
fl_guard_reduce(FLGuard *g, PyObject *unused)
{
    return fl_reduce_to_original(g->orig);
}

static PyMethodDef fl_guard_methods[] = {
    {"__reduce__", (PyCFunction)fl_guard_reduce, METH_NOARGS, NULL},
    {"__copy__", (PyCFunction)fl_entry_copy, METH_NOARGS, NULL},
    {"__deepcopy__", (PyCFunction)fl_entry_copy, METH_O, NULL},
    {NULL}
};

static PyMemberDef fl_guard_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(FLGuard, orig), READONLY,
     "the original callable this guard falls through to"},
    /* what dynamo traces in place of a guard (fastlazy.patching registers
       Guard as it registers Entry): the original */
    {"_torchdynamo_inline", T_OBJECT, offsetof(FLGuard, orig), READONLY,
     "the original callable, which torch.compile traces for the guard"},
    {"slow", T_OBJECT, offsetof(FLGuard, slow), READONLY,
     "the Python function called when the guard's condition holds"},
    {"when", T_INT, offsetof(FLGuard, when), READONLY, "the guard's condition"},
    {NULL}
};

static PyGetSetDef fl_guard_getset[] = {
    {"__doc__", (getter)fl_guard_get_orig_attr, NULL, NULL, "__doc__"},
    {"__name__", (getter)fl_guard_get_orig_attr, NULL, NULL, "__name__"},
    {"__qualname__", (getter)fl_guard_get_orig_attr, NULL, NULL, "__qualname__"},
    {"__module__", (getter)fl_guard_get_orig_attr, NULL, NULL, "__module__"},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL}
};

static PyTypeObject FLGuardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastlazy.Guard",
    .tp_basicsize = sizeof(FLGuard),
    .tp_dealloc = (destructor)fl_guard_dealloc,
    .tp_vectorcall_offset = offsetof(FLGuard, vectorcall),
    .tp_repr = (reprfunc)fl_guard_repr,
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
                Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_traverse = (traverseproc)fl_guard_traverse,
    .tp_clear = (inquiry)fl_guard_clear,
    /* binds like a Python function, as an Entry does (OpOverloadPacket.__call__
       is a method) */
    .tp_descr_get = fl_entry_descr_get,
    .tp_members = fl_guard_members,
    .tp_methods = fl_guard_methods,
    .tp_getset = fl_guard_getset,
    .tp_dictoffset = offsetof(FLGuard, dict),
    .tp_weaklistoffset = offsetof(FLGuard, weakrefs),
};

static PyObject *
fl_guard_new(PyObject *orig, PyObject *slow, int when)
{
    if (when < GUARD_LAZY || when > GUARD_DATA) {
        PyErr_Format(PyExc_ValueError, "no guard condition %d", when);
        return NULL;
    }
    FLGuard *g = PyObject_GC_New(FLGuard, &FLGuardType);
    if (g == NULL)
        return NULL;
    g->vectorcall = fl_guard_vectorcall;
    Py_INCREF(orig);
    g->orig = orig;
    Py_INCREF(slow);
    g->slow = slow;
    g->dict = NULL;
    g->weakrefs = NULL;
    g->when = when;
    PyObject_GC_Track(g);
    return (PyObject *)g;
}

/* -- TensorAttr ------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *base;      /* torch's own descriptor (a getset of TensorBase) */
    PyObject *slow;      /* slow(tensor, value) */
    int writes;          /* also slow while nodes are pending or watched */
} FLTensorAttr;

static PyObject *
fl_attr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    FLTensorAttr *a = (FLTensorAttr *)self;
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return Py_TYPE(a->base)->tp_descr_get(a->base, obj, type);
}

static int
fl_attr_set(PyObject *self, PyObject *obj, PyObject *value)
{
    FLTensorAttr *a = (FLTensorAttr *)self;
    int slow = value != NULL && Py_TYPE(value) == fl_lazy_type;
    if (!slow && value != NULL && a->writes && FL_CHECK_WRITES) {
        slow = fl_writes_matter();
        if (slow < 0)
            return -1;
    }
    if (slow) {
        PyObject *r = PyObject_CallFunctionObjArgs(a->slow, obj, value, NULL);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    return Py_TYPE(a->base)->tp_descr_set(a->base, obj, value);
}

static int
fl_attr_traverse(FLTensorAttr *a, visitproc visit, void *arg)
{
    Py_VISIT(a->base);
    Py_VISIT(a->slow);
    return 0;
}

static int
fl_attr_clear(FLTensorAttr *a)
{
    Py_CLEAR(a->base);
    Py_CLEAR(a->slow);
    return 0;
}

static void
fl_attr_dealloc(FLTensorAttr *a)
{
    PyObject_GC_UnTrack(a);
    fl_attr_clear(a);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *
fl_attr_get_base_attr(FLTensorAttr *a, void *name)
{
    return PyObject_GetAttrString(a->base, (const char *)name);
}

static PyMemberDef fl_attr_members[] = {
    {"base", T_OBJECT, offsetof(FLTensorAttr, base), READONLY, "torch's own descriptor"},
    {NULL}
};

static PyGetSetDef fl_attr_getset[] = {
    {"__doc__", (getter)fl_attr_get_base_attr, NULL, NULL, "__doc__"},
    {"__name__", (getter)fl_attr_get_base_attr, NULL, NULL, "__name__"},
    {NULL}
};

static PyTypeObject FLTensorAttrType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastlazy.TensorAttr",
    .tp_basicsize = sizeof(FLTensorAttr),
    .tp_dealloc = (destructor)fl_attr_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)fl_attr_traverse,
    .tp_clear = (inquiry)fl_attr_clear,
    .tp_descr_get = fl_attr_get,
    .tp_descr_set = fl_attr_set,
    .tp_members = fl_attr_members,
    .tp_getset = fl_attr_getset,
};

static PyObject *
fl_tensor_attr_new(PyObject *base, PyObject *slow, int writes)
{
    if (Py_TYPE(base)->tp_descr_get == NULL || Py_TYPE(base)->tp_descr_set == NULL) {
        PyErr_Format(PyExc_TypeError, "%R is not a data descriptor", base);
        return NULL;
    }
    FLTensorAttr *a = PyObject_GC_New(FLTensorAttr, &FLTensorAttrType);
    if (a == NULL)
        return NULL;
    Py_INCREF(base);
    a->base = base;
    Py_INCREF(slow);
    a->slow = slow;
    a->writes = writes;
    PyObject_GC_Track(a);
    return (PyObject *)a;
}

static int
fl_guards_setup(PyObject *partial_type, int (*writes_matter)(void))
{
    fl_writes_matter = writes_matter;
    fl_partial_type = (PyTypeObject *)partial_type;
    Py_INCREF(partial_type);
    if (PyType_Ready(&FLGuardType) < 0)
        return -1;
    return PyType_Ready(&FLTensorAttrType);
}
