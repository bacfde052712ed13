"""A stranger on the LAN: a host without the PSK that reads and forges pmetal
mDNS records with python-zeroconf (tests/cluster/test_forged_mdns.py).

Run on a lab host as ``python stranger.py ADDRESS``; zeroconf is opened on
ADDRESS only. It reads one command a line on stdin and answers each with one
JSON line on stdout:

``copy N SECONDS``
    browse ``_pmetal._tcp.local.`` until N records were seen (or SECONDS
    passed) and print them: ``{"records": [{"name", "id", "ns", "address",
    "txt"}, ...]}``; their TXT is what a forgery copies.
``forge COUNT PORT ID TTL TXT``
    announce COUNT records at ADDRESS:PORT whose TXT is the JSON map TXT (a
    copied record's, with whatever changes) and whose ``id`` is ID
    ("random": a new one each); TTL in seconds for every record ("-":
    zeroconf's). Each record goes out in one packet of its own.
    ``{"forged": COUNT, "names": [...]}``
``register COUNT PORT ID TXT``
    as ``forge``, but registered with zeroconf, which also answers the
    queries of nodes that start later: ``{"registered": COUNT}``
``withdraw``
    goodbye packets (TTL 0) for every record forged or registered so far:
    ``{"withdrawn": N}``
``quit``
    close zeroconf (without goodbyes of its own: it registered nothing).

Killing it with SIGKILL leaves its records in the nodes' caches, as a
crashed or hostile host would.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time

from zeroconf import (
    DNSOutgoing,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
)

SERVICE_TYPE = "_pmetal._tcp.local."
_FLAGS_RESPONSE = 0x8400   # QR + AA


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


class Stranger:
    def __init__(self, address: str) -> None:
        self.address = address
        self.zc = Zeroconf(interfaces=[address], ip_version=IPVersion.V4Only)
        self.forged: list[ServiceInfo] = []
        self.registered: list[ServiceInfo] = []

    def copy(self, count: int, seconds: float) -> list[dict[str, object]]:
        seen: dict[str, dict[str, object]] = {}
        done = threading.Condition()

        def on_change(zeroconf: Zeroconf, service_type: str, name: str,
                      state_change: ServiceStateChange) -> None:
            if state_change is ServiceStateChange.Removed:
                return
            info = zeroconf.get_service_info(service_type, name, timeout=2000)
            if info is None:
                return
            props = info.decoded_properties
            addresses = info.parsed_addresses(IPVersion.V4Only)
            with done:
                seen[name] = {"name": name, "id": props.get("id"), "ns": props.get("ns"),
                              "address": f"tcp://{addresses[0]}:{info.port}" if addresses
                              else "", "txt": props}
                done.notify_all()

        browser = ServiceBrowser(self.zc, SERVICE_TYPE, handlers=[on_change])
        try:
            with done:
                done.wait_for(lambda: len(seen) >= count, seconds)
        finally:
            browser.cancel()
        return list(seen.values())

    def forge(self, count: int, port: int, node_id: str, ttl: int | None,
              template: dict[str, str]) -> list[str]:
        made = self._infos(count, port, node_id, ttl, template)
        self.forged.extend(made)
        self._send(made, None)
        return [i.name for i in made]

    def _infos(self, count: int, port: int, node_id: str, ttl: int | None,
               template: dict[str, str]) -> list[ServiceInfo]:
        made = []
        for _ in range(count):
            claimed = os.urandom(16).hex() if node_id == "random" else node_id
            # Instance names are unique per record: a copy of a live node's
            # name would be a conflict its own responder defends.
            name = f"{os.urandom(16).hex()}.{SERVICE_TYPE}"
            txt = {**template, "id": claimed, "port": str(port)}
            kwargs = {} if ttl is None else {"host_ttl": ttl, "other_ttl": ttl}
            info = ServiceInfo(SERVICE_TYPE, name, addresses=[socket.inet_aton(self.address)],
                               port=port, properties=txt,
                               server=f"s{os.urandom(6).hex()}.local.", **kwargs)
            made.append(info)
        return made

    def register(self, count: int, port: int, node_id: str, template: dict[str, str]) -> int:
        infos = self._infos(count, port, node_id, None, template)

        # All at once: zeroconf's register_service() returns only after its
        # three announcements, 0.46 s a record when done one by one (9 s for
        # 20). Each record is still registered and announced three times.
        async def register_all() -> None:
            announcing = [await self.zc.async_register_service(info, cooperating_responders=True)
                          for info in infos]
            await asyncio.gather(*announcing)

        assert self.zc.loop is not None
        asyncio.run_coroutine_threadsafe(register_all(), self.zc.loop).result(30)
        self.registered.extend(infos)
        return len(infos)

    def withdraw(self) -> int:
        forged, self.forged = self.forged, []
        self._send(forged, 0)
        registered, self.registered = self.registered, []
        for info in registered:
            self.zc.unregister_service(info)
        return len(forged) + len(registered)

    def _send(self, infos: list[ServiceInfo], ttl: int | None) -> None:
        for i, info in enumerate(infos):
            out = DNSOutgoing(_FLAGS_RESPONSE)
            for record in (info.dns_pointer(override_ttl=ttl), info.dns_service(override_ttl=ttl),
                           info.dns_text(override_ttl=ttl),
                           *info.dns_addresses(override_ttl=ttl)):
                out.add_answer_at_time(record, 0)
            self.zc.send(out)
            if i % 10 == 9:
                # Paced (about 1,000 packets/s): a burst of thousands overflows
                # the receivers' socket buffers, and most records never arrive.
                time.sleep(0.01)


def main() -> None:
    if any(k.startswith("PMETAL_PSK") for k in os.environ):
        raise SystemExit("the stranger must run without the PSK in its environment")
    stranger = Stranger(sys.argv[1])
    _say({"ready": stranger.address})
    try:
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "copy":
                _say({"records": stranger.copy(int(words[1]), float(words[2]))})
            elif words[0] == "forge":
                count, port, node_id, ttl, txt = line.split(maxsplit=5)[1:]
                names = stranger.forge(int(count), int(port), node_id,
                                       None if ttl == "-" else int(ttl), json.loads(txt))
                _say({"forged": len(names), "names": names})
            elif words[0] == "register":
                count, port, node_id, txt = line.split(maxsplit=4)[1:]
                _say({"registered": stranger.register(int(count), int(port), node_id,
                                                      json.loads(txt))})
            elif words[0] == "withdraw":
                _say({"withdrawn": stranger.withdraw()})
            elif words[0] == "quit":
                break
            else:
                _say({"error": f"unknown command {words[0]!r}"})
    finally:
        stranger.zc.close()


if __name__ == "__main__":
    main()
