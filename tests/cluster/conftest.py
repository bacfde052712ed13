"""Reports the election simulation's totals (schedules, wall time) at the
end of the run, without ``-s``: the sum of what its tests recorded with
``record_property``."""

from __future__ import annotations

from typing import Any


def pytest_terminal_summary(terminalreporter: Any) -> None:
    totals = {"schedules": 0, "messages": 0, "seconds": 0.0}
    for report in terminalreporter.stats.get("passed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name in totals:
                totals[name] += value
    if totals["schedules"]:
        terminalreporter.write_line(
            f"election simulation: {totals['schedules']} schedules passed, "
            f"{totals['messages']} messages delivered, {totals['seconds']:.1f} s")
