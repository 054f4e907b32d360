"""Network namespaces joined by shaped veth links: build, shape, check, tear down.

Topology (``P`` is the run's prefix, ``tw-<pid>``)::

    P-w0 [eth0 10.77.0.1] --veth-- [w0] \
    P-w1 [eth0 10.77.0.2] --veth-- [w1]  br0   (bridge in namespace P-br)
    ...                                 /

Every link is shaped in both directions with a ``tbf`` qdisc at the same rate:
a worker's ``eth0`` egress (what it sends) and the bridge port's egress
towards it (what it receives). Each worker thus has a full-duplex port of
``rate``, like a host on a switch. Nothing is created in the caller's own
namespace, and only addresses inside these namespaces are used.

With sites (hybrid sharding), a host is a site: namespace ``P-s<i>``, port ``s<i>``,
holding the ranks of site ``i`` (:func:`host_of`), which reach each other over the
namespace's loopback; only the traffic between sites crosses the shaped links.

Commands are built by pure functions (tested without root) and run by
:class:`Topology`, which records what it created so teardown removes exactly that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

PREFIX = "tw-"  # every namespace this harness creates starts with it
SUBNET = "10.77.0"  # /24 inside the namespaces only
WORKER_IF = "eth0"  # the worker's end of its veth, inside its namespace
BRIDGE = "br0"
TBF_BURST_S = 0.001  # tokens saved up while idle: 1 ms of traffic at the link rate
TBF_MIN_BURST = 3028  # ...but at least two full Ethernet frames (1514 bytes each)
TBF_LATENCY_S = 0.1  # the queue holds 100 ms of traffic beyond the burst, then drops


@dataclass(frozen=True)
class Tbf:
    """The token-bucket settings of one link direction (see :func:`tbf_for`)."""

    rate_bps: float  # bits per second
    burst_bytes: int  # bucket size: bytes that may leave back to back at line speed
    limit_bytes: int  # queue length: bytes waiting for tokens before packets are dropped

    def args(self) -> list[str]:
        """The ``tc qdisc ... tbf`` arguments."""
        return ["rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_for(rate_bps: float) -> Tbf:
    """Token bucket for ``rate_bps``: 1 ms burst (>= two frames), 100 ms queue.

    The burst is the error a shaper adds: after an idle pause (the compute
    part of a step) up to ``burst`` bytes leave at veth speed, so a step can
    beat ``bytes / rate`` by at most ~1 ms per direction. Much smaller than
    1 ms and the kernel's timer slack keeps the link below its rate. The
    queue is long enough that the senders' TCP never sees tail drops on the
    ring collectives (each port receives from one peer at a time), and it is
    what ``tbf``'s ``latency`` would set: ``rate x 100 ms + burst``.

    Raises:
        ValueError: ``rate_bps`` is not positive.
    """
    if not rate_bps > 0:
        raise ValueError(f"rate_bps={rate_bps!r} must be > 0")
    burst = max(TBF_MIN_BURST, int(rate_bps / 8 * TBF_BURST_S))
    return Tbf(rate_bps, burst, int(rate_bps / 8 * TBF_LATENCY_S) + burst)


# What a host (a namespace with one shaped port) is: one worker, or one site of workers.
WORKER, SITE = "w", "s"


def names(prefix: str, workers: int, kind: str = WORKER) -> tuple[str, list[str]]:
    """(bridge namespace, host namespaces) for a run with ``prefix`` and ``workers`` hosts
    of ``kind`` (:data:`WORKER` or :data:`SITE`)."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"prefix={prefix!r} must start with {PREFIX!r}")
    if not 1 <= workers <= 250:
        raise ValueError(f"workers={workers!r} must be in [1, 250]")
    return f"{prefix}-br", [f"{prefix}-{port(host, kind)}" for host in range(workers)]


def port(host: int, kind: str = WORKER) -> str:
    """The bridge's end of host ``host``'s veth, inside the bridge namespace."""
    if kind not in (WORKER, SITE):
        raise ValueError(f"kind={kind!r} must be {WORKER!r} (a worker) or {SITE!r} (a site)")
    return f"{kind}{host}"


def address(host: int) -> str:
    """Host ``host``'s address inside its namespace (every rank of a site shares it)."""
    return f"{SUBNET}.{host + 1}"


