# distutils: language = c++
"""fastlazy's C++ against ATen's headers: the step executor
(csrc/step_executor.h: a graph in TorchScript IR run step by step, ATen's
CPU kernels called directly where they can be), the packed convolution op,
and the pool of large CPU buffers for graph runs and recorded backwards
(csrc/cpu_pool.h).  Built only where torch was importable when fastlazy
was built (see fastlazy/step_executor.py, which loads it)."""
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t, uintptr_t
from libcpp.memory cimport shared_ptr, make_shared
from libcpp.string cimport string
from libcpp.vector cimport vector

from torch import Tensor as torch_Tensor


cdef extern from *:
    const char *FASTLAZY_TORCH_VERSION     # defined by setup.py


# the torch this module was compiled against (fastlazy.step_executor uses
# it only under that torch)
TORCH_VERSION = FASTLAZY_TORCH_VERSION.decode()


cdef extern from "tensor_facts.h":
    ctypedef struct fl_torch_readers:
        pass
    const char *FL_TENSOR_READER_CAPSULE


cdef extern from "tensor_reader.h" namespace "fastlazy":
    const fl_torch_readers readers


def tensor_reader():
    """The C++ readers of an eager tensor's metadata and storage address
    and of grad mode (tensor_facts.h), in a capsule for
    fastlazy._core.set_tensor_reader."""
    return PyCapsule_New(<void *>&readers, FL_TENSOR_READER_CAPSULE, NULL)


cdef extern from "step_executor.h" namespace "fastlazy" nogil:
    cdef cppclass CStepProgram "fastlazy::StepProgram":
        CStepProgram(const string& ir) except +
        long long steps()
        long long direct_steps()
        long long direct_calls()
        long long boxed_calls()
        long long reused_buffers()
        bint read_fast()
        bint releases_gil()

    object run_program "fastlazy_run" (CStepProgram& program, tuple args) with gil


cdef extern from "gil_lending.h" namespace "fastlazy":
    void c_borrow_gil_on_this_thread "fastlazy::borrow_gil_on_this_thread" (
        int64_t run_us, int64_t sleep_us)
    void c_set_gil_lending "fastlazy::set_gil_lending" (bint on)


def borrow_gil_on_this_thread(int64_t run_us, int64_t sleep_us):
    """This thread (one of compile_worker's) takes the GIL while a graph
    run of the user's has let go of it, lets go of it the moment that run
    ends, and otherwise runs run_us of every run_us + sleep_us
    (csrc/gil_lending.h), while lending is on (set_gil_lending)."""
    c_borrow_gil_on_this_thread(run_us, sleep_us)


def set_gil_lending(bint on):
    """Hold the borrowing threads to the lent GIL and their slices (on), or
    let them run unlimited (a thread waits for their work)."""
    c_set_gil_lending(on)


cdef extern from "packed_conv.h" namespace "fastlazy":
    void c_register_packed_conv "fastlazy::register_packed_conv" () except +


def register_packed_conv():
    """Define the ops fastlazy::packed_conv2d and fastlazy::conv_times
    (csrc/packed_conv.h).  Call
    only where this module was built for the torch imported."""
    c_register_packed_conv()


cdef extern from "ir_reader.h" namespace "fastlazy":
    cdef cppclass string_pair "std::pair<std::string, std::string>":
        string first
        string second
    string_pair c_read_both "fastlazy::read_both" (const string& ir) except +


def read_both(str ir):
    """`ir`'s graph as the executor's reader reads it and as torch's
    parseIR does, printed: (mine, torch's); mine is None where the reader
    left the text to parseIR.  Tests check that the two agree."""
    found = c_read_both(<string>ir.encode())
    mine = found.first.decode()
    return (mine or None), found.second.decode()


cdef class StepProgram:
    """A compiled graph: `program(*inputs)` returns its output (a tensor,
    or a tuple of them) as the TorchScript function made from the same IR
    would."""
    cdef shared_ptr[CStepProgram] program
    cdef readonly str ir

    def __cinit__(self, str ir):
        self.program = make_shared[CStepProgram](<string>ir.encode())
        self.ir = ir

    def __call__(self, *inputs):
        return run_program(self.program.get()[0], inputs)

    @property
    def steps(self):
        """Steps (nodes other than constants) of the graph."""
        return self.program.get().steps()

    @property
    def read_fast(self):
        """Was the IR read by the executor's own reader (csrc/ir_reader.h),
        not by torch's parseIR?"""
        return self.program.get().read_fast()

    @property
    def releases_gil(self):
        """Will the next run let go of the GIL?  Only where the last run
        took at least 100 us (csrc/step_executor.h: RELEASE_GIL_AFTER_NS)."""
        return self.program.get().releases_gil()

    @property
    def direct_steps(self):
        """Steps that call an ATen CPU kernel directly where a run allows."""
        return self.program.get().direct_steps()

    @property
    def calls(self):
        """Steps called over all runs: {"direct": calling the CPU kernel,
        "boxed": through the dispatcher, "reused": of the direct ones, a
        clone or scatter that took over the buffer of an input read for the
        last time, which nothing else could see (csrc/step_executor.h
        sole_owner)}."""
        return {"direct": self.program.get().direct_calls(),
                "boxed": self.program.get().boxed_calls(),
                "reused": self.program.get().reused_buffers()}


