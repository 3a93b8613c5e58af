/* The patched entry point: a callable that asks one question first.
 *
 * An Entry wraps one original torch callable (torch.add, Tensor.add,
 * Tensor.__add__, ...).  Its vectorcall scans the arguments for a LazyTensor
 * (a pointer comparison per argument).  With none it forwards the very same
 * argument vector to the original: no tuple, no dict, no re-parsing, so eager
 * code pays one extra C call.  With one it hands the vector to the recorder
 * that _core.pyx installs in fl_lazy_handler.
 *
 * Cython cannot write a vectorcall function that forwards its arguments
 * untouched (a `def f(*args, **kwargs)` builds a tuple and a dict per call),
 * which is why this small type is written in C.
 */
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *orig;      /* the original torch callable */
    PyObject *name;      /* qualified name, for repr and metrics */
    PyObject *dict;      /* __dict__ so functools/inspect helpers work */
    PyObject *weakrefs;  /* weak references: torch keeps some functions as
                            WeakKeyDictionary keys (torch.jit.script's
                            _jit_internal.boolean_dispatched) */
    int op;              /* opcode in the op table */
    int form;            /* enum fl_form */
} FLEntry;

/* How an entry point treats its first argument; _core.pxd exposes this
 * enum to Cython and Python (fastlazy._core.Form), so it is written once. */
enum fl_form {
    FORM_CALL = 0,      /* torch.X(input, ...), Tensor.X(self, ...), operators */
    FORM_INPLACE = 1,   /* Tensor.X_(self, ...), __iX__: writes self */
    /* A watch: an entry that never records (a lazy argument goes on to the
     * original, which reaches LazyTensor.__torch_function__ as before).  It
     * only computes, before an eager write, the pending nodes that may read
     * the memory written (see fl_flush_writes). */
    FORM_WATCH = 2,          /* writes only what out= names */
    FORM_WATCH_INPLACE = 3   /* torch.relu_, torch._foreach_add_: writes its
                                tensor arguments (and out=) */
};

typedef PyObject *(*fl_handler_t)(PyObject *entry, PyObject *const *args,
                                  Py_ssize_t nargs, PyObject *kwnames);

static PyTypeObject *fl_lazy_type = NULL;   /* LazyTensor */
static fl_handler_t fl_lazy_handler = NULL;
/* Nodes are waiting in the buffer (kept by _core.pyx).  An in-place entry
 * point then asks the core before an eager tensor is written: the nodes
 * that may read that tensor's memory are computed first, since they must
 * see the contents it had when they were recorded. */
static int fl_pending = 0;
/* Storages are watched for writes (_core.watch_writes: a program holding
 * a copy of their contents must hear of any write): in-place entry points
 * then report what they write even with no node pending. */
static int fl_watching = 0;
#define FL_CHECK_WRITES (fl_pending || fl_watching)
static int (*fl_flush_pending)(PyObject *written) = NULL;

/* Compute first the pending nodes that may read `written`: a tensor, or a
 * list or tuple of them (torch._foreach_add_'s self, out=(a, b)). */
static int
fl_flush_written(PyObject *written)
{
    if (PyList_Check(written) || PyTuple_Check(written)) {
        /* a list may change under us only through our own callbacks: hold it */
        PyObject *seq = PySequence_Fast(written, "");
        if (seq == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq) && FL_CHECK_WRITES; i++) {
            if (fl_flush_pending(PySequence_Fast_GET_ITEM(seq, i)) < 0) {
                Py_DECREF(seq);
                return -1;
            }
        }
        Py_DECREF(seq);
        return 0;
    }
    if (Py_TYPE(written) == fl_lazy_type)
        return 0;       /* a write to a LazyTensor rebinds it: no memory changes */
    return fl_flush_pending(written);
}

/* What the keyword out= names, of a call with n positional arguments,
 * computed first where pending nodes may read it (fl_flush_written). */
