"""Build fastlazy's Cython core.  Set FASTLAZY_DEBUG=1 for an annotated build
with line tracing and bounds checks (slow; for debugging only).

The step executor (fastlazy._executor, C++ against ATen's headers) is built
where torch can be imported while building: `pip install
--no-build-isolation` into an environment that has torch.  pip's default
isolated build has no torch, and fastlazy then runs its graphs on
TorchScript's interpreter instead (fastlazy.step_executor says which).  The
executor holds the version of the torch it was compiled against; another
torch at run time leaves it unused."""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("FASTLAZY_DEBUG") == "1"
directives = {"language_level": 3, "embedsignature": True, "binding": True}
if debug:
    directives.update(boundscheck=True, wraparound=True, linetrace=True)
optimize = ["-O3"] if not debug else ["-O0", "-g"]


def extension(name, **options):
    """fastlazy.<name> from fastlazy/<name>.pyx, with the build's flags."""
    options.setdefault("extra_compile_args", []).extend(optimize)
    options.setdefault("define_macros", []).extend([("CYTHON_TRACE", "1")] if debug else [])
    return Extension(
        f"fastlazy.{name}",
        [f"fastlazy/{name}.pyx"],
        include_dirs=["fastlazy", "fastlazy/csrc", *options.pop("include_dirs", [])],
        **options,
    )


def step_executor():
    """The C++ step executor's extension, or None where torch is not
    importable (an isolated build)."""
    if os.environ.get("FASTLAZY_NO_EXECUTOR") == "1":
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("fastlazy: torch is not importable in this build (pip's isolated build?): "
              "the step executor is not built; graphs run on TorchScript's interpreter. "
              "Build with `pip install --no-build-isolation` to have it.", file=sys.stderr)
        return None
    library_dirs = cpp_extension.library_paths()
    return extension(
        "_executor",
        language="c++",
        # the torch it is compiled against, which fastlazy.step_executor
        # compares with the torch imported before using it
        define_macros=[("FASTLAZY_TORCH_VERSION", f'"{torch.__version__}"')],
        include_dirs=cpp_extension.include_paths(),
        library_dirs=library_dirs,
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        extra_compile_args=["-std=c++20", "-Wno-unused-function",
                            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"],
        extra_link_args=[f"-Wl,-rpath,{d}" for d in library_dirs],
    )


# the core; the native backend's executor and its one-row linear kernel;
# the step executor where it can be built
extensions = [extension("_core"), extension("_steps")]
executor = step_executor()
if executor is not None:
    extensions.append(executor)

modules = cythonize(extensions, compiler_directives=directives, annotate=debug)
for module in modules:
    # a torch whose headers the executor does not compile against (another
    # release's C++ API) costs the executor, not the build (set after
    # cythonize, which does not carry the flag over)
    module.optional = module.name == "fastlazy._executor"
setup(ext_modules=modules)
