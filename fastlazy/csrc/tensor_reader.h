// fl_read_tensor (tensor_facts.h) for the torch this extension is compiled
// against: the C++ tensor behind a torch.Tensor read directly, as torch's
// own getters read it, without making a Python object per size.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/python_variable.h>

#include "tensor_facts.h"

namespace fastlazy {

inline int read_tensor(PyObject *obj, fl_tensor_facts *facts, int64_t *sizes,
                       int64_t *strides, int capacity) noexcept {
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined())
            return FL_UNREAD;
        c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        // (their sizes are not a plain list: the getters answer, or raise)
        if (impl->is_nested() || impl->has_symbolic_sizes_strides())
            return FL_UNREAD;
        c10::IntArrayRef shape = t.sizes();
        const int64_t rank = static_cast<int64_t>(shape.size());
        const int scalar_type = static_cast<int>(t.scalar_type());
        facts->scalar_type = scalar_type < FL_SCALAR_TYPES ? scalar_type : FL_SCALAR_TYPES;
        const c10::Device device = t.device();
        facts->device = device.is_cpu() ? 0 : device.is_cuda() ? 1 + device.index() : -1;
        facts->strided = t.layout() == c10::kStrided;
        facts->requires_grad = t.requires_grad();
        // read here, where the tensor is at hand, so that recording it as a
        // graph input costs no Python int (Segment.add_slot)
        const c10::VariableVersion &version = impl->version_counter();
        facts->version = version.enabled() ? static_cast<int64_t>(version.current_version()) : -1;
        if (rank > capacity)
            return FL_TOO_MANY_DIMS;
        for (int64_t i = 0; i < rank; ++i)
            sizes[i] = shape[i];
        if (strides != nullptr && facts->strided) {
            c10::IntArrayRef stride = t.strides();
            for (int64_t i = 0; i < rank; ++i)
                strides[i] = stride[i];
        }
        return static_cast<int>(rank);
    } catch (...) {
        return FL_UNREAD;
    }
}

inline int grad_enabled() noexcept {
    return c10::GradMode::is_enabled();
}

inline int storage_address(PyObject *obj, uintptr_t *address) noexcept {
    try {
        const at::Tensor &t = THPVariable_Unpack(obj);
        if (!t.defined())
            return 0;
        c10::TensorImpl *impl = t.unsafeGetTensorImpl();
        // (what Tensor.untyped_storage() refuses or answers otherwise)
        if (impl->is_nested() || impl->layout() != c10::kStrided || !impl->has_storage())
            return 0;
        const c10::Storage &storage = impl->storage();
        if (storage.device_type() == c10::kMeta) {
            *address = 0;
            return 1;
        }
        *address = reinterpret_cast<uintptr_t>(storage.data_ptr().get());
        return 1;
    } catch (...) {
        return 0;
    }
}

// the readers the capsule hands to the core
inline const fl_torch_readers readers = {read_tensor, grad_enabled, storage_address};

}  // namespace fastlazy