cdef extern from "graph_inputs.h" namespace "fastlazy":
    cdef cppclass InputLayout "fastlazy::InputLayout":
        uintptr_t address
    bint read_input_layout(PyObject *obj, InputLayout *layout) noexcept
    bint same_input_layout(PyObject *obj, const InputLayout &want) noexcept


cdef class InputLayouts:
    """InputLayouts(inputs, in_place): what a captured CUDA graph needs of
    a call's inputs (fastlazy/cuda_graphs.py).  `inputs` is the tuple the
    graph was captured for; `in_place`, the positions of the tensors it
    reads where they lay (their addresses must recur), the other tensors
    being copied into its own buffers (their layouts must recur).  A
    position that holds no tensor must hold an equal value of the same
    type: the capture baked it into the graph.  `layouts.matches(inputs)`
    checks a call's inputs in C++; ValueError where a tensor cannot be
    captured (not a dense strided CUDA tensor)."""
    cdef vector[InputLayout] layouts
    cdef vector[Py_ssize_t] positions       # of the tensors, as in layouts
    cdef list others                        # (position, type, value) of the rest
    cdef Py_ssize_t length

    def __cinit__(self, tuple inputs, in_place):
        cdef InputLayout layout
        cdef Py_ssize_t k
        self.length = len(inputs)
        self.others = []
        in_place = frozenset(in_place)
        for k in range(self.length):
            value = inputs[k]
            if not isinstance(value, torch_Tensor):
                self.others.append((k, type(value), value))
                continue
            if not read_input_layout(<PyObject *>value, &layout):
                raise ValueError(f"input {k} is not a dense strided CUDA tensor")
            if k not in in_place:
                layout.address = 0
            self.layouts.push_back(layout)
            self.positions.push_back(k)

    def matches(self, tuple inputs):
        if len(inputs) != self.length:
            return False
        cdef size_t i
        for i in range(self.layouts.size()):
            if not same_input_layout(<PyObject *>inputs[self.positions[i]], self.layouts[i]):
                return False
        for k, kind, value in self.others:
            got = inputs[k]
            if type(got) is not kind or not (got == value):
                return False
        return True


cdef extern from "cpu_pool_scope.h":
    ctypedef struct fl_cpu_pool_scope:
        pass
    const char *FL_CPU_POOL_CAPSULE


cdef extern from "cpu_pool.h" namespace "fastlazy::cpu_pool":
    const fl_cpu_pool_scope scope_functions
    void c_pool_enter "fastlazy::cpu_pool::enter_scope" () except +
    void c_pool_exit "fastlazy::cpu_pool::exit_scope" ()
    bint c_pool_installed "fastlazy::cpu_pool::installed" ()
    bint c_pool_refused "fastlazy::cpu_pool::refused" ()
    void c_pool_set_cap "fastlazy::cpu_pool::set_cap" (size_t) except +
    void c_pool_empty "fastlazy::cpu_pool::empty" () except +
    void c_pool_after_fork "fastlazy::cpu_pool::after_fork" ()
    vector[int64_t] c_pool_stats "fastlazy::cpu_pool::stats" () except +


def cpu_pool_scope():
    """The pool's enter and exit functions (csrc/cpu_pool_scope.h), in a
    capsule for fastlazy._core.set_cpu_pool_scope: the core enters the
    scope around each graph run."""
    return PyCapsule_New(<void *>&scope_functions, FL_CPU_POOL_CAPSULE, NULL)


def cpu_pool_enter():
    """This thread's large CPU allocations come from the pool until the
    matching cpu_pool_exit() (the first scope puts the pool's allocator in
    front of torch's)."""
    c_pool_enter()


def cpu_pool_exit():
    c_pool_exit()


def cpu_pool_installed():
    """Is the pool's allocator in front of torch's?"""
    return c_pool_installed()


def cpu_pool_refused():
    """Did the first scope find that the pool's allocator cannot stand in
    front of torch's (another one installed above torch's priority)?"""
    return c_pool_refused()


def cpu_pool_set_cap(size_t cap):
    """Keep at most `cap` bytes of idle blocks (0: the pool is off)."""
    c_pool_set_cap(cap)


def cpu_pool_empty():
    c_pool_empty()


def cpu_pool_after_fork():
    c_pool_after_fork()


def cpu_pool_stats():
    """The pool's counts (csrc/cpu_pool.h: stats)."""
    cdef vector[int64_t] s = c_pool_stats()
    return dict(zip(("hits", "misses", "returned", "given_back", "idle_bytes", "in_use",
                     "cap"), s))
