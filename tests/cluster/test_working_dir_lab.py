"""``runtime_env={"working_dir": ...}`` across machines: two hosts of a
network-namespace lab (tests/netlab.py), one node daemon each, each with a
home of its own (``$PMETAL_HOME``, as two machines have). A driver on host
1 creates an actor on host 2 with a working_dir: host 2 has nothing of the
folder, so its worker pulls the archive from host 1's node over the lab's
network (checked piece by piece and whole against its sha256), unpacks it
in host 2's home and imports a module that only the folder has; an archive
altered in host 1's store after it was packed is refused on arrival. Needs root
(the lab) and skips otherwise."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from netlab import lab_available

from .lab import formed_cluster, read_line

pytestmark = pytest.mark.skipif(lab_available() is not None, reason=lab_available() or "")

HOSTS = [1, 2]

DRIVER = r"""
import json, os, sys
import pmetal

pmetal.init(address=sys.argv[1], psk=bytes.fromhex(sys.argv[2]), namespace="lab")

@pmetal.remote(runtime_env={"working_dir": sys.argv[4]})
class Reader:
    def read(self):
        import lab_wd_module
        return {"mark": lab_wd_module.MARK, "cwd": os.getcwd(),
                "home": os.environ.get("PMETAL_HOME")}

reader = Reader.options(node=sys.argv[3]).remote()
print(json.dumps({"step": "read", **pmetal.get(reader.read.remote(), timeout=60)}), flush=True)

# The same with an archive altered in this machine's store after it was
# packed: host 2 must refuse what it receives.
@pmetal.remote(runtime_env={"working_dir": sys.argv[5]})
class Other:
    def read(self):
        return "ran"

from pmetal.actors import workdir
sha = workdir.publish(sys.argv[5], None, "test")["sha256"]
stored = os.path.join(os.environ["PMETAL_HOME"], "models", sha, "working_dir.zip")
data = bytearray(open(stored, "rb").read())
data[len(data) // 3] ^= 0xFF
os.unlink(stored)
open(stored, "wb").write(bytes(data))
try:
    Other.options(node=sys.argv[3]).remote()
    error = ""
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"step": "altered", "error": error, "sha": sha}), flush=True)
pmetal.shutdown()
"""


def test_a_worker_on_another_machine_pulls_the_working_dir(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    tmp = tmp_path_factory.mktemp("lab")
    folder = tmp / "project"
    folder.mkdir()
    (folder / "lab_wd_module.py").write_text(textwrap.dedent("""
        MARK = "from the driver's folder"
    """))
    other = tmp / "other"
    other.mkdir()
    (other / "payload.bin").write_bytes(bytes(range(256)) * 64)
    with formed_cluster(HOSTS, tmp) as c:
        far = c.nodes[2]
        with c.driver(1, DRIVER, [c.nodes[1].address, c.psk.hex(), far.node_id, str(folder),
                                  str(other)], "driver") as driver:
            got = read_line(driver, 60.0, "read")
            altered = read_line(driver, 60.0, "altered")
        h1, h2 = tmp / "h1", tmp / "h2"
        assert got["mark"] == "from the driver's folder"
        assert got["home"] == str(h2)
        cwd = Path(got["cwd"])
        assert cwd.parent == h2 / "runtime_resources" / "working_dir"
        sha = cwd.name
        # packed on host 1, pulled into host 2's own store, unpacked there
        assert (h1 / "models" / sha / "working_dir.zip").is_file()
        assert (h2 / "models" / sha / "working_dir.zip").is_file()
        assert not (h1 / "runtime_resources" / "working_dir" / sha).exists()
        # an archive altered at the source is refused on arrival, nothing unpacked
        assert "RuntimeEnvSetupError" in altered["error"], altered
        assert "do not match the archive's sha256" in altered["error"], altered
        assert not (h2 / "runtime_resources" / "working_dir" / altered["sha"]).exists()
