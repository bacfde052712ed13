"""The dashboard of a real cluster, rendered in headless Chromium.

Three node daemons on the hosts of a network-namespace lab (tests/cluster/lab.py,
static peers); each serves its dashboard on 127.0.0.1:8265 of its own host.
The browser runs inside host 1's namespace (tests/dashboard/browser.py) and
opens that node's page. Assertions are on the rendered page (the SVG graph
and the cards the page's script drew from what it received), not on the JSON.

Screenshots are kept in the artifacts folder (``$PMETAL_ARTIFACTS`` or
``tests/artifacts/``); docs/images/ holds copies for docs/observability.md.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cluster.lab import formed_cluster, read_line
from netlab import lab_available

from dashboard.browser import attribute, screenshot, text, texts, wait_for

pytestmark = pytest.mark.skipif(lab_available() is not None,
                                reason=lab_available() or "")

URL = "http://127.0.0.1:8265/"
START = 15.0        # s for a node's page to show the whole cluster (its listener opens
                    # after the ready line, then the first snapshot arrives)
DEAD_ON_PAGE = 2.0  # s from SIGKILL to "dead" on the page: issue 21's bound (the failure
                    # detector declares a node dead after health.dead_after, 0.8 s)


# On host 1, as a client of its node: an actor pinned to another machine, whose
# card on host 1's page must list it (the page learns it from that member).
PIN = r"""
import json, sys
import pmetal
from pmetal.util.scheduling_strategies import NodeAffinitySchedulingStrategy
pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")

@pmetal.remote
class Sensor:
    def read(self):
        return 21.5

s = Sensor.options(name="sensor", scheduling_strategy=NodeAffinitySchedulingStrategy(
    node_id=sys.argv[3], soft=False)).remote()
print(json.dumps({"step": "pinned", "value": pmetal.get(s.read.remote(), timeout=30)}),
      flush=True)
sys.stdin.read()
"""


def machines(driver: Any) -> list[dict[str, str]]:
    """The machines the page drew in its topology graph."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#topology g.machine')].map(g => ({"
        "node: g.dataset.node, health: g.dataset.health,"
        "master: g.classList.contains('master'), text: g.textContent}))")


def test_three_machines_their_master_and_a_killed_node_turning_dead(
        tmp_path: Path, browser: Callable[..., Any], record_property: Any) -> None:
    with formed_cluster([1, 2, 3], tmp_path) as c:
        master = c.nodes[1].state["master"]
        ids = {i: c.nodes[i].node_id for i in (1, 2, 3)}
        victim = next(i for i in (2, 3) if ids[i] != master)
        # The driver pins its actor while the browser starts (both take a second or two).
        with c.driver(1, PIN, [c.nodes[1].address, c.psk.hex(), ids[victim]], "pin",
                      stdin=True) as pin:
            driver = browser(netns=c.lab.host(1).name)
            driver.get(URL)

            drawn = wait_for(driver, lambda d: (m := machines(d)) and len(m) == 3
                             and any(x["master"] for x in m) and m, START,
                             "three machines and a master in the graph")
            assert sorted(m["node"] for m in drawn) == sorted(ids.values())
            assert [m["node"] for m in drawn if m["master"]] == [master]
            assert {m["node"]: m["health"] for m in drawn}[ids[1]] == "self"
            # The cards say the same in words, and the summary names the master.
            assert len(texts(driver, "#machine-cards .card")) == 3
            assert "master" in text(driver, f"#machine-cards .card[data-node='{master}']")
            assert text(driver, "#sum-master") == master[:8]
            assert attribute(driver, "#conn", "data-mode") == "live"
            # The link labels (heartbeat latency), for the screenshot.
            wait_for(driver, lambda d: len(d.find_elements(
                "css selector", "#topology .link-label")) >= 2, 5.0, "latencies on the links")

            assert read_line(pin, 60, "pinned")["value"] == 21.5
            card = f"#machine-cards .card[data-node='{ids[victim]}'] .hosted-actors li"
            hosted = wait_for(driver, lambda d: texts(d, card), 10.0,
                              "the pinned actor on its machine's card")
            assert hosted == ["sensor alive"]
            screenshot(driver, "dashboard-cluster", full_page=True)

            killed = time.monotonic()
            c.signal(victim, signal.SIGKILL)
            wait_for(driver, lambda d: {m["node"]: m["health"] for m in machines(d)}
                     .get(ids[victim]) == "dead", DEAD_ON_PAGE,
                     "the killed node dead on the page")
            took = time.monotonic() - killed
            record_property("dead_on_page_seconds", round(took, 3))
            print(f"a SIGKILLed node turned dead on the page after {took:.2f} s")
            card = text(driver, f"#machine-cards .card[data-node='{ids[victim]}']")
            assert "dead" in card and "sensor" not in card   # what it hosted is unknown now
            wait_for(driver, lambda d: d.find_elements(
                "css selector", "#event-log tr[data-kind='death']"), 5.0,
                "a death in the event log")
            death = text(driver, "#event-log tr[data-kind='death']")
            assert ids[victim][:8] in death
            screenshot(driver, "dashboard-dead")
