"""Builds packcache's one compiled part, the streaming CPU kernels (csrc/kernels.c -> packcache._kernels).

Everything else is in pyproject.toml. The extension is optional: without a C compiler (or on a
non-x86 CPU) the install still succeeds, and packcache runs torch's kernels, saying so
(``packcache.native.status()``, docs/TORCH.md "Compiled kernels").
"""

import platform

from setuptools import Extension, setup

x86 = platform.machine().lower() in ("x86_64", "amd64")

setup(
    ext_modules=[
        Extension(
            "packcache._kernels",
            sources=["csrc/kernels.c"],
            define_macros=[("PC_PYTHON_MODULE", "1")],
            # -O3 and the default ISA: each kernel carries its own target attribute and is chosen at run time.
            # No fused multiply-adds but the ones the code writes: the compiler contracted a row's final scaling
            # in one kernel and not in another, so a sequence's numbers moved with the rows beside it (pinned by
            # tests/test_native.py::test_int8_tiles_of_every_row_count_equal_the_reference).
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off"],
            # libgomp.so.1: at run time the one torch has loaded (packcache.native loads this after torch)
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
    if x86
    else [],
)
