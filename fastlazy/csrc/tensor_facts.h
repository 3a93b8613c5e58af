/* What fastlazy's core reads of an eager tensor passed beside LazyTensors,
 * and the signature of the function that reads it.
 *
 * The core can read it through torch.Tensor's Python getters (a
 * torch.Size, a stride tuple and a Python int per size).  The step
 * executor's extension, compiled against the installed torch's headers,
 * reads the same from the C++ tensor, about 160 ns less a tensor, and its
 * reader is handed to the core at boot; a build without the executor keeps
 * the getters.  Plain C: both extensions include it. */
#ifndef FASTLAZY_TENSOR_FACTS_H
#define FASTLAZY_TENSOR_FACTS_H

#include <Python.h>
#include <stdint.h>

/* what fl_read_tensor returns besides a rank */
#define FL_UNREAD (-1)      /* not read (a nested tensor, symbolic sizes...): ask the getters */
#define FL_TOO_MANY_DIMS (-2)

/* the name of the capsule that carries the readers (fl_torch_readers) from
 * one extension to the other */
#define FL_TENSOR_READER_CAPSULE "fastlazy.fl_torch_readers"

/* scalar_type's bound: c10::ScalarType numbers at or above it are not read */
#define FL_SCALAR_TYPES 64

typedef struct {
    int scalar_type;        /* c10::ScalarType's number for the dtype, FL_SCALAR_TYPES where
                             * it is past the bound: the reader's user maps numbers to its
                             * own dtypes by reading one tensor of each dtype (no Python
                             * torch.dtype object is touched per read) */
    int device;             /* 0 cpu, 1 + index for cuda:index, -1 any other device */
    int strided;            /* layout is torch.strided (strides read only then) */
    int requires_grad;
    int64_t version;        /* its version counter; -1 where it keeps none (an inference tensor) */
} fl_tensor_facts;

/* Read a torch.Tensor (or Parameter) `t`: its rank, with its sizes into
 * sizes[0..rank) and, where `strides` is not NULL and the layout is
 * strided, its strides; FL_TOO_MANY_DIMS (nothing written to the arrays)
 * where the rank exceeds `capacity`; FL_UNREAD where it cannot answer.
 * Never raises. */
typedef int (*fl_read_tensor_fn)(PyObject *t, fl_tensor_facts *facts, int64_t *sizes,
                                 int64_t *strides, int capacity);

/* Is grad mode on in this thread (torch.is_grad_enabled() without a Python
 * call: the rules ask it of every op with an operand that requires grad,
 * which every nn.Parameter does, under no_grad too)? */
typedef int (*fl_grad_enabled_fn)(void);

/* The address of the memory a torch.Tensor (or Parameter) `t` reads and
 * writes (its storage's data pointer) into *address, 0 for a tensor with
 * no memory (a meta tensor); 1 where told, 0 where it cannot be (sparse,
 * nested, no storage, anything unexpected).  Never raises.  What an eager
 * write is checked against, for each input of the pending graph, without
 * a Python storage object per tensor. */
typedef int (*fl_storage_address_fn)(PyObject *t, uintptr_t *address);

/* what the capsule points at */
typedef struct {
    fl_read_tensor_fn read_tensor;
    fl_grad_enabled_fn grad_enabled;
    fl_storage_address_fn storage_address;
} fl_torch_readers;

#endif
