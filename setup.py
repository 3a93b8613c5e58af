"""Build fastlazy's Cython core.  Set FASTLAZY_DEBUG=1 for an annotated build
with line tracing and bounds checks (slow; for debugging only)."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("FASTLAZY_DEBUG") == "1"
directives = {"language_level": 3, "embedsignature": True, "binding": True}
if debug:
    directives.update(boundscheck=True, wraparound=True, linetrace=True)


def extension(name):
    """fastlazy.<name> from fastlazy/<name>.pyx, with the build's flags."""
    return Extension(
        f"fastlazy.{name}",
        [f"fastlazy/{name}.pyx"],
        include_dirs=["fastlazy", "fastlazy/csrc"],
        extra_compile_args=["-O3"] if not debug else ["-O0", "-g"],
        define_macros=[("CYTHON_TRACE", "1")] if debug else [],
    )


# the core; the native backend's executor and its one-row linear kernel
extensions = [extension("_core"), extension("_steps")]

setup(ext_modules=cythonize(extensions, compiler_directives=directives,
                            annotate=debug))