def host_of(rank: int, world_size: int, sites: int | None = None) -> int:
    """The host whose namespace rank ``rank`` of ``world_size`` runs in.

    Without sites, every rank is a host of its own. With ``sites``, ranks
    ``[s * shards, (s + 1) * shards)`` are site ``s``, as :func:`thinwire.fsdp.site_mesh`
    groups them; a lone rank (``world_size`` 1) runs in site 0.

    Raises:
        ValueError: ``rank`` is not in [0, world_size), or ``sites`` is not in
            [1, world_size] or does not divide ``world_size`` (a lone rank aside).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
    if sites is None:
        return rank
    if world_size == 1:
        return 0
    if not 1 <= sites <= world_size or world_size % sites:
        raise ValueError(f"sites={sites!r} must be in [1, {world_size}] and divide the "
                         f"{world_size} workers")
    return rank // (world_size // sites)


def address_plan(world_size: int, sites: int | None = None) -> list[tuple[str, str]]:
    """Per rank, (namespace suffix, address) of the host it runs in: ``("s0", "10.77.0.1")``."""
    kind = SITE if sites is not None else WORKER
    return [(port(host, kind), address(host)) for host in
            (host_of(rank, world_size, sites) for rank in range(world_size))]


def setup_commands(prefix: str, workers: int, kind: str = WORKER) -> list[list[str]]:
    """The ``ip`` commands that build ``workers`` hosts of ``kind``, in order."""
    bridge_ns, worker_ns = names(prefix, workers, kind)
    commands = [["ip", "netns", "add", bridge_ns],
                ["ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge"],
                ["ip", "-n", bridge_ns, "link", "set", BRIDGE, "up"],
                ["ip", "-n", bridge_ns, "link", "set", "lo", "up"]]
    for rank, ns in enumerate(worker_ns):
        commands += [
            ["ip", "netns", "add", ns],
            # Created inside the worker's namespace with its peer placed straight into
            # the bridge's: no interface ever appears in the caller's namespace.
            ["ip", "-n", ns, "link", "add", WORKER_IF, "type", "veth", "peer", "name",
             port(rank, kind), "netns", bridge_ns],
            ["ip", "-n", bridge_ns, "link", "set", port(rank, kind), "master", BRIDGE],
            ["ip", "-n", bridge_ns, "link", "set", port(rank, kind), "up"],
            ["ip", "-n", ns, "addr", "add", f"{address(rank)}/24", "dev", WORKER_IF],
            ["ip", "-n", ns, "link", "set", WORKER_IF, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return commands


def shape_commands(prefix: str, workers: int, rate_bps: float,
                   kind: str = WORKER) -> list[list[str]]:
    """``tc`` commands that shape both directions of every host's link at ``rate_bps``."""
    bridge_ns, worker_ns = names(prefix, workers, kind)
    tbf = tbf_for(rate_bps).args()
    commands = []
    for rank, ns in enumerate(worker_ns):
        commands.append(["tc", "-n", ns, "qdisc", "replace", "dev", WORKER_IF, "root", "tbf",
                         *tbf])
        commands.append(["tc", "-n", bridge_ns, "qdisc", "replace", "dev", port(rank, kind),
                         "root", "tbf", *tbf])
    return commands


def congestion_control_command(namespace: str) -> list[str]:
    """Reads ``net.ipv4.tcp_congestion_control`` inside ``namespace``."""
    return ["ip", "netns", "exec", namespace, "cat", "/proc/sys/net/ipv4/tcp_congestion_control"]


def teardown_commands(namespaces: Sequence[str]) -> list[list[str]]:
    """Delete ``namespaces`` (workers first; their veths go with them)."""
    return [["ip", "netns", "del", ns] for ns in sorted(namespaces, key=lambda n: n.endswith(
        "-br"))]


def leftovers(listing: str, alive: set[int] | None = None) -> list[str]:
    """Namespaces in ``ip netns list`` output that this harness created.

    With ``alive`` (pids still running), namespaces whose creating process is
    among them are kept: another run is using them.
    """
    found = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX):].split("-")[0]
        if alive is not None and owner.isdigit() and int(owner) in alive:
            continue
        found.append(name)
    return found


