"""What this machine has that actors can reserve beyond CPUs and memory.

Only GPUs for now, counted as Ray counts them for ``num_gpus``: Apple
silicon has one (its GPU shares the unified memory); an NVIDIA machine has
one per device its driver lists; anything else has none. The count is read
once when a node starts; ``pmetal.init(resources={"GPU": n})`` overrides it.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess

__all__ = ["gpu_count"]

log = logging.getLogger(__name__)


def gpu_count(proc_root: str = "/proc", system: str | None = None,
              machine: str | None = None) -> int:
    """The number of GPUs of this machine (see the module docstring).

    ``proc_root``, ``system`` and ``machine`` name what is inspected, so a
    test can point them at a folder it built."""
    system = system if system is not None else platform.system()
    machine = machine if machine is not None else platform.machine()
    if system == "Darwin":
        return 1 if machine == "arm64" else 0
    gpus = os.path.join(proc_root, "driver", "nvidia", "gpus")
    try:
        return len([e for e in os.listdir(gpus) if not e.startswith(".")])
    except OSError:   # no NVIDIA driver loaded (the usual case)
        pass
    smi = shutil.which("nvidia-smi") if proc_root == "/proc" else None
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=5,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("nvidia-smi -L failed (%s): counting no GPU", exc)
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))