static int
fl_flush_out(PyObject *const *args, Py_ssize_t n, PyObject *kwnames)
{
    if (kwnames == NULL || kwnames == Py_None)
        return 0;
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nk && FL_CHECK_WRITES; k++) {
        if (PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, k), "out") == 0
                && fl_flush_written(args[n + k]) < 0)
            return -1;
    }
    return 0;
}

/* An eager call is about to write: what it writes must not change under a
 * pending node that read it (the graph sees the contents it was recorded
 * with).  Written are self (FORM_INPLACE), every positional argument
 * (FORM_WATCH_INPLACE: torch._fused_adam_ writes several lists), and what
 * out= names (any form). */
static int
fl_flush_writes(FLEntry *e, PyObject *const *args, Py_ssize_t n, PyObject *kwnames)
{
    if (e->form == FORM_INPLACE && n > 0 && fl_flush_written(args[0]) < 0)
        return -1;
    if (e->form == FORM_WATCH_INPLACE) {
        for (Py_ssize_t i = 0; i < n && FL_CHECK_WRITES; i++)
            if (fl_flush_written(args[i]) < 0)
                return -1;
    }
    return fl_flush_out(args, n, kwnames);
}

static PyObject *
fl_entry_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    FLEntry *e = (FLEntry *)self;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (e->form < FORM_WATCH) {
        Py_ssize_t total = n + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        for (Py_ssize_t i = 0; i < total; i++) {
            if (Py_TYPE(args[i]) == fl_lazy_type)
                /* Cython code sees a missing kwnames as None, never NULL */
                return fl_lazy_handler(self, args, n, kwnames ? kwnames : Py_None);
        }
    }
    if (FL_CHECK_WRITES && fl_flush_writes(e, args, n, kwnames) < 0)
        return NULL;
    return PyObject_Vectorcall(e->orig, args, nargsf, kwnames);
}

/* Bind like a Python function, so `tensor.add` is a bound method; CPython's
 * method-call fast path skips this binding because of
 * Py_TPFLAGS_METHOD_DESCRIPTOR. */
static PyObject *
fl_entry_descr_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static int
fl_entry_traverse(FLEntry *e, visitproc visit, void *arg)
{
    Py_VISIT(e->orig);
    Py_VISIT(e->name);
    Py_VISIT(e->dict);
    return 0;
}

static int
fl_entry_clear(FLEntry *e)
{
    Py_CLEAR(e->orig);
    Py_CLEAR(e->name);
    Py_CLEAR(e->dict);
    return 0;
}

static void
fl_entry_dealloc(FLEntry *e)
{
    PyObject_GC_UnTrack(e);
    if (e->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)e);
    fl_entry_clear(e);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *
fl_entry_repr(FLEntry *e)
{
    return PyUnicode_FromFormat("<fastlazy entry %U>", e->name);
}

static PyMemberDef fl_entry_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(FLEntry, orig), READONLY,
     "the original torch callable this entry falls through to"},
    /* what dynamo (torch.compile) traces in place of an object of a type
       its builder wraps as a jit function (fastlazy.patching registers
       Entry so): the original, which it knows */
    {"_torchdynamo_inline", T_OBJECT, offsetof(FLEntry, orig), READONLY,
     "the original torch callable, which torch.compile traces for the entry"},
    {"qualname", T_OBJECT, offsetof(FLEntry, name), READONLY,
     "where the entry is installed (torch.add, Tensor.add, F.relu), for metrics"},
    {"op", T_INT, offsetof(FLEntry, op), READONLY, "opcode"},
    {"form", T_INT, offsetof(FLEntry, form), READONLY, "entry form"},
    {NULL}
};

static PyObject *
fl_entry_get_doc(FLEntry *e, void *closure)
{
    return PyObject_GetAttrString(e->orig, "__doc__");
}

/* __name__ and __qualname__ are the original's: code that names a kernel
 * after the function it was handed (torch inductor's extern kernels) must
 * keep producing the names torch's own functions have. */
static PyObject *
fl_entry_get_name(FLEntry *e, void *closure)
{
    return PyObject_GetAttrString(e->orig, "__name__");
}

