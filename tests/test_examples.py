"""Every script in ``examples/`` runs to completion, as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 60.0
"""Per script; each aims at a few seconds of work."""

EXPECTED = {
    "actors_basics.py": [
        "counter increments: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]",
        "counter via get_actor: 10",
        "squares: [0, 1, 4, 9, 16]",
        "fourth powers: [0, 1, 16, 81, 256]",
        "sum of 0..999999 in four chunks: 499999500000",
        "after 0.1 s: 0 ready, 1 pending",
        "wait collected: ['quick', 'slow']",
        "parameter server: loss",
        "caught ValueError from the actor: ValueError: cannot divide the counter by zero",
        "cluster resources: ['CPU', 'memory']",
    ],
    # Starts two ranks of itself (no --rank, no PMETAL_RANK).
    "train_data_parallel.py": [
        "step    1/300  loss 2.3026",
        "step  300/300  loss 0.07",
        "final loss 0.07",
        "after 300 steps on 2 ranks (softmax, none, numpy",
        "gradient bytes sent: 24,600,000 on the links",
    ],
}


def test_every_example_has_expectations() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    for line in EXPECTED[name]:
        assert line in done.stdout, f"{line!r} missing from:\n{done.stdout}"
