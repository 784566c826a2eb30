"""A bandwidth-limited cluster on one machine: one network namespace per host, on a bridge.

Each host is a network namespace with one veth link to a bridge in a switch namespace. Both
ends of every link are shaped with ``tc tbf`` (the kernel has no netem: bandwidth can be
limited, latency and loss cannot), so every host sends and receives at most ``rate``::

    host0 [msp-h0] ──tbf── [msp-s0] ┐
    host1 [msp-h1] ──tbf── [msp-s1] ┼─ msp-br (switch namespace)
    ...                             ┘

Everything is named with a project prefix: namespaces ``microsparse-<pid>-<n>-host<i>`` and
``…-switch`` (the pid of the process that made them, so stale ones can be told from live
ones), links ``msp-*``. Links are created directly inside those namespaces and addresses
(``10.213.0.0/24``) exist only there, so nothing outside them is ever touched.

:class:`Cluster` is a context manager that removes every namespace it made (and with them
every link, address and qdisc) when the block ends: normally, on an exception, on SIGINT,
SIGTERM or SIGHUP (turned into :class:`Interrupted` while the block runs), and it kills the
processes it started inside the hosts first. Only a SIGKILL of the Python process can leave
namespaces behind: :func:`remove_stale_namespaces` removes those whose creator is gone.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and ``ip`` / ``tc`` from iproute2.

Example:
    >>> with Cluster(hosts=2, rate="1gbit") as cluster:                   # doctest: +SKIP
    ...     worker = cluster.popen(1, ["python", "-c", "print('on host 1')"])
    ...     cluster.run(0, ["ping", "-c", "1", cluster.address(1)])
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

NETNS_PREFIX = "microsparse-"
"""Every namespace this module makes is named ``microsparse-<pid>-<n>-…``."""
LINK_PREFIX = "msp-"
"""Every link this module makes is named ``msp-…`` (at most 15 characters, a kernel limit)."""
SUBNET = "10.213.0"
"""Host i has address ``10.213.0.(i + 1)/24``, inside its namespace only."""
MAX_HOSTS = 250

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_counter = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message names the command and its error."""


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived while a :class:`Cluster` was up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def rate_bits(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``1gbit``, ``100mbit`` or ``500kbit``.

    Example:
        >>> rate_bits("1gbit"), rate_bits("100mbit"), rate_bits("2.5mbit")
        (1000000000.0, 100000000.0, 2500000.0)
    """
    match = _RATE.match(rate.strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(
            f"rate must be a positive number followed by bit, kbit, mbit or gbit "
            f"(e.g. 1gbit, 100mbit), got {rate!r}"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def missing_tools() -> list[str]:
    """The iproute2 commands (``ip``, ``tc``) that are not on ``PATH``."""
    return [tool for tool in ("ip", "tc") if shutil.which(tool) is None]


def unsupported_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, not permitted), or None.

    Tries to create and remove one namespace, so it also catches containers without
    ``CAP_SYS_ADMIN``.
    """
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = missing_tools()
    if missing:
        return f"{' and '.join(missing)} not found (Debian package iproute2)"
    name = f"{NETNS_PREFIX}{os.getpid()}-probe{next(_counter)}"
    try:
        _ip("netns", "add", name)
    except NetnsError as error:
        return f"cannot create a network namespace: {error}"
    try:
        _ip("netns", "del", name)
    except NetnsError:
        pass
    return None


def our_namespaces(prefix: str = NETNS_PREFIX) -> list[str]:
    """Names of existing namespaces that start with ``prefix``.

    Example:
        >>> our_namespaces(f"{NETNS_PREFIX}0-")  # the kernel (pid 0) makes none
        []
    """
    netns_dir = Path("/run/netns")
    if not netns_dir.is_dir():
        return []
    return sorted(entry.name for entry in netns_dir.iterdir() if entry.name.startswith(prefix))


def stale_namespaces() -> list[str]:
    """Our namespaces whose creating process no longer exists (left by a SIGKILL)."""
    stale = []
    for name in our_namespaces():
        pid = name[len(NETNS_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            stale.append(name)
    return stale


def remove_stale_namespaces() -> list[str]:
    """Remove :func:`stale_namespaces` (and the processes still inside them); return them."""
    stale = stale_namespaces()
    for name in stale:
        _kill_processes_in(name)
        _ip("netns", "del", name, check=False)
    return stale


class Cluster:
    """``hosts`` network namespaces on a bridge, every link shaped to ``rate`` both ways.

    Args:
        hosts: number of host namespaces, 1 to 250.
        rate: ``tc`` rate of every link, each direction (``1gbit``, ``100mbit``, …).
        burst: ``tc tbf`` bucket size; must hold at least one (GSO) packet of 64 KiB.
        latency: ``tc tbf`` queueing limit (how long a packet may wait for tokens).

    Use as a context manager; see the module docstring.
    """

    def __init__(
        self, hosts: int, rate: str, *, burst: str = "256kb", latency: str = "20ms"
    ) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {MAX_HOSTS}, got {hosts}")
        rate_bits(rate)
        self.hosts = hosts
        self.rate = rate
        self.burst = burst
        self.latency = latency
        base = f"{NETNS_PREFIX}{os.getpid()}-{next(_counter)}"
        self.switch = f"{base}-switch"
        self.namespaces = [f"{base}-host{i}" for i in range(hosts)]
        self._created: list[str] = []
        self._processes: list[subprocess.Popen[Any]] = []
        self._switch_process: subprocess.Popen[Any] | None = None
        self._previous_handlers: dict[int, Any] = {}
        self.interrupted: int | None = None
        """The signal that interrupted the cluster, if any."""

    def interface(self, host: int) -> str:
        """The host's link, as seen inside its namespace (for ``GLOO_SOCKET_IFNAME``)."""
        return f"{LINK_PREFIX}h{host}"

    def address(self, host: int) -> str:
        """The host's IPv4 address (reachable from the other hosts only)."""
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> Cluster:
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add_namespace(self.switch)
        bridge = f"{LINK_PREFIX}br"
        _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", bridge, "up")
        for host, namespace in enumerate(self.namespaces):
            self._add_namespace(namespace)
            inside, outside = self.interface(host), f"{LINK_PREFIX}s{host}"
            peer = ["peer", "name", outside, "netns", self.switch]
            _ip("-n", namespace, "link", "add", inside, "type", "veth", *peer)
            _ip("-n", self.switch, "link", "set", outside, "master", bridge)
            _ip("-n", self.switch, "link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{self.address(host)}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            self._shape(namespace, inside)  # host -> switch
            self._shape(self.switch, outside)  # switch -> host
        self._switch_process = self._start_in(self.switch, ["sleep", "infinity"])

    def sent(self) -> list[tuple[int, int]]:
        """Bytes and packets each host has sent onto its link so far: what its switch port
        has received (a veth pair counts each packet on both ends alike).

        A plain file read, microseconds, so that a reading lands where it is taken: the
        counters come from ``/proc/<pid>/net/dev`` of a process kept asleep in the switch
        namespace, where starting ``cat`` inside a namespace took tens of milliseconds, long
        enough for a busy host to send a good part of a training step meanwhile.
        """
        if self._switch_process is None:
            raise NetnsError("the cluster is not up: use it inside its `with` block")
        pid, deadline = self._switch_process.pid, time.monotonic() + 10
        ports = {f"{LINK_PREFIX}s{host}": host for host in range(self.hosts)}
        while True:
            counted: dict[int, tuple[int, int]] = {}
            for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]:
                name, _, fields = line.partition(":")
                host = ports.get(name.strip())
                if host is not None:
                    received = fields.split()
                    counted[host] = (int(received[0]), int(received[1]))
            if len(counted) == self.hosts:
                return [counted[host] for host in range(self.hosts)]
            # Not yet inside the namespace: ``ip netns exec`` enters it, then execs ``sleep``.
            if time.monotonic() > deadline or self._switch_process.poll() is not None:
                raise NetnsError(f"could not read the link counters of {self.switch}")
            time.sleep(0.01)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, device: str) -> None:
        tbf = f"tbf rate {self.rate} burst {self.burst} latency {self.latency}".split()
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf])

    def qdisc(self, host: int) -> str:
        """``tc qdisc show`` of the host's link (to check the shaping is in place)."""
        return _run(
            ["tc", "-n", self.namespaces[host], "qdisc", "show", "dev", self.interface(host)]
        )

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the host's namespace; it is killed when the cluster closes.

        Keyword arguments go to :class:`subprocess.Popen`. The process gets its own session
        (a terminal's Ctrl-C reaches only this process, which then stops it) and is killed by
        the kernel if this process dies without cleaning up.
        """
        return self._start_in(self.namespaces[host], argv, **kwargs)

    def _start_in(
        self, namespace: str, argv: Sequence[str], **kwargs: Any
    ) -> subprocess.Popen[Any]:
        process = subprocess.Popen(
            ["ip", "netns", "exec", namespace, *argv],
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        self._processes.append(process)
        return process

    def run(self, host: int, argv: Sequence[str]) -> str:
        """Run ``argv`` inside the host's namespace and return its output; raise if it fails."""
        return _run(["ip", "netns", "exec", self.namespaces[host], *argv])

    def close(self) -> None:
        """Kill what was started inside, delete every namespace made; safe to call twice."""
        # A second Ctrl-C must not cut the clean-up short.
        blocked = {signum: signal.getsignal(signum) for signum in _HANDLED_SIGNALS}
        in_main_thread = threading.current_thread() is threading.main_thread()
        if in_main_thread:
            for signum in _HANDLED_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)
        try:
            for process in self._processes:
                _stop(process)
            self._processes.clear()
            self._switch_process = None
            for name in reversed(self._created):
                _kill_processes_in(name)
                _ip("netns", "del", name, check=False)
            self._created.clear()
        finally:
            if in_main_thread:
                for signum, handler in blocked.items():
                    signal.signal(signum, handler)
                self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; exceptions still clean up

        def interrupt(signum: int, frame: FrameType | None) -> None:
            # A signal that lands in a callback Python runs itself (e.g. logging's after-fork
            # hook while a worker is started) has its exception swallowed: remember it, so that
            # the next raise_if_interrupted() raises it again.
            self.interrupted = signum
            raise Interrupted(signum)

        for signum in _HANDLED_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, interrupt)

    def raise_if_interrupted(self) -> None:
        """Raise the signal that interrupted the cluster, if one did and was swallowed."""
        if self.interrupted is not None:
            raise Interrupted(self.interrupted)

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()


def _stop(process: subprocess.Popen[Any], grace: float = 3.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _kill_processes_in(namespace: str) -> None:
    """Kill what still runs inside our namespace: while a process holds it, deleting its name
    would leave the namespace and its links alive."""
    for _ in range(50):
        output = _ip("netns", "pids", namespace, check=False)
        pids = [int(pid) for pid in output.split() if pid.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec; survives the exec of ``ip netns exec``.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], check: bool = True) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        message = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        raise NetnsError(f"`{' '.join(argv)}` failed: {message}")
    return result.stdout
