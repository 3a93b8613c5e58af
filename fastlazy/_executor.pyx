# distutils: language = c++
"""The step executor (csrc/step_executor.h): a graph in TorchScript IR run
step by step, ATen's CPU kernels called directly where they can be.  Built
only where torch was importable when fastlazy was built (see
fastlazy/step_executor.py, which loads it)."""
from cpython.object cimport PyObject
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t
from libcpp.memory cimport shared_ptr, make_shared
from libcpp.string cimport string


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
        bint read_fast()
        bint releases_gil()

    object run_program "fastlazy_run" (CStepProgram& program, tuple args) with gil


cdef extern from "packed_conv.h" namespace "fastlazy":
    void c_register_packed_conv "fastlazy::register_packed_conv" () except +


def register_packed_conv():
    """Define the op fastlazy::packed_conv2d (csrc/packed_conv.h).  Call
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
        "boxed": through the dispatcher}."""
        return {"direct": self.program.get().direct_calls(),
                "boxed": self.program.get().boxed_calls()}
