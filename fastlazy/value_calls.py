"""torch functions bound in C++ without __torch_function__ handling that
torch's own Python code calls on user tensors.

A LazyTensor passes `isinstance(x, torch.Tensor)` (so that user code and
torch's Python treat it as a tensor), and so does C++'s THPVariable_Check:
a pybind-bound function would read the LazyTensor's memory as a tensor it
is not, and the process dies (SIGSEGV).  The bindings below are those that
torch's Python API hands user tensors to; each is replaced where that API
looks it up, and with a LazyTensor argument it runs on the values:

- non-reentrant activation checkpointing (`torch.utils.checkpoint`,
  HuggingFace's gradient_checkpointing_enable()) saves the inputs with
  `_make_saved_tensor`: the value is saved (the checkpointed forward runs
  eagerly inside the checkpoint's saved-tensor hooks: csrc/saved_hooks.pxi);
- `torch.utils.dlpack.to_dlpack` exports the value's memory;
- `torch.vmap` (and functorch's transforms built on `_add_batch_dim`)
  batches the value: the function runs eagerly, as do its results; its
  arguments not batched (`in_dims` None: an ensemble's shared input) are
  given as values too, for a LazyTensor met by a batched tensor inside
  the transform could not record;
- `torch.func.grad` and `grad_and_value` (their implementations, which
  torch.func looks up at each call) take the values of LazyTensor
  arguments before the transform's level opens: a pending one computed
  inside it had its ops wrapped at that level (an INTERNAL ASSERT in
  functorch's TensorWrapper);
- forward-mode AD (`torch.func.jvp`, `jacfwd`, `torch.autograd.
  forward_ad.make_dual`) pairs the value with its tangent: the function
  runs eagerly on the dual tensor (a dual made of a LazyTensor was an
  empty meta stand-in: jvp returned empty tensors), a call with a
  LazyTensor inside a dual level runs eagerly (csrc/saved_hooks.pxi) and
  its result, a LazyTensor holding the dual, is unpacked as that value
  (`unpack_dual`), and `torch.func.
  linearize` traces jvp with make_fx (found through functorch's module
  at each call, however the user imported linearize) on the values of the
  tangents it made from LazyTensor primals: LazyTensors handed to the
  trace would have recorded their ops unseen by it, and its linear
  function returned garbage (it then takes LazyTensor tangents as any
  function does);
- `torch.jit.trace` traces on the values of its example inputs;
- the sparse constructors (`torch.sparse_coo_tensor`, `sparse_csr_tensor`
  ... and their argument checks) and `torch.nested.nested_tensor` build
  their eager sparse or nested tensor from the values, as every op with
  such a result runs eagerly (a graph network's adjacency matrix from a
  lazy edge index);
- `torch.Tensor._make_subclass` (tensor subclasses' constructors) makes the
  subclass instance around the value;
- a TorchScript function (`torch.jit.script(fn)`, `torch.jit.trace(fn)`)
  runs on the values, and its tensor results come back as LazyTensors, as
  an op run eagerly does (it hands its arguments to its graph without
  asking `__torch_function__`, and read a LazyTensor as an empty tensor).

One binding is answered from the LazyTensors' own metadata instead:
`torch._C._group_tensors_by_device_and_dtype`, which the foreach
optimizers, `clip_grad_norm_` and `get_total_norm` call to sort their
tensor lists, would group LazyTensors by their stand-in's (meta, float32)
and hand the stand-ins back; with a LazyTensor among them the lists are
grouped here, by each tensor's device and dtype, the LazyTensors kept.
"""
from __future__ import annotations

import functools
import importlib

import torch

from fastlazy import _core, fallback

