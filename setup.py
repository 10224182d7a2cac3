"""Build the Cython extensions: the numeric kernels (src/mlfabric/kernels/_core.pyx),
the scheduling core's hot loop (src/mlfabric/scheduling/_stf.pyx), the
scatter-gather send of a frame (src/mlfabric/runtime/_sendv.pyx) and the
kernels of compressed updates (src/mlfabric/compression/_kernels.pyx).

-ffp-contract=off keeps the compiler from fusing a*b+c into one FMA, so every
kernel rounds exactly like the numpy expression it is tested against, and the
server and its replica compute bit-identical weights on any x86-64 or arm64
build. No -ffast-math for the same reason.
"""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    Extension(
        "mlfabric.kernels._core",
        ["src/mlfabric/kernels/_core.pyx"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
        # check_gather reads arrays through numpy's C API.
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    # A frame sent straight from many arrays in one sendmsg (runtime.loop).
    Extension(
        "mlfabric.runtime._sendv",
        ["src/mlfabric/runtime/_sendv.pyx"],
        extra_compile_args=["-O3"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    ),
    # Compressed pushes (compression.codecs): error feedback fused with the
    # 16-bit casts, and low rank's product in a fixed order. The same flags:
    # the residual rounds as the numpy reference does, and a server and its
    # replica decode the same bits.
    Extension(
        "mlfabric.compression._kernels",
        ["src/mlfabric/compression/_kernels.pyx"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
    # The scheduling core's hot loop: a port of schedule.py's reference that
    # must take the same floating-point steps, hence the same flags.
    Extension(
        "mlfabric.scheduling._stf",
        ["src/mlfabric/scheduling/_stf.pyx"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
    # The simulator's progressive filling: a port of flownet's numpy
    # reference that must give bit-identical rates, hence the same flags.
    Extension(
        "mlfabric.sim._fill",
        ["src/mlfabric/sim/_fill.pyx"],
        extra_compile_args=["-O3", "-ffp-contract=off"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "initializedcheck": False,
            "cdivision": True,
        },
    )
)