static PyObject *
fl_entry_get_qualname(FLEntry *e, void *closure)
{
    return PyObject_GetAttrString(e->orig, "__qualname__");
}

/* A module that stored an entry (HuggingFace's activations keep F.gelu)
 * is copied and pickled as with torch's own function: a copy is the entry
 * itself, as copying a function gives the function, and a pickle holds
 * the original (operator.getitem((original,), 0) when loaded), which
 * loads without fastlazy and takes LazyTensors through __torch_function__. */
static PyObject *
fl_reduce_to_original(PyObject *orig)
{
    PyObject *operator_module = PyImport_ImportModule("operator");
    if (operator_module == NULL)
        return NULL;
    PyObject *getitem = PyObject_GetAttrString(operator_module, "getitem");
    Py_DECREF(operator_module);
    if (getitem == NULL)
        return NULL;
    return Py_BuildValue("(N((O)i))", getitem, orig, 0);
}

static PyObject *
fl_entry_reduce(FLEntry *e, PyObject *unused)
{
    return fl_reduce_to_original(e->orig);
}

static PyObject *
fl_entry_copy(PyObject *self, PyObject *unused)
{
    Py_INCREF(self);
    return self;
}

static PyMethodDef fl_entry_methods[] = {
    {"__reduce__", (PyCFunction)fl_entry_reduce, METH_NOARGS, NULL},
    {"__copy__", (PyCFunction)fl_entry_copy, METH_NOARGS, NULL},
    {"__deepcopy__", (PyCFunction)fl_entry_copy, METH_O, NULL},
    {NULL}
};

static PyGetSetDef fl_entry_getset[] = {
    {"__doc__", (getter)fl_entry_get_doc, NULL, NULL, NULL},
    {"__name__", (getter)fl_entry_get_name, NULL, NULL, NULL},
    {"__qualname__", (getter)fl_entry_get_qualname, NULL, NULL, NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL}
};

static PyTypeObject FLEntryType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "fastlazy.Entry",
    .tp_basicsize = sizeof(FLEntry),
    .tp_dealloc = (destructor)fl_entry_dealloc,
    .tp_vectorcall_offset = offsetof(FLEntry, vectorcall),
    .tp_repr = (reprfunc)fl_entry_repr,
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
                Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_traverse = (traverseproc)fl_entry_traverse,
    .tp_clear = (inquiry)fl_entry_clear,
    .tp_descr_get = fl_entry_descr_get,
    .tp_members = fl_entry_members,
    .tp_methods = fl_entry_methods,
    .tp_getset = fl_entry_getset,
    .tp_dictoffset = offsetof(FLEntry, dict),
    .tp_weaklistoffset = offsetof(FLEntry, weakrefs),
};

static PyObject *
fl_entry_new(PyObject *orig, PyObject *name, int op, int form)
{
    FLEntry *e = PyObject_GC_New(FLEntry, &FLEntryType);
    if (e == NULL)
        return NULL;
    e->vectorcall = fl_entry_vectorcall;
    Py_INCREF(orig);
    e->orig = orig;
    Py_INCREF(name);
    e->name = name;
    e->dict = NULL;
    e->weakrefs = NULL;
    e->op = op;
    e->form = form;
    PyObject_GC_Track(e);
    return (PyObject *)e;
}

static int
fl_entry_setup(PyTypeObject *lazy_type, fl_handler_t handler,
               int (*flush_pending)(PyObject *))
{
    fl_lazy_type = lazy_type;
    fl_lazy_handler = handler;
    fl_flush_pending = flush_pending;
    return PyType_Ready(&FLEntryType);
}

static inline int fl_entry_op(PyObject *e) { return ((FLEntry *)e)->op; }
static inline int fl_entry_form(PyObject *e) { return ((FLEntry *)e)->form; }
/* the original torch callable (borrowed) */
static inline PyObject *fl_entry_orig(PyObject *e) { return ((FLEntry *)e)->orig; }
