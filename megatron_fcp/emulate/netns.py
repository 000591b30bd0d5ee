"""Bring an emulated cluster up as network namespaces (veth, bridges, ``tc``) and always tear it down.

The layout is Note [Emulated cluster] in :mod:`megatron_fcp.emulate.spec`. :func:`setup_commands`
lists every ``ip``/``tc`` command (pure, tested without root); :class:`EmulatedCluster` runs them and
deletes every namespace of its prefix on exit, on error and on Ctrl-C or SIGTERM (deleting a
namespace deletes its veth ends and their peers, bridges and qdiscs with it).

Shaping (what DESIGN.md section 5 measured to work): each veth end gets an ``htb`` root whose class
1:1 caps the link at its rate; under it a strict-priority class 1:10 takes packets shorter than 128
bytes (TCP ACKs and gloo's control messages never queue behind bulk data of the other direction,
so a link behaves full duplex like NVLink or IB) and the bulk class 1:20 feeds a 16 MB ``bfifo``
(:data:`BULK_LIMIT`: lossless, as those fabrics are).
This kernel has no ``netem``: links add no latency beyond veth's own.

Note [Link bursts]
------------------
NVLink and InfiniBand move a message at their rate whether the link was idle or not; a token bucket
does not: an idle ``htb`` class collects ``burst`` bytes of credit and lets them through at veth
speed, and a class with credit left sends a whole packet however large (veth hands it GSO packets up
to 64 KB). With the probe's ``burst 64kb`` an isolated message after an idle spell crossed a
40 Mbit/s link far faster than the rate (measured on this machine, receiver posted first, median
of 4: 64 KB in 1.0 ms instead of 13.1 ms, 128 KB in 14.7 ms instead of 26.2 ms; a 1 MB message
4.6% fast), while a ring that keeps its links busy got no credit. A schedule of sparse messages (a
wave's re-send, a reduction, an all-to-all) was measured faster than the links allow, and the cost
model looked 15-28% pessimistic there (rail 2x4 GQA ``fcp-auto``: 0.372 s measured, 0.516 s
predicted). Now every class has a 4 KB bucket (:data:`BURST`) and every veth end sends packets of
at most 16 KB (``gso_max_size``, :data:`GSO_MAX_SIZE`): 16 KB takes 3.1 ms (3.3 ms at the rate),
64 KB 13.0 ms, 128 KB 26.2 ms and 1 MB 217.8 ms (1.04x the raw rate: the goodput the model assumes,
1448 payload bytes per 1514), and that GQA run 0.524 s against the same 0.516 s. (8 KB packets
cost the host more: all-to-all-heavy runs took 4-7% longer.)
:func:`~megatron_fcp.emulate.probe.run_probe` measures it at the start of every benchmark run
(``link_probe`` in the JSON; Note [Link probe]).

Note [Quick ACKs]
-----------------
Every route a rank has (the node's /24 over ``eth0``, the rest over ``ib0``; shared: the /16 over
``eth0``) carries ``quickack 1``: TCP acknowledges at once instead of delaying the ACK up to 40 ms
for more data. NVLink and InfiniBand have no delayed ACKs, and with them a rendezvous of small
rounds stalled now and then: on rail 2x4 MHA the staggered stage ring (four rounds of 128 KB per
hop) ran 0.272-0.287 s in 12 of 20 runs and 0.319-0.425 s in 8, one stage's round arriving 60 ms
late (traced per rank: the sender's ``isend`` done, the receiver waiting). With quick ACKs 20 of 20
runs took 0.266-0.285 s and TE's unstaggered a2a+p2p 0.282-0.303 s (before: 0.285-0.320 s).

Namespaces are named ``{prefix}sw``, ``{prefix}n{node}``, ``{prefix}r{node}_{local}``; the prefix of
a run is ``fcpe{pid}x`` (:func:`run_prefix`), so two runs never touch each other's namespaces, and
:func:`remove_stale` deletes the namespaces of runs whose process is gone (a run killed by SIGKILL
cannot clean up after itself).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import Sequence

from megatron_fcp.emulate.spec import ClusterSpec, address_plan, format_rate

__all__ = [
    "EmulatorUnavailable",
    "missing_prerequisites",
    "check_prerequisites",
    "run_prefix",
    "setup_commands",
    "shaping_commands",
    "list_namespaces",
    "remove_stale",
    "EmulatedCluster",
]

BURST = "4kb"
"""Each htb class's token bucket: small, so an idle link sends no faster than its rate (Note [Link
bursts]). 64 KB let a 64 KB message through an idle 40 Mbit/s link in 1.0 ms instead of 13.1 ms."""
GSO_MAX_SIZE = 16384
"""The largest (GSO) packet a veth hands its qdisc, so the most a message gains on an idle bucket
(Note [Link bursts])."""
BULK_LIMIT = "16mb"
"""The bulk class's queue: deep enough that no packet is dropped (NVLink and InfiniBand are lossless,
credit-based). With 2 MB, 16 flows at once through one shared uplink overflowed it: drops, TCP
retransmission timeouts, and ``fcp-full`` on shared-2x4-mha took 6.1-8.3 s where 16 MB gives
4.80-4.94 s (predicted 5.05 s); single-flow links are unchanged (te-p2p 2.29-2.30 s both)."""
SMALL_PACKET = ("0x0000", "0xff80")  # u32 match on the IP total length: < 128 bytes


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot run here; the message says what is missing and how to get it."""


