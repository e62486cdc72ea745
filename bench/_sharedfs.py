"""Nodes in network namespaces with shaped links, and a shared directory served to them
over that network: the bench's stand-in for an HPC system's network file system.

::

    node 0 ns  (Link, R Mbit/s each way) --+
    node 1 ns  (Link, R)                  --+-- the machine (forwards) -- file server ns
    ...                                     |                            (Link, S Mbit/s)
    node n ns  (Link, R)                  --+                            socat: TCP -> sftp-server
                                                                         serving <export>
    on each node: sshfs -o directport (its TCP in the node's namespace, so on its link)
                  mounted at <mounts>/<i> in the machine's mount namespace

A file a node writes under its mount crosses its link, the machine and the server's
link to the server's directory, and a node reading it fetches it back the same way:
as NFS or Lustre reached over a network. SFTP with no SSH under it (``directport``)
is a file protocol without encryption, as NFS is. The kernel here has no NFS client
(``/proc/filesystems`` lists none and there are no modules to load), so it is FUSE.

Everything is started by :meth:`Cluster.start` and stopped by :meth:`Cluster.close`:
each sshfs unmounted (``fusermount3 -u``) and its process stopped by its pid, the
server's process group (socat and its sftp-servers) ended by its pid, every namespace
removed (``Link.close``). Root only; the programs come from Debian's sshfs, socat and
openssh-sftp-server (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SFTP_SERVER = "/usr/lib/openssh/sftp-server"
PORT = 2049  # NFS's, on the server's own namespace address
NEEDS = {
    "sshfs": "sshfs",
    "socat": "socat",
    "fusermount3": "fuse3",
    SFTP_SERVER: "openssh-sftp-server",
}


class Unavailable(Exception):
    """This machine cannot build the shared file system (what is missing, and why)."""


def missing() -> str | None:
    """Why a shared file system cannot be built here, or None."""
    if os.geteuid() != 0:
        return "not root (network namespaces and FUSE mounts need it)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    with open("/proc/filesystems") as f:
        if "fuse" not in f.read().split():
            return "the kernel has no fuse file system (/proc/filesystems)"
    lacking = [pkg for prog, pkg in NEEDS.items() if not shutil.which(prog)]
    if lacking:
        return f"missing programs: apt-get install {' '.join(sorted(set(lacking)))}"
    return None


@dataclass
class Node:
    """A node: its namespace (``ns``, ``path``), its address there, where it mounts."""

    ns: str
    path: str
    ip: str
    mount: Path


def setns(path: str) -> None:
    """Move the calling thread (and the threads it starts afterwards) into the network
    namespace at ``path``: sockets it makes from now on are on that node's link."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Cluster:
    """``n`` nodes with links of ``rate`` bits/s, a file server with ``server_rate``,
    each node's mount of the server's export. Use as a context manager."""

    def __init__(self, n: int, rate: int, server_rate: int, root: Path) -> None:
        self.n, self.rate, self.server_rate, self.root = n, rate, server_rate, root
        self.links: list[Any] = []
        self.nodes: list[Node] = []
        self.export = root / "export"
        self.server: subprocess.Popen[bytes] | None = None
        self.mounts: list[tuple[Path, subprocess.Popen[bytes]]] = []

    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _link(self, rate: int) -> Any:
        from nimbus.network import Link
        from nimbus.network._slots import claim

        link = Link.create(claim(9100 + len(self.links)), rate)
        self.links.append(link)
        with open(f"/proc/sys/net/ipv4/conf/{link.host_dev}/forwarding", "w") as f:
            f.write("1")  # node to node (and to the server) through the machine
        return link

    def start(self) -> None:
        why = missing()
        if why:
            raise Unavailable(why)
        self.export.mkdir(parents=True, exist_ok=True)
        server = self._link(self.server_rate)
        self.server_ip = server.worker_ip
        # one sftp-server per connection (per node), in the server's namespace and
        # process group (ended as one at close)
        self.server = subprocess.Popen(
            [
                "ip", "netns", "exec", server.ns, "socat",
                f"TCP-LISTEN:{PORT},bind={server.worker_ip},reuseaddr,fork",
                f"EXEC:{SFTP_SERVER} -d {self.export}",
            ],
            start_new_session=True,
        )  # fmt: skip
        self._wait_listening(server.worker_ip)
        for i in range(self.n):
            link = self._link(self.rate)
            mount = self.root / "mnt" / str(i)
            mount.mkdir(parents=True, exist_ok=True)
            node = Node(link.ns, link.netns_path, link.worker_ip, mount)
            self.nodes.append(node)
            proc = subprocess.Popen(
                [
                    "nsenter", f"--net={link.netns_path}",
                    "sshfs", "-f", f"{self.server_ip}:{self.export}", str(mount),
                    "-o", f"directport={PORT},dir_cache=no",
                ],
                start_new_session=True,
            )  # fmt: skip
            self.mounts.append((mount, proc))
            self._wait_mounted(mount, proc)

    def counted(self) -> tuple[int, int]:
        """Bytes the nodes' links and the server's link carried so far (both ways, as
        the machine's ends of the veths count them)."""

        def on(link: Any) -> int:
            stats = Path("/sys/class/net") / link.host_dev / "statistics"
            return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))

        return sum(on(link) for link in self.links[1:]), on(self.links[0]) if self.links else 0

    def _wait_listening(self, ip: str) -> None:
        end = time.monotonic() + 10
        while True:
            assert self.server is not None
            if self.server.poll() is not None:
                raise Unavailable(f"the file server (socat) exited with {self.server.returncode}")
            try:
                socket.create_connection((ip, PORT), timeout=1).close()
                return
            except OSError as exc:
                if time.monotonic() > end:
                    raise Unavailable(
                        f"the file server at {ip}:{PORT} never listened: {exc}"
                    ) from None
                time.sleep(0.05)

    @staticmethod
    def _wait_mounted(mount: Path, proc: subprocess.Popen[bytes]) -> None:
        end = time.monotonic() + 20
        while not os.path.ismount(mount):
            if proc.poll() is not None:
                raise Unavailable(f"sshfs on {mount} exited with {proc.returncode}")
            if time.monotonic() > end:
                raise Unavailable(f"sshfs on {mount}: not mounted within 20 s")
            time.sleep(0.05)

    def close(self) -> None:
        for mount, proc in reversed(self.mounts):
            if os.path.ismount(mount):
                subprocess.run(["fusermount3", "-u", "-z", str(mount)], check=False)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.mounts.clear()
        if self.server is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:  # socat and its sftp-servers: the group the server leads
                    os.killpg(self.server.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.server.wait(10)
                    break
                except subprocess.TimeoutExpired:
                    pass
            self.server.wait()
            self.server = None
        for link in reversed(self.links):
            link.close()
        self.links.clear()
        self.nodes.clear()