# (module, attribute) where torch's Python finds each binding
_BINDINGS = (
    ("torch.utils.checkpoint", "_make_saved_tensor"),
    ("torch.utils.dlpack", "to_dlpack"),
    ("torch", "to_dlpack"),
    ("torch._functorch.vmap", "_add_batch_dim"),
    ("torch._functorch.apis", "vmap_impl"),
    ("torch._functorch.eager_transforms", "_wrap_for_grad"),
    ("torch._functorch.eager_transforms", "grad_impl"),
    ("torch._functorch.eager_transforms", "grad_and_value_impl"),
    ("torch.autograd.forward_ad", "make_dual"),
    ("torch.autograd.forward_ad", "unpack_dual"),
    ("torch.jit", "trace"),
    ("torch.jit._trace", "trace"),
    *(("torch", f"{check}sparse_{layout}_tensor{suffix}")
      for layout in ("coo", "csr", "csc", "bsr", "bsc", "compressed")
      for check, suffix in (("", ""), ("_validate_", "_args"))),
    ("torch._C._nested", "nested_tensor"),
)


def _on_values(function):
    def on_values(*args, **kwargs):
        return function(*fallback.materialize(args), **fallback.materialize(kwargs))
    return _core.lazy_arguments_first(function, on_values)


def _script_function_call(call):
    def on_values(self, *args, **kwargs):
        fallback.count("ScriptFunction", "a TorchScript function runs on the values")
        return fallback.run(functools.partial(call, self), args, kwargs)
    return _core.lazy_arguments_first(call, on_values)


def _traced_on_values(disallow, make_fx):
    """functorch's lazy_dynamo_disallow (through which linearize calls
    make_fx), handing back for make_fx a make_fx whose traced function is
    called with the values of its LazyTensor arguments (make_fx itself must
    reach dynamo's disallow_in_graph, which takes only callables it knows)."""
    @functools.wraps(disallow)
    def disallowed(func):
        found = disallow(func)
        if func is not make_fx:
            return found

        @functools.wraps(found)
        def make(*args, **kwargs):
            traced = found(*args, **kwargs)

            @functools.wraps(traced)
            def trace(*inputs):
                return traced(*fallback.materialize(inputs))
            return trace
        return make
    return disallowed


def python_patches():
    """(owner, attr, replacement) for each binding this torch has."""
    patches = []
    try:
        transforms = importlib.import_module("torch._functorch.eager_transforms")
    except ImportError:
        transforms = None
    if (getattr(transforms, "make_fx", None) is not None
            and getattr(transforms, "lazy_dynamo_disallow", None) is not None):
        patches.append((transforms, "lazy_dynamo_disallow",
                        _traced_on_values(transforms.lazy_dynamo_disallow, transforms.make_fx)))
    patches += [(torch._C.ScriptFunction, "__call__",
                _script_function_call(torch._C.ScriptFunction.__call__)),
               (torch.Tensor, "_make_subclass",
                staticmethod(_on_values(torch.Tensor._make_subclass)))]
    group = getattr(torch._C, "_group_tensors_by_device_and_dtype", None)
    if group is not None:
        patches.append((torch._C, "_group_tensors_by_device_and_dtype", _grouping(group)))
    for module_name, attr in _BINDINGS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        function = getattr(module, attr, None)
        if function is not None:
            patches.append((module, attr, _on_values(function)))
    return patches


def _grouping(original):
    """torch._C._group_tensors_by_device_and_dtype(tensorlistlist,
    with_indices): {(device, dtype): (each list's tensors at the indices
    whose first-list tensor has that device and dtype -- an empty list
    staying empty --, those indices or [])}, as the binding returns it."""
    def group(tensorlistlist, with_indices=False):
        groups = {}
        for i, t in enumerate(tensorlistlist[0]):
            lists, indices = groups.setdefault((t.device, t.dtype),
                                               ([[] for _ in tensorlistlist], []))
            for tensors, grouped in zip(tensorlistlist, lists):
                if tensors:         # (an empty list stays empty: SGD's unused momenta)
                    grouped.append(tensors[i])
            if with_indices:
                indices.append(i)
        return groups

    # (called where a list holds a LazyTensor; torch's own from C otherwise)
    return _core.lazy_arguments_first(original, group)
