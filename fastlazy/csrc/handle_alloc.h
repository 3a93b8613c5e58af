/* Memory for LazyTensor handles, kept off the cycle collector's list while
 * they are pending.
 *
 * Every recorded op makes a handle, and most die a few ops later.  A
 * pending handle holds only its segment and metadata, so it cannot close a
 * cycle and the collector has nothing to find in it; tensor.pxi tracks it
 * once it holds a value or attributes.  Allocating it through CPython's
 * generic allocator links it into generation 0 (PyObject_GC_Track) and
 * unlinking it again costs a second call: together about 8 ns of a ~100 ns
 * recorded op.  This allocator hands the recording path a handle from its
 * own free list, never linked; every other caller (fastlazy.lazy's wrap,
 * Python's LazyTensor.__new__) gets one tracked as before.
 *
 * Installed as the type's tp_alloc and tp_free: Cython's tp_new allocates
 * through tp_alloc and its tp_dealloc (which untracks first) frees through
 * tp_free.  Everything runs under the GIL. */
#ifndef FASTLAZY_HANDLE_ALLOC_H
#define FASTLAZY_HANDLE_ALLOC_H

#include <Python.h>
#include <stdint.h>

#define FL_HANDLE_FREE_MAX 256

static PyTypeObject *fl_handle_type = NULL;
static PyObject *fl_handle_free_list[FL_HANDLE_FREE_MAX];
static int fl_handle_nfree = 0;
/* Set by the recording path just before it allocates: the next handle
 * stays untracked.  Cleared by every allocation. */
static int fl_handle_pending_next = 0;

/* gcc would turn the zeroing loop below back into a call of libc's memset,
 * whose AVX-512 store costs several ns more than a few inline stores */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-loop-distribute-patterns")))
#endif
static PyObject *fl_handle_alloc(PyTypeObject *type, Py_ssize_t nitems)
{
    PyObject *o;
    int untracked = fl_handle_pending_next;
    fl_handle_pending_next = 0;
    if (type == fl_handle_type && fl_handle_nfree > 0) {
        o = fl_handle_free_list[--fl_handle_nfree];
        /* zeroed as a new object is (Cython's tp_new then sets the object
         * members) */
        uint64_t *words = (uint64_t *)o;
        Py_ssize_t n = type->tp_basicsize / (Py_ssize_t)sizeof(uint64_t);
        for (Py_ssize_t i = 0; i < n; i++)
            words[i] = 0;
        (void)PyObject_INIT(o, type);       /* (a heap type gains a reference) */
        if (!untracked)
            PyObject_GC_Track(o);
        return o;
    }
    o = PyType_GenericAlloc(type, nitems);  /* tracked */
    if (o != NULL && untracked)
        PyObject_GC_UnTrack(o);
    return o;
}

static void fl_handle_free(void *o)
{
    /* tp_dealloc has untracked it */
    if (Py_TYPE((PyObject *)o) == fl_handle_type && fl_handle_nfree < FL_HANDLE_FREE_MAX) {
        fl_handle_free_list[fl_handle_nfree++] = (PyObject *)o;
        return;
    }
    PyObject_GC_Del(o);
}

static void fl_handle_install(PyObject *type)
{
    fl_handle_type = (PyTypeObject *)type;
    fl_handle_type->tp_alloc = fl_handle_alloc;
    fl_handle_type->tp_free = fl_handle_free;
}

#endif