def missing_prerequisites() -> list[str]:
    """What this machine lacks to emulate a cluster (empty: nothing), each with its fix."""
    missing = []
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        missing.append("Linux network namespaces (/proc/self/ns): run on Linux")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        missing.append("root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns`): run as root, e.g. "
                       "`sudo -E megatron-fcp bench --emulate ...`")
    for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` on PATH: install {pkg} (Debian/Ubuntu: apt-get install iproute2)")
    return missing


def check_prerequisites() -> None:
    """Raise :class:`EmulatorUnavailable` naming everything missing (before anything is created)."""
    missing = missing_prerequisites()
    if missing:
        raise EmulatorUnavailable("the emulated cluster needs: " + "; ".join(missing))


def run_prefix(pid: int | None = None) -> str:
    """This process's namespace prefix: ``fcpe{pid}x`` (the ``x`` ends the pid)."""
    return f"fcpe{os.getpid() if pid is None else pid}x"


def shaping_commands(ns: str, dev: str, bits: float) -> list[list[str]]:
    """``tc`` commands that shape the egress of ``dev`` in namespace ``ns`` to ``bits``/s (htb with a
    priority class for small packets; see the module docstring)."""
    kbit = int(round(bits / 1e3))
    rate = format_rate(bits)
    tc = ["tc", "-n", ns]
    cls = ["burst", BURST, "cburst", BURST, "quantum", "65536"]
    return [
        tc + ["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
        tc + ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate] + cls,
        tc + ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate",
              f"{max(kbit // 20, 8)}kbit", "ceil", rate, "prio", "0"] + cls,
        tc + ["class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate",
              f"{kbit - kbit // 20}kbit", "ceil", rate, "prio", "1"] + cls,
        tc + ["qdisc", "add", "dev", dev, "parent", "1:20", "bfifo", "limit", BULK_LIMIT],
        tc + ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "u16",
              *SMALL_PACKET, "at", "2", "flowid", "1:10"],
    ]


def _namespace(ns: str) -> list[list[str]]:
    return [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
             "net.ipv6.conf.default.disable_ipv6=1", "net.ipv4.tcp_slow_start_after_idle=0"]]


def _bridge(ns: str) -> list[list[str]]:
    return [["ip", "-n", ns, "link", "add", "br0", "type", "bridge", "forward_delay", "0", "stp_state", "0"],
            ["ip", "-n", ns, "link", "set", "br0", "up"]]


def _cable(ns_a: str, dev_a: str, ns_b: str, dev_b: str, bits: float) -> list[list[str]]:
    """A veth pair ``ns_a:dev_a`` -- ``ns_b:dev_b`` (``dev_b`` joins ``br0`` of ``ns_b``), both ends shaped."""
    return ([["ip", "-n", ns_b, "link", "add", dev_b, "type", "veth", "peer", "name", dev_a, "netns", ns_a],
             ["ip", "-n", ns_b, "link", "set", dev_b, "master", "br0", "up"],
             ["ip", "-n", ns_a, "link", "set", dev_a, "up"],
             ["ip", "-n", ns_a, "link", "set", dev_a, "gso_max_size", str(GSO_MAX_SIZE)],
             ["ip", "-n", ns_b, "link", "set", dev_b, "gso_max_size", str(GSO_MAX_SIZE)]]
            + shaping_commands(ns_a, dev_a, bits) + shaping_commands(ns_b, dev_b, bits))


def _route(ns: str, prefix: str, dev: str, src: str) -> list[str]:
    """The route to ``prefix`` over ``dev`` with delayed ACKs off (``quickack``): Note [Quick ACKs]."""
    return ["ip", "-n", ns, "route", "replace", prefix, "dev", dev, "src", src, "quickack", "1"]


def setup_commands(spec: ClusterSpec) -> list[list[str]]:
    """Every command that builds ``spec`` (Note [Emulated cluster]), in order."""
    p, spine = spec.prefix, f"{spec.prefix}sw"
    cmds = _namespace(spine) + _bridge(spine)
    for n in range(spec.nodes):
        node = f"{p}n{n}"
        cmds += _namespace(node) + _bridge(node)
        if spec.nic == "shared":
            cmds += _cable(node, "uplink", spine, f"n{n}", spec.inter_bps)
            cmds.append(["ip", "-n", node, "link", "set", "uplink", "master", "br0"])
    for a in address_plan(spec):
        cmds += _namespace(a.netns) + _cable(a.netns, "eth0", f"{p}n{a.node}", f"r{a.local}", spec.intra_bps)
        if spec.nic == "shared":
            cmds.append(["ip", "-n", a.netns, "addr", "add", f"{a.ip}/16", "dev", "eth0"])
            cmds.append(_route(a.netns, f"10.{spec.net}.0.0/16", "eth0", a.ip))
        else:
            cmds.append(["ip", "-n", a.netns, "addr", "add", f"{a.ip}/24", "dev", "eth0"])
            cmds.append(_route(a.netns, f"10.{spec.net}.{a.node}.0/24", "eth0", a.ip))
            cmds += _cable(a.netns, "ib0", spine, f"r{a.node}_{a.local}", spec.inter_bps)
            cmds.append(_route(a.netns, f"10.{spec.net}.0.0/16", "ib0", a.ip))
    return cmds


def list_namespaces(prefix: str = "fcpe") -> list[str]:
    """Names of the existing network namespaces starting with ``prefix``."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def _delete(names: Sequence[str]) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of emulator runs whose process no longer exists; returns their names."""
    stale = []
    for ns in list_namespaces("fcpe"):
        m = re.match(r"fcpe(\d+)x", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            stale.append(ns)
    _delete(stale)
    return stale


def _run_all(cmds: Sequence[Sequence[str]]) -> None:
    for cmd in cmds:
        r = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise EmulatorUnavailable(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}; "
                                      f"is this kernel built with veth, bridge and sch_htb?")


class EmulatedCluster:
    """Context manager: the cluster of ``spec`` exists inside the ``with`` block and never after it.

    ``spec.prefix`` should be this run's own (:func:`run_prefix`). SIGTERM inside the block raises
    SystemExit (so the teardown runs), Ctrl-C raises KeyboardInterrupt as usual; the previous
    handler comes back on exit. ``setup_s`` / ``teardown_s`` record how long each took.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.setup_s = self.teardown_s = 0.0
        self._old_term = None

    @property
    def namespaces(self) -> list[str]:
        return list_namespaces(self.spec.prefix)

    def __enter__(self) -> "EmulatedCluster":
        check_prerequisites()
        remove_stale()
        if self.namespaces:
            raise EmulatorUnavailable(f"namespaces with prefix {self.spec.prefix!r} already exist "
                                      f"({self.namespaces[:3]}...); delete them with `ip netns del NAME`")
        self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        t0 = time.perf_counter()
        try:
            _run_all(setup_commands(self.spec))
        except BaseException:
            self.teardown()
            raise
        self.setup_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Delete every namespace of this cluster (idempotent); restores the SIGTERM handler."""
        t0 = time.perf_counter()
        _delete(self.namespaces)
        self.teardown_s = time.perf_counter() - t0
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    def exec_prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", address_plan(self.spec)[rank].netns]


def _raise_exit(signum, frame) -> None:  # pragma: no cover - signal path
    raise SystemExit(128 + signum)
