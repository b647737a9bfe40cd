"""The tests' real SSH host (sshd on 127.0.0.1 + one bubblewrap container), for benchmarks."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.host import fixtures, state  # noqa: E402
from tests.host.containers import Container  # noqa: E402
from tests.host.sshd import SshServer  # noqa: E402


@dataclass
class LoopbackHost:
    base: Path  # scratch folder, removed afterwards
    server: SshServer
    container: Container


def problem() -> str | None:
    """Why the test host cannot run here (no root, sshd or bubblewrap), or None."""
    return fixtures.host_problem()


@contextlib.contextmanager
def loopback_host(prefix: str, vmid: int) -> Iterator[LoopbackHost]:
    """Start sshd with the pct/pvesh stand-ins and one running container; tear both down."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    state_dir = base / "state"
    state_dir.mkdir()
    (state_dir / "host.json").write_text(
        json.dumps({"node": fixtures.NODE, "ro_binds": fixtures._read_only_binds()})
    )
    server = SshServer(workdir=base / "ssh", state_dir=state_dir, node=fixtures.NODE)
    server.start()
    try:
        state.create_container(state_dir, vmid)
        container = Container(state_dir, vmid)
        container.start()
        try:
            yield LoopbackHost(base, server, container)
        finally:
            container.destroy()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
