// What a captured CUDA graph needs of each tensor input at a replay
// (fastlazy/cuda_graphs.py): the dtype, device, sizes and strides it was
// captured with, and, for an input it reads where it lay at the capture
// (a parameter), the same address.  Read from the C++ tensor: a hot graph
// reads hundreds of parameters, and torch's Python getters cost about
// 0.3 us each.
#pragma once

#include <Python.h>
#include <stdint.h>

#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/python_variable.h>

namespace fastlazy {

struct InputLayout {
    int scalar_type = -1;
    int device = -1;              // the CUDA device's index
    std::vector<int64_t> sizes;
    std::vector<int64_t> strides;
    uintptr_t address = 0;        // the data pointer where the graph reads it in place, else 0
};

// The tensor behind `obj` where it is one a graph can be captured with (a
// dense strided CUDA tensor with no conjugate or negative bit), else
// nullptr.  It lives as long as `obj`.
inline const at::Tensor *capturable(PyObject *obj) {
    if (!THPVariable_Check(obj))
        return nullptr;
    const at::Tensor &t = THPVariable_Unpack(obj);
    if (!t.defined() || !t.is_cuda() || t.layout() != c10::kStrided)
        return nullptr;
    c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    if (impl->is_nested() || impl->has_symbolic_sizes_strides() || t.is_conj() || t.is_neg())
        return nullptr;
    return &t;
}

// The layout of `obj` into *layout; false (nothing written) where it is
// not capturable.  Never raises.
inline bool read_input_layout(PyObject *obj, InputLayout *layout) noexcept {
    try {
        const at::Tensor *t = capturable(obj);
        if (t == nullptr)
            return false;
        layout->scalar_type = static_cast<int>(t->scalar_type());
        layout->device = t->device().index();
        layout->sizes.assign(t->sizes().begin(), t->sizes().end());
        layout->strides.assign(t->strides().begin(), t->strides().end());
        layout->address = reinterpret_cast<uintptr_t>(t->data_ptr());
        return true;
    } catch (...) {
        return false;
    }
}

// Does `obj` have the layout captured (and its address, where the capture
// read it in place)?  Never raises.
inline bool same_input_layout(PyObject *obj, const InputLayout &want) noexcept {
    try {
        const at::Tensor *t = capturable(obj);
        if (t == nullptr || static_cast<int>(t->scalar_type()) != want.scalar_type
                || t->device().index() != want.device)
            return false;
        c10::IntArrayRef sizes = t->sizes(), strides = t->strides();
        if (sizes.size() != want.sizes.size())
            return false;
        for (size_t i = 0; i < want.sizes.size(); ++i)
            if (sizes[i] != want.sizes[i] || strides[i] != want.strides[i])
                return false;
        return want.address == 0 || reinterpret_cast<uintptr_t>(t->data_ptr()) == want.address;
    } catch (...) {
        return false;
    }
}

}  // namespace fastlazy
