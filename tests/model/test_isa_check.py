"""The vector kernels against the scalar ones, in C, outside Python.

tests/model/isa_check.c is linked with the kernel files only (no Python, no
pool) and compares the build's best table with its scalar table on random
blocks of every format.  It runs natively (AVX2 on x86-64) and, when a cross
compiler and qemu are installed, as an aarch64 binary under qemu-aarch64, for
plain NEON and for NEON with the dot-product extension: the way a Linux
x86-64 machine checks the code Apple Silicon and arm64 servers run.

    apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "pmetal" / "model" / "csrc"
KERNELS = ["qk_common.c", "qk_scalar.c", "qk_avx2.c", "qk_neon.c"]
FLAGS = ["-std=c11", "-ffp-contract=off", "-Wall", "-Werror", f"-I{CSRC}"]
SYSROOT = Path("/usr/aarch64-linux-gnu")


def build(cc: str, out: Path, extra: list[str]) -> Path:
    """Kernels at -O3 as setup.py builds them; the driver at -O1 (gcc 12's
    aarch64 vectoriser crashes on its bound loop at -O3)."""
    out.mkdir(parents=True, exist_ok=True)
    objects = []
    for source in [*(CSRC / k for k in KERNELS), HERE / "isa_check.c"]:
        obj = out / (source.stem + ".o")
        level = "-O1" if source.stem == "isa_check" else "-O3"
        run([cc, level, *FLAGS, *extra, "-c", str(source), "-o", str(obj)])
        objects.append(str(obj))
    binary = out / "isa_check"
    run([cc, *objects, "-lm", "-o", str(binary)])
    return binary


def run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_native_vector_kernels_agree_with_scalar(tmp_path: Path, cc: str) -> None:
    """gcc builds the Linux wheels, clang the macOS ones: both must compile
    the kernels warning-free and agree with scalar."""
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not on PATH")
    out = run([str(build(cc, tmp_path, []))])
    assert out.startswith("ok "), out


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None or shutil.which("qemu-aarch64") is None,
                    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt-get install "
                           "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
@pytest.mark.parametrize("march,isa", [("armv8-a", "neon"), ("armv8.2-a+dotprod", "neon+dotprod")])
def test_neon_kernels_agree_with_scalar_under_qemu(tmp_path: Path, march: str, isa: str) -> None:
    binary = build("aarch64-linux-gnu-gcc", tmp_path, [f"-march={march}"])
    out = run(["qemu-aarch64", "-L", str(SYSROOT), str(binary)])
    assert out.split()[:2] == ["ok", isa], out