def missing_requirements() -> str | None:
    """Why this machine cannot run the harness, or None."""
    if os.geteuid() != 0:
        return ("benchmarks.netem needs root: it creates network namespaces and shapes them "
                "with tc. Run it as root, e.g. sudo .venv/bin/python -m benchmarks.netem")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"benchmarks.netem needs the '{tool}' command (Debian/Ubuntu: iproute2)"
    return None


def run(command: Sequence[str]) -> str:
    """Run one command; raise with its stderr if it fails."""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return done.stdout


@dataclass
class Topology:
    """One bridge and a shaped veth link per host; remove with :meth:`teardown`.

    A host is a worker, or with ``sites`` a site: ``workers`` is then ignored and the
    ranks of each site share its namespace (:func:`host_of`).
    """

    prefix: str
    workers: int
    sites: int | None = None  # hosts are sites, not workers
    created: list[str] = field(default_factory=list)  # namespaces, in creation order

    @property
    def kind(self) -> str:
        return WORKER if self.sites is None else SITE

    @property
    def hosts(self) -> int:
        return self.workers if self.sites is None else self.sites

    def build(self) -> None:
        """Create the namespaces and links; check each namespace's loopback is up."""
        for command in setup_commands(self.prefix, self.hosts, self.kind):
            if command[1:3] == ["netns", "add"]:
                self.created.append(command[3])
            run(command)
        for ns in self.created:
            flags = json.loads(run(["ip", "-n", ns, "-j", "link", "show", "lo"]))[0]["flags"]
            if "UP" not in flags:
                raise RuntimeError(f"loopback in {ns} is not up: {flags}")

    def shape(self, rate_bps: float) -> None:
        for command in shape_commands(self.prefix, self.hosts, rate_bps, self.kind):
            run(command)

    def namespace(self, rank: int, world_size: int = 0) -> str:
        """The namespace of rank ``rank`` of ``world_size`` (without sites: host ``rank``'s).

        Raises:
            ValueError: with sites, ``rank`` or ``world_size`` do not fit (:func:`host_of`).
        """
        if self.sites is None:
            return self.host_namespace(rank)
        return self.host_namespace(host_of(rank, world_size, self.sites))

    def host_namespace(self, host: int) -> str:
        return names(self.prefix, self.hosts, self.kind)[1][host]

    def congestion_control(self) -> str:
        """The TCP congestion control the workers' sockets use (a new namespace takes the
        machine's default)."""
        return run(congestion_control_command(self.host_namespace(0))).strip()

    def qdisc_stats(self) -> dict[str, dict[str, int]]:
        """Sent bytes, drops and overlimits of every shaped link direction."""
        bridge_ns, worker_ns = names(self.prefix, self.hosts, self.kind)
        stats = {}
        for rank, ns in enumerate(worker_ns):
            for where, dev in ((ns, WORKER_IF), (bridge_ns, port(rank, self.kind))):
                entry = json.loads(run(["tc", "-n", where, "-s", "-j", "qdisc", "show", "dev",
                                        dev]))[0]
                stats[f"{where}:{dev}"] = {key: int(entry.get(key, 0))
                                           for key in ("bytes", "drops", "overlimits")}
        return stats

    def loopback_stats(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each host namespace's loopback has carried (a site's own traffic)."""
        stats = {}
        for ns in names(self.prefix, self.hosts, self.kind)[1]:
            entry = json.loads(run(["ip", "-n", ns, "-s", "-j", "link", "show", "lo"]))[0]
            counters = entry.get("stats64", entry.get("stats", {}))
            stats[f"{ns}:lo"] = {"bytes": int(counters["tx"]["bytes"]),
                                 "packets": int(counters["tx"]["packets"])}
        return stats

    def teardown(self) -> list[str]:
        """Stop anything left inside, delete what was created; return error messages."""
        errors = kill_inside(self.created)
        for command in teardown_commands(self.created):
            try:
                run(command)
            except RuntimeError as error:
                errors.append(str(error))
        self.created.clear()
        return errors


def kill_inside(namespaces: Sequence[str]) -> list[str]:
    """SIGKILL the processes still running inside ``namespaces`` (our workers)."""
    errors = []
    for ns in namespaces:
        try:
            pids = [int(p) for p in run(["ip", "netns", "pids", ns]).split()]
        except RuntimeError as error:
            errors.append(str(error))
            continue
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    return errors
