"""Builds pmetal.model._qk, the fused quantized matrix-product kernels.

Metadata lives in setup.cfg; this file only adds the C extension.  No
-march=native: the x86-64 SIMD kernels carry their own target attributes and
are chosen at run time, so one build runs on any x86-64 or arm64 machine.
-ffp-contract=off keeps the compiler from fusing a multiply and an add on
its own, so the float operations are exactly the ones the code spells out
(the error bound in docs/kernels.md counts them).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup

CSRC = Path("pmetal") / "model" / "csrc"

compile_args = ["-O3", "-std=c11", "-ffp-contract=off", "-Wall"]
link_args = [] if sys.platform == "darwin" else ["-pthread"]
if sys.platform != "darwin":
    compile_args.append("-pthread")

setup(
    ext_modules=[
        Extension(
            "pmetal.model._qk",
            sources=sorted(str(p) for p in CSRC.glob("*.c")),
            depends=sorted(str(p) for p in CSRC.glob("*.h")),
            include_dirs=[str(CSRC)],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ],
)
