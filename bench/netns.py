"""An emulated cluster on one machine: one network namespace per rank.

    python bench/netns.py --ranks 4 --rate 1gbit [--delay-ms 0.1]   build, iperf3 check, wait for Ctrl-C
    python bench/netns.py --cleanup                                   remove every namespace this tool made

Layout (root needed: CAP_NET_ADMIN and CAP_SYS_ADMIN):

    namespace <tag>-hub : bridge br0 + veth ends h0 .. h{N-1} (all attached to br0)
    namespace <tag>-r<i>: veth end eth0, address 10.77.0.<i+1>/24, lo up

A two-level cluster (``Cluster(M * L, rate, per_node=L)``): one namespace a
node, its L ranks inside it. Ranks of one node reach each other over the
node's loopback (unshaped: the fast link inside a node); other nodes over the
node's shaped veth, whose counters then count exactly the node's inter-node
traffic. Each rank gets ``LIONBIT_NODE=node<m>`` (lionbit.detect_topology).

Each veth end gets, on egress, a token-bucket filter at the link rate (``tc
tbf``) with ``netem`` under it for the delay, on both ends, so a rank's
upload and download are each limited to the link rate: a full-duplex NIC
of that speed behind a non-blocking switch. Segmentation and receive
offloads (TSO, GSO, GRO, ...) are turned off with ethtool on both ends so
that tbf shapes wire-size packets, as on a real link, and the interface
counters count the bytes real frames would carry (TCP/IP headers and ACKs
included; the 14-byte Ethernet header too).

Bytes on the wire: ``/sys/class/net/eth0/statistics/tx_bytes`` read inside
rank i's namespace (``ip netns exec`` mounts that namespace's /sys).

Every namespace is removed when the Cluster closes, at interpreter exit, on
SIGINT/SIGTERM/SIGHUP, and by ``--cleanup`` (all namespaces whose names start
with ``lbb``) after a ``kill -9``.

Without root (or without ``ip``), :func:`can_make_namespaces` says why and
the benchmarks fall back to loopback, saying so in their output.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

PREFIX = "lbb"            # every namespace this tool makes starts with it
SUBNET = "10.77.0"


def _run(*cmd: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def load_estimate():
    """lionbit.estimate (standard library only) from this clone's python/lionbit/estimate.py,
    loaded by its path: the model next to these scripts, with no torch import and whether or
    not the package is installed (an installed copy may be older)."""
    name = "lionbit_estimate"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python", "lionbit",
                            "estimate.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def parse_rate(rate: str) -> int:
    """'1gbit' / '10gbit' / '100mbit' -> bits per second, for tc: lionbit.estimate's parser
    (the one that reads every rate in lionbit), in bits."""
    return round(load_estimate().parse_rate(rate) * 8)


def rate_label(bps: int) -> str:
    return f"{bps / 1e9:g}Gbit" if bps >= 10**9 else f"{bps / 1e6:g}Mbit"


def can_make_namespaces() -> tuple[bool, str]:
    """(True, '') when this process can make network namespaces, else (False, why)."""
    if sys.platform != "linux":
        return False, f"not Linux ({sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' not found (install iproute2)"
    if os.geteuid() != 0:
        return False, "not root (network namespaces, veth and tc need CAP_NET_ADMIN)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"'ip netns add' failed: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return True, ""


def list_ours() -> list[str]:
    r = _run("ip", "netns", "list", check=False, capture=True)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def cleanup_all() -> list[str]:
    """Remove every namespace whose name starts with PREFIX; returns their names."""
    gone = []
    for ns in list_ours():
        # Processes still inside would keep the namespace alive: end them
        # (only processes in our own namespaces).
        pids = _run("ip", "netns", "pids", ns, check=False, capture=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)
        gone.append(ns)
    return gone


class Cluster:
    """N ranks, each in its own namespace, on a shaped bridge. Use as a context manager."""

    _live: list["Cluster"] = []
    _handlers_installed = False

    def __init__(self, ranks: int, rate_bps: int, delay_ms: float = 0.0, tag: Optional[str] = None,
                 per_node: int = 1):
        if per_node < 1 or ranks % per_node:
            raise ValueError(f"cluster: {ranks} ranks do not make nodes of {per_node}")
        self.n = ranks
        self.per_node = per_node            # ranks sharing a namespace (a node)
        self.nodes = ranks // per_node
        self.rate_bps = rate_bps
        self.delay_ms = delay_ms
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        # One namespace a node: its ranks talk over its loopback (unshaped),
        # other nodes over its veth (shaped).
        self.ns = [f"{self.tag}-r{i}" for i in range(self.nodes)]
        self.addr = [f"{SUBNET}.{i + 1}" for i in range(self.nodes)]
        self.ifname = "eth0"
        self.offload_note = ""
        self.delay_note = ""
        self._made: list[str] = []

    # -- set-up ---------------------------------------------------------
    def __enter__(self) -> "Cluster":
        Cluster._install_handlers()
        Cluster._live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, ns: str, *cmd: str, check: bool = True, capture: bool = False):
        return _run("ip", "netns", "exec", ns, *cmd, check=check, capture=capture)

    def _shape(self, ns: str, dev: str) -> None:
        """tbf at the link rate on dev's egress, netem (delay) under it."""
        rate_Bps = self.rate_bps / 8
        # The bucket must hold at least a few MTU-size packets and what the
        # timer can release between ticks; 1 ms of line rate, at least 32 KB.
        burst = max(32 * 1024, int(rate_Bps * 1e-3))
        # Queue limit: 20 ms of line rate (plus a burst) before tbf drops.
        limit = burst + int(rate_Bps * 0.020)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:",
             "tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "limit", str(limit))
        if self.delay_ms > 0:
            r = _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "parent", "1:1",
                     "handle", "10:", "netem", "delay", f"{self.delay_ms}ms", "limit", "100000", check=False)
            if r.returncode != 0:
                # sch_netem is a module some kernels lack: go on without delay, saying so.
                self.delay_note = f"netem unavailable ({r.stderr.strip()}): no added delay"
                self.delay_ms = 0.0

    def _offloads_off(self, ns: str, dev: str) -> None:
        if shutil.which("ethtool") is None:
            self.offload_note = "ethtool missing: segment offloads left on (tbf then shapes 64 KB super-packets)"
            return
        r = self._ns(ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off",
                     "tx-checksum-ip-generic", "on", check=False)
        if r.returncode != 0:
            # Some features cannot be changed on veth; the three that matter can.
            self._ns(ns, "ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", check=False)

    def _build(self) -> None:
        _run("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        self._ns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.hub, "ip", "link", "set", "br0", "up")
        self._ns(self.hub, "ip", "link", "set", "lo", "up")
        for i, ns in enumerate(self.ns):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            hub_end = f"h{i}"
            # Made inside the hub namespace, the rank's end moved straight into
            # its namespace: no name ever lives in the root namespace.
            self._ns(self.hub, "ip", "link", "add", hub_end, "type", "veth",
                     "peer", "name", self.ifname, "netns", ns)
            self._ns(self.hub, "ip", "link", "set", hub_end, "master", "br0")
            self._ns(ns, "ip", "addr", "add", f"{self.addr[i]}/24", "dev", self.ifname)
            self._ns(ns, "ip", "link", "set", "lo", "up")
            for nsx, dev in ((self.hub, hub_end), (ns, self.ifname)):
                self._offloads_off(nsx, dev)
                self._ns(nsx, "ip", "link", "set", dev, "up")
                self._shape(nsx, dev)
        # Wait for the links (and the bridge's forwarding state) to come up.
        deadline = time.time() + 10
        while time.time() < deadline:
            if all(self._connect_ms(0, a) is not None for a in self.addr[1:]):
                return
            time.sleep(0.2)
        raise RuntimeError("cluster: ranks cannot reach each other over the bridge")

    def _connect_ms(self, rank: int, addr: str, tries: int = 1) -> Optional[float]:
        """Median ms of a TCP connect from rank to addr:9 (nothing listens: the
        reset comes back in one round trip), or None when unreachable. No ping
        needed."""
        code = ("import socket,time,statistics,sys\n"
                "ts=[]\n"
                f"for _ in range({tries}):\n"
                " s=socket.socket(); s.settimeout(1.0); t=time.perf_counter()\n"
                f" try: s.connect(('{addr}',9))\n"
                " except ConnectionRefusedError: ts.append(time.perf_counter()-t)\n"
                " except OSError: pass\n"
                " s.close()\n"
                "print(statistics.median(ts)*1e3 if ts else -1)\n")
        r = self._ns(self.ns[rank], sys.executable, "-c", code, check=False, capture=True)
        try:
            v = float(r.stdout.strip())
        except ValueError:
            return None
        return v if v >= 0 else None

    # -- use --------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def env(self, rank: int, port: int = 29500) -> dict:
        """Environment of rank i: rendezvous on rank 0's veth address, no local-size hint,
        and, with nodes of several ranks, LIONBIT_NODE naming the rank's node."""
        e = {k: v for k, v in os.environ.items()
             if k not in ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                          "LIONBIT_NODE", "GROUP_RANK")}
        e.update(MASTER_ADDR=self.addr[0], MASTER_PORT=str(port), RANK=str(rank),
                 WORLD_SIZE=str(self.n), GLOO_SOCKET_IFNAME=self.ifname)
        if self.per_node > 1:
            e["LIONBIT_NODE"] = f"node{self.node_of(rank)}"
        return e

    def popen(self, rank: int, argv: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[self.node_of(rank)], *argv],
                                env=self.env(rank), start_new_session=True, **kw)

    def tx_bytes(self, rank: int) -> int:
        """Bytes rank's namespace sent on its veth (a node's: all its ranks' traffic to other nodes)."""
        r = self._ns(self.ns[self.node_of(rank)], "cat", f"/sys/class/net/{self.ifname}/statistics/tx_bytes",
                     capture=True)
        return int(r.stdout)

    def iperf3(self, seconds: float = 2.0) -> Optional[dict]:
        """Rate rank 1 -> rank 0 measured by iperf3 (TCP), or None when iperf3 is missing."""
        if self.nodes < 2 or shutil.which("iperf3") is None:
            return None
        server = subprocess.Popen(["ip", "netns", "exec", self.ns[0], "iperf3", "-s", "-1", "-p", "5201"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            last = ""
            for _ in range(50):
                r = self._ns(self.ns[1], "iperf3", "-c", self.addr[0], "-p", "5201", "-t", str(seconds),
                             "-J", check=False, capture=True)
                try:
                    end = json.loads(r.stdout)["end"]
                    return {"sent_bps": end["sum_sent"]["bits_per_second"],
                            "received_bps": end["sum_received"]["bits_per_second"],
                            "retransmits": end["sum_sent"].get("retransmits", 0)}
                except (ValueError, KeyError):
                    last = (r.stdout[-300:] + r.stderr[-300:]).strip()
                    time.sleep(0.1)   # server not listening yet
            return {"error": last}
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
            server.wait()

    def rtt_ms(self) -> Optional[float]:
        """Round trip rank 1 -> rank 0 (TCP connect/reset), median of 5."""
        return self._connect_ms(1, self.addr[0], tries=5) if self.nodes > 1 else None

    def describe(self) -> str:
        nodes = (f"{self.nodes} nodes x {self.per_node} ranks, one network namespace a node (its ranks over "
                 f"its loopback, unshaped)" if self.per_node > 1 else f"{self.n} network namespaces")
        return (f"{nodes} ({self.tag}-r*), veth into bridge br0 in {self.tag}-hub, "
                f"tbf {rate_label(self.rate_bps)} + {self.delay_ms:g} ms netem delay on both ends, "
                f"TSO/GSO/GRO off{' (' + self.offload_note + ')' if self.offload_note else ''}"
                f"{'; ' + self.delay_note if self.delay_note else ''}")

    # -- tear-down --------------------------------------------------------
    def close(self) -> None:
        for ns in reversed(self._made):
            pids = _run("ip", "netns", "pids", ns, check=False, capture=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()
        if self in Cluster._live:
            Cluster._live.remove(self)

    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed:
            return
        cls._handlers_installed = True

        def close_all() -> None:
            for c in list(cls._live):
                c.close()

        atexit.register(close_all)

        def on_signal(signum, frame):
            close_all()
            # Exit with the conventional status; atexit handlers run too.
            sys.exit(128 + signum)

        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, on_signal)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--cleanup", action="store_true", help="remove every namespace named lbb* and exit")
    p.add_argument("--check", action="store_true", help="build, print the iperf3 rate, tear down")
    a = p.parse_args()
    if a.cleanup:
        gone = cleanup_all()
        print(f"netns: removed {len(gone)} namespace(s){': ' + ' '.join(gone) if gone else ''}")
        return
    ok, why = can_make_namespaces()
    if not ok:
        print(f"netns: cannot make namespaces: {why}")
        sys.exit(2)
    with Cluster(a.ranks, parse_rate(a.rate), a.delay_ms) as c:
        print(f"netns: {c.describe()}")
        print(f"netns: rank1 -> rank0 round trip (TCP connect) {c.rtt_ms():.3f} ms")
        ip = c.iperf3()
        if ip and "sent_bps" in ip:
            print(f"netns: iperf3 rank1 -> rank0: {ip['received_bps'] / 1e9:.3f} Gbit/s received "
                  f"(link {rate_label(c.rate_bps)}; {ip['retransmits']} retransmits)")
        else:
            print(f"netns: iperf3: {ip}")
        if not a.check:
            print("netns: up; Ctrl-C tears it down")
            signal.pause()


if __name__ == "__main__":
    main()
