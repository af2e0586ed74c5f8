"""The real :class:`~orchestrator.egress.base.Egress`: Linux bridge + nftables + dnsmasq + ulogd2.

Per session (all labelled with the session id):
    * bridge ``dvm<id>`` holding the gateway address ``.1`` of the session's /30,
      IPv6 disabled on it, its alias ``deskvm:<tag>:<id>`` naming the installation;
    * nft objects in the installation's ``inet deskvm_<tag>`` table (created with its
      first session) and a ``bridge deskvm_<tag>_<id>`` table (see :mod:`.plan`), and the
      bridge's entry in the host-wide guard table ``inet deskvm_guard``;
    * ``dnsmasq`` (Debian ``dnsmasq-base``): DHCP for the guest MAC and the allowlisting
      resolver that fills the session's nft sets (``--nftset``);
    * ``ulogd`` (Debian ``ulogd2`` + ``ulogd2-json``) reading the session's NFLOG group and
      writing JSON lines: a maintained NFLOG consumer instead of hand-written netlink code.

Installations. ``<tag>`` is the installation's tag (:func:`.plan.installation_tag` of its
owner, else of its state directory): every installation on the host has its own tables,
state directory and processes, and reaps only its own. What they must share (the /30
slots, which also make session ids and so interface names unique on the host, and the IP
forwarding switch) is kept in :class:`.host.HostRegistry`. ``net.ipv4.ip_forward`` is
switched on only after the guard's forward chain (policy drop) exists, and restored to the
value found before the first session when the last session of the *host* detaches, before
the guard is removed. The host registry's lock serialises attach, detach and reap of every
installation.

Files live in ``settings.state_dir/<id>/``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.egress.base import (
    BRIDGE_PREFIX,
    GUEST_PORT_PREFIX,
    EgressAttachment,
    EgressSettings,
    NetworkDecision,
    bridge_name,
    check_guest_mac,
    guest_port_name,
)
from orchestrator.egress.host import HostRegistry
from orchestrator.egress.logs import DnsLogParser, parse_ulogd_line
from orchestrator.egress.plan import (
    BASE_TABLE,
    GUARD_TABLE,
    SessionPlan,
    dnsmasq_argv,
    guest_mac,
    installation_table,
    installation_tag,
    render_base_ruleset,
    render_guard_join,
    render_guard_leave,
    render_guard_ruleset,
    render_session_ruleset,
    render_session_teardown,
    session_bridge_table,
    slot_addresses,
    ulogd_config,
)
from orchestrator.errors import EgressError
from orchestrator.spec import EgressPolicy, validate_session_id

__all__ = ["NftEgress"]

_SID = r"[a-z0-9]{12}"
_LABELLED_RE = re.compile(rf"^(?:fwd|back|in|post|nat|out_up|out_other|d4|d6)_({_SID})(?:_\w+)?$")


@dataclass
class _Reader:
    dns: DnsLogParser
    clock_offset_ns: int
    """``time.time_ns() - time.monotonic_ns()`` fixed at attach (``clock.json``): log
    times map to the same monotonic times in every process, so decisions read again by a
    restarted server equal the recorded ones."""
    dns_offset: int = 0
    ulogd_offset: int = 0
    decisions: list[NetworkDecision] = field(default_factory=list)


def _clock_offset(state: Path) -> int:
    """The session's wall-to-monotonic offset (written at attach; measured now if absent)."""
    try:
        return int(json.loads((state / "clock.json").read_text())["wall_minus_monotonic_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return time.time_ns() - time.monotonic_ns()


class NftEgress:
    """Egress enforced on this host (needs root, ``nft``, ``ip``, dnsmasq, ulogd).

    Args:
        settings: upstream interface, DNS servers, pool, state dir, host dir.
        owner: which deskvm installation attaches (its sessions directory): its tag names
            the installation's nft tables (without an owner, the state directory's path
            does), and it is written to ``state_dir/<id>/owner``: :meth:`reap` never
            touches a session another installation owns.
    """

    def __init__(self, settings: EgressSettings, *, owner: str = "") -> None:
        self.settings = settings
        self.owner = owner
        self.installation = installation_tag(owner or os.path.abspath(settings.state_dir))
        """This installation's tag (8 hex digits): names its tables."""
        self.table = installation_table(self.installation)
        """This installation's ``inet`` table."""
        self.host = HostRegistry(settings.host_dir)
        self._readers: dict[str, _Reader] = {}
        self._mutex = threading.Lock()

    # ----------------------------------------------------------------- helpers

    def _run(self, argv: list[str], stdin: str | None = None, timeout_s: float = 15.0) -> str:
        try:
            done = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=timeout_s, check=True
            )
        except FileNotFoundError as exc:
            raise EgressError(f"{argv[0]} is not installed: {exc}") from exc
        except subprocess.CalledProcessError as exc:
            raise EgressError(
                f"{' '.join(argv[:4])} failed ({exc.returncode}): {exc.stderr.strip()[:2000]}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise EgressError(f"{' '.join(argv[:4])} timed out after {timeout_s}s") from exc
        return done.stdout

    def _nft(self, script: str) -> None:
        if script.strip():
            self._run(["nft", "-f", "-"], stdin=script)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._mutex, self.host.locked():
            yield

    def _session_dir(self, session_id: str) -> Path:
        return self.settings.state_dir / session_id

    def _host_addresses(self) -> tuple[str, ...]:
        data = json.loads(self._run(["ip", "-j", "addr", "show"]) or "[]")
        found = []
        for link in data:
            if str(link.get("ifname", "")).startswith((BRIDGE_PREFIX, GUEST_PORT_PREFIX)):
                continue
            for info in link.get("addr_info", []):
                local = info.get("local")
                if local and not ipaddress.ip_address(local).is_link_local:
                    found.append(str(local))
        return tuple(sorted(set(found)))

    def _plan(
        self, session_id: str, policy: EgressPolicy, slot: int, mac: str | None = None
    ) -> SessionPlan:
        subnet, gateway, guest = slot_addresses(self.settings.pool, slot)
        return SessionPlan(
            session_id=session_id,
            installation=self.installation,
            bridge=bridge_name(session_id),
            guest_port=guest_port_name(session_id),
            subnet=subnet,
            gateway_ip=gateway,
            guest_ip=guest,
            guest_mac=mac or guest_mac(session_id),
            upstream_iface=self.settings.upstream_iface,
            upstream_dns=self.settings.upstream_dns,
            masquerade=self.settings.masquerade,
            policy=policy,
            host_addresses=self._host_addresses(),
            nflog_group=self.settings.nflog_group_base + slot,
            drop_log_rate_per_s=self.settings.drop_log_rate_per_s,
        )

    def _table_json(self, table: str | None = None) -> list[dict[str, object]]:
        """The objects of an ``inet`` table (default: this installation's); ``[]`` if none."""
        try:
            out = subprocess.run(
                ["nft", "-j", "list", "table", "inet", table or self.table],
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EgressError(f"cannot list nft table: {exc}") from exc
        if out.returncode != 0:
            return []
        items = json.loads(out.stdout).get("nftables", [])
        return [i for i in items if isinstance(i, dict)]

    def _bridge_tables(self) -> list[str]:
        """This installation's ``bridge`` tables (``deskvm_<tag>_<id>``)."""
        out = self._run(["nft", "-j", "list", "tables", "bridge"])
        prefix = session_bridge_table(self.installation, "")
        names = []
        for item in json.loads(out or "{}").get("nftables", []):
            table = item.get("table") if isinstance(item, dict) else None
            if isinstance(table, dict) and str(table.get("name", "")).startswith(prefix):
                names.append(str(table["name"]))
        return names

    def _guarded_bridges(self) -> set[str]:
        """Bridges registered in the host-wide guard table (empty when it does not exist)."""
        found: set[str] = set()
        for item in self._table_json(GUARD_TABLE):
            obj = item.get("set")
            if isinstance(obj, dict) and obj.get("name") == "bridges":
                found |= {e for e in obj.get("elem", []) or [] if isinstance(e, str)}
        return found

    def _ensure_tables(self) -> None:
        self._remove_legacy_table()
        if not self._table_json(GUARD_TABLE):
            self._nft(render_guard_ruleset())
        if not self._table_json():
            self._nft(render_base_ruleset(self.table))

    def _start_ulogd(self, plan: SessionPlan, state: Path) -> None:
        conf = state / "ulogd.conf"
        conf.write_text(ulogd_config(plan, str(self.settings.ulogd_plugin_dir), str(state)))
        (state / "ulogd.json").touch()
        self._run([self.settings.ulogd_path, "-d", "-c", str(conf), "-p", str(state / "ulogd.pid")])
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            groups = Path("/proc/net/netfilter/nfnetlink_log").read_text().split("\n")
            if any(line.split()[:1] == [str(plan.nflog_group)] for line in groups):
                return
            time.sleep(0.01)
        log = (state / "ulogd.log").read_text() if (state / "ulogd.log").exists() else ""
        raise EgressError(f"ulogd did not bind NFLOG group {plan.nflog_group}: {log[-500:]}")

    # -------------------------------------------------------------------- seam

    def attach(
        self, session_id: str, policy: EgressPolicy, *, guest_mac: str | None = None
    ) -> EgressAttachment:
        """See :meth:`orchestrator.egress.base.Egress.attach`."""
        validate_session_id(session_id)
        if guest_mac is not None:
            check_guest_mac(guest_mac)
        with self._locked():
            if self._session_dir(session_id).exists() or session_id in self.host.sessions():
                raise EgressError(f"session {session_id} is already attached")
            try:
                self.host.prune(lambda sid: Path(f"/sys/class/net/{bridge_name(sid)}").exists())
                slot = self.host.claim(self.installation, session_id, self.settings.slot_count)
                plan = self._plan(session_id, policy, slot, guest_mac)
                state = self._session_dir(session_id)
                state.mkdir(mode=0o700)
                (state / "owner").write_text(self.owner)
                self._ensure_tables()
                br = plan.bridge
                self._run(["ip", "link", "add", br, "type", "bridge"])
                alias = f"deskvm:{self.installation}:{session_id}"
                self._run(["ip", "link", "set", br, "alias", alias])
                _harden_bridge(br)
                self._run(["ip", "addr", "add", f"{plan.gateway_ip}/30", "dev", br])
                self._run(["ip", "link", "set", br, "up"])
                self._nft(render_session_ruleset(plan))
                self._start_ulogd(plan, state)
                self._run(dnsmasq_argv(plan, self.settings.dnsmasq_path, str(state)))
                # Only now may the guard let the bridge's traffic through to its chains.
                self._nft(render_guard_join(br))
                self.host.forwarding_on()
                attachment = EgressAttachment(
                    session_id=session_id,
                    bridge=br,
                    guest_port=plan.guest_port,
                    guest_mac=plan.guest_mac,
                    guest_ip=str(plan.guest_ip),
                    gateway_ip=str(plan.gateway_ip),
                    prefix_len=plan.subnet.prefixlen,
                    nflog_group=plan.nflog_group,
                )
                (state / "attachment.json").write_text(json.dumps(attachment_to_json(attachment)))
                offset_ns = time.time_ns() - time.monotonic_ns()
                clock = {"wall_minus_monotonic_ns": offset_ns}
                (state / "clock.json").write_text(json.dumps(clock))
            except BaseException as exc:
                failures = self._teardown(session_id)
                note = f" (cleanup also failed: {'; '.join(failures)})" if failures else ""
                if isinstance(exc, EgressError):
                    raise EgressError(f"attach {session_id}: {exc.message}{note}") from exc
                if isinstance(exc, OSError):
                    raise EgressError(f"attach {session_id}: {exc}{note}") from exc
                raise
        self._readers[session_id] = _Reader(DnsLogParser(session_id), offset_ns)
        return attachment

    def adopt(self, session_id: str, policy: EgressPolicy) -> EgressAttachment:
        """See :meth:`orchestrator.egress.base.Egress.adopt`.

        The bridge and the nft rules live in the kernel and the per-session dnsmasq and
        ulogd are daemons (re-parented to init), so a server killed with SIGKILL leaves
        them running; a service manager that kills the whole service (systemd's
        ``KillMode=control-group``) takes them down with it. Whatever is not running any
        more is started again with the session's configuration (its NFLOG group and lease
        file are the same); the bridge and the rules must still be there. The bridge's
        kernel settings are written again (``arp_ignore``, IPv6 off): a bridge made by an
        older version lacked ``arp_ignore``.

        Raises:
            EgressError: not attached here, owned by another installation, its bridge or
                rules are gone, or a daemon cannot be started.
        """
        validate_session_id(session_id)
        with self._locked():
            state = self._session_dir(session_id)
            try:
                owner = (state / "owner").read_text()
                data = json.loads((state / "attachment.json").read_text())
                attachment = EgressAttachment(**data)
            except (OSError, ValueError, TypeError) as exc:
                raise EgressError(f"session {session_id} is not attached here: {exc}") from exc
            if owner != self.owner:
                raise EgressError(f"session {session_id} belongs to another installation")
            if not Path(f"/sys/class/net/{attachment.bridge}").exists():
                raise EgressError(f"the bridge {attachment.bridge} of {session_id} is gone")
            chains = [item.get("chain") for item in self._table_json()]
            if not any(
                isinstance(chain, dict) and chain.get("name") == f"fwd_{session_id}"
                for chain in chains
            ):
                raise EgressError(f"the nft rules of {session_id} are gone")
            slot = self.host.slot_of(self.installation, session_id)
            if slot is None:
                raise EgressError(f"session {session_id} has no subnet slot")
            plan = self._plan(session_id, policy, slot, attachment.guest_mac)
            try:
                # A bridge made by an older version (or changed since) gets today's settings.
                _harden_bridge(attachment.bridge)
                if not self._daemon_alive(state, "ulogd"):
                    self._start_ulogd(plan, state)
                if not self._daemon_alive(state, "dnsmasq"):
                    self._run(dnsmasq_argv(plan, self.settings.dnsmasq_path, str(state)))
            except OSError as exc:
                raise EgressError(f"adopt {session_id}: {exc}") from exc
        self._readers[session_id] = _Reader(DnsLogParser(session_id), _clock_offset(state))
        return attachment

    def _daemon_alive(self, state: Path, name: str) -> bool:
        """Whether the session's ``name`` daemon (pid file, command line) still runs."""
        try:
            pid = int((state / f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            return False
        cmdline = _cmdline(pid)
        return _alive(pid) and str(state) in cmdline and name in cmdline

    def leased_ip(self, session_id: str) -> str | None:
        """See :meth:`orchestrator.egress.base.Egress.leased_ip`: read from dnsmasq's lease
        file (``<expiry> <mac> <ip> <hostname> <client id>`` per line, rewritten by
        dnsmasq at every change). Only a line with the attachment's MAC *and* guest
        address counts (anything else, e.g. a line read while dnsmasq rewrites the file,
        is no lease)."""
        validate_session_id(session_id)
        state = self._session_dir(session_id)
        try:
            attachment = json.loads((state / "attachment.json").read_text())
            mac, guest_ip = attachment["guest_mac"], attachment["guest_ip"]
            lines = (state / "dnsmasq.leases").read_text().splitlines()
        except FileNotFoundError as exc:
            if not state.is_dir():
                raise EgressError(f"session {session_id} is not attached") from exc
            return None
        except (OSError, ValueError, KeyError) as exc:
            raise EgressError(f"cannot read the leases of {session_id}: {exc}") from exc
        for line in lines:
            fields = line.split()
            if len(fields) >= 3 and fields[1].lower() == mac and fields[2] == guest_ip:
                return guest_ip
        return None

    def detach(self, session_id: str) -> None:
        """See :meth:`orchestrator.egress.base.Egress.detach`."""
        validate_session_id(session_id)
        with self._locked():
            failures = self._teardown(session_id)
        self._readers.pop(session_id, None)
        if failures:
            raise EgressError(f"detach {session_id}: " + "; ".join(failures))

    def _kill(self, state: Path, name: str) -> None:
        pidfile = state / f"{name}.pid"
        pids = set()
        if pidfile.exists():
            with contextlib.suppress(ValueError):
                pids.add(int(pidfile.read_text().strip()))
        pids |= _pids_mentioning(str(state))
        for pid in pids:
            cmdline = _cmdline(pid)
            if str(state) not in cmdline or name not in cmdline:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 2.0
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if _alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _teardown(self, session_id: str) -> list[str]:
        failures: list[str] = []
        state = self._session_dir(session_id)

        def step(name: str, fn: object) -> None:
            try:
                fn()  # type: ignore[operator]
            except (EgressError, OSError, ValueError) as exc:
                failures.append(f"{name}: {exc}")

        step("guard", lambda: self._leave_guard(session_id))
        step("dnsmasq", lambda: self._kill(state, "dnsmasq"))
        step("ulogd", lambda: self._kill(state, "ulogd"))
        step("nft", lambda: self._delete_nft_objects(session_id))
        step("bridge", lambda: self._delete_bridge(session_id))
        step("state", lambda: _rmtree(state))
        step("slot", lambda: self.host.release(self.installation, session_id))
        step("tables", self._maybe_remove_tables)
        return failures

    def _leave_guard(self, session_id: str) -> None:
        bridge = bridge_name(session_id)
        if bridge in self._guarded_bridges():
            self._nft(render_guard_leave(bridge))

    def _delete_nft_objects(self, session_id: str) -> None:
        items = self._table_json()
        chains: list[str] = []
        sets: list[str] = []
        counters: list[str] = []
        elements: list[tuple[str, str]] = []
        for item in items:
            for kind, bucket in (("chain", chains), ("set", sets), ("counter", counters)):
                obj = item.get(kind)
                if isinstance(obj, dict):
                    m = _LABELLED_RE.match(str(obj.get("name", "")))
                    if m and m.group(1) == session_id:
                        bucket.append(str(obj["name"]))
            obj = item.get("map")
            if isinstance(obj, dict):
                for elem in obj.get("elem", []) or []:
                    key, verdict = _map_elem(elem)
                    if key is not None and verdict.endswith("_" + session_id):
                        elements.append((str(obj["name"]), key))
        bridge_table = session_bridge_table(self.installation, session_id)
        self._nft(
            render_session_teardown(
                self.table,
                map_elements=elements,
                chains=chains,
                sets=sets,
                counters=counters,
                bridge_table=bridge_table if bridge_table in self._bridge_tables() else None,
            )
        )

    def _delete_bridge(self, session_id: str) -> None:
        for link in (guest_port_name(session_id), bridge_name(session_id)):
            if Path(f"/sys/class/net/{link}").exists():
                self._run(["ip", "link", "del", link])

    def _maybe_remove_tables(self) -> None:
        """Remove this installation's table after its last session, and the host's guard
        (IP forwarding restored first) after the last session of any installation."""
        if not self.host.sessions(self.installation) and self._table_json():
            self._nft(f"delete table inet {self.table}\n")
        if not self.host.sessions():
            self.host.forwarding_restore()
            if self._table_json(GUARD_TABLE):
                self._nft(f"delete table inet {GUARD_TABLE}\n")

    def decisions(self, session_id: str) -> list[NetworkDecision]:
        """See :meth:`orchestrator.egress.base.Egress.decisions`."""
        validate_session_id(session_id)
        state = self._session_dir(session_id)
        if not state.is_dir():
            raise EgressError(f"session {session_id} is not attached")
        with self._mutex:
            reader = self._readers.get(session_id)
            if reader is None:
                reader = _Reader(DnsLogParser(session_id), _clock_offset(state))
                self._readers[session_id] = reader
            offset_ns = reader.clock_offset_ns
            now_s = time.time()
            try:
                reader.dns_offset, lines = _read_new(state / "dnsmasq.log", reader.dns_offset)
                for line in lines:
                    reader.decisions += reader.dns.feed(line, offset_ns, now_s)
                reader.decisions += reader.dns.flush()
                reader.ulogd_offset, lines = _read_new(state / "ulogd.json", reader.ulogd_offset)
            except OSError as exc:
                raise EgressError(f"cannot read decision logs of {session_id}: {exc}") from exc
            for line in lines:
                decision = parse_ulogd_line(line, session_id, offset_ns)
                if decision is not None:
                    reader.decisions.append(decision)
            return sorted(reader.decisions, key=lambda d: d.ts_ns)

    def counters(self, session_id: str) -> dict[str, int]:
        """Packets that left the host from the session: ``{"upstream": n, "other": n}``.

        ``other`` counts packets from the session's subnet leaving by any interface but the
        upstream and the session bridge (postrouting, after every filter): it must stay 0.

        Raises:
            EgressError: nft could not be queried.
        """
        found = {"upstream": 0, "other": 0}
        for item in self._table_json():
            obj = item.get("counter")
            if isinstance(obj, dict):
                name = str(obj.get("name"))
                if name == f"out_up_{session_id}":
                    found["upstream"] = int(str(obj.get("packets", 0)))
                elif name == f"out_other_{session_id}":
                    found["other"] = int(str(obj.get("packets", 0)))
        return found

    def reap(self, live_session_ids: frozenset[str]) -> list[str]:
        """See :meth:`orchestrator.egress.base.Egress.reap`.

        Sessions whose state directory names another owner (another installation sharing
        ``state_dir``) are left alone; labelled objects without any state are orphans and
        are removed. Runs under the state dir's lock, so an attach in progress is never
        mistaken for a leftover.
        """
        failures = []
        with self._locked():
            found = self.labelled_session_ids()
            dead = sorted(sid for sid in found - set(live_session_ids) if not self._foreign(sid))
            for session_id in dead:
                failures += [f"{session_id}: {f}" for f in self._teardown(session_id)]
                self._readers.pop(session_id, None)
            if not dead:
                with contextlib.suppress(EgressError, OSError):
                    self._maybe_remove_tables()
            with contextlib.suppress(EgressError, OSError):
                self._remove_legacy_table()
        if failures:
            raise EgressError("reap: " + "; ".join(failures))
        return dead

    def _remove_legacy_table(self) -> None:
        """Delete what a deskvm version before per-installation names left on the host, once
        none of its sessions is alive: the ``inet deskvm`` table (its forward and input hooks
        have policy drop, so while it exists it drops every other session's traffic), its
        ``bridge deskvm_<id>`` tables and its ``dvm<id>``/``dvg<id>`` links.

        A legacy session counts as alive while a process other than its own dnsmasq and
        ulogd names its id (its QEMU); those two are orphans once their server died and are
        stopped with the rest. A host left like this by a killed server of an older version
        broke every later session with silent timeouts; now the next attach or reap clears it.

        Raises:
            EgressError: such a table still has a live session (an older deskvm server is
                running on this host: stop it; the two cannot share the host).
        """
        items = self._table_json(BASE_TABLE)
        if not items:
            return
        legacy: set[str] = set()
        for item in items:
            obj = item.get("chain")
            if isinstance(obj, dict):
                m = _LABELLED_RE.match(str(obj.get("name", "")))
                if m:
                    legacy.add(m.group(1))
        daemons = ("dnsmasq", "ulogd")  # its own helpers: orphans once its server died
        alive = sorted(
            sid for sid in legacy if any(_comm(pid) not in daemons for pid in _pids_naming(sid))
        )
        if alive:
            raise EgressError(
                f"an older deskvm installation's table 'inet {BASE_TABLE}' has live sessions "
                f"({', '.join(alive)}); its policy-drop hooks drop every other session's "
                "traffic: stop that server first"
            )
        for session_id in sorted(legacy):
            for pid in _pids_naming(session_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(EgressError, OSError):
                self._nft(f"delete table bridge {BASE_TABLE}_{session_id}\n")
            for link in (guest_port_name(session_id), bridge_name(session_id)):
                alias = Path(f"/sys/class/net/{link}/ifalias")
                with contextlib.suppress(OSError):
                    if re.match(r"deskvm:[0-9a-f]{8}:", alias.read_text()):
                        continue  # a current installation's link (its alias names its tag)
                if Path(f"/sys/class/net/{link}").exists():
                    with contextlib.suppress(EgressError, OSError):
                        self._run(["ip", "link", "del", link])
        self._nft(f"delete table inet {BASE_TABLE}\n")

    def _foreign(self, session_id: str) -> bool:
        try:
            return (self._session_dir(session_id) / "owner").read_text() != self.owner
        except OSError:
            return False

    def labelled_session_ids(self) -> set[str]:
        """Session ids of this installation that label anything on this host: its slots,
        tables, state directory and processes, and bridges whose alias names it.

        Another installation's objects are never listed (they carry its tag).

        Raises:
            EgressError: nft or ip could not be queried.
        """
        found: set[str] = set(self.host.sessions(self.installation))
        link = re.compile(rf"^{BRIDGE_PREFIX}({_SID})$")
        for path in Path("/sys/class/net").iterdir():
            m = link.match(path.name)
            if m:
                with contextlib.suppress(OSError):
                    alias = (path / "ifalias").read_text().strip()
                    if alias == f"deskvm:{self.installation}:{m.group(1)}":
                        found.add(m.group(1))
        for item in self._table_json():
            for kind in ("chain", "set", "counter"):
                obj = item.get(kind)
                if isinstance(obj, dict):
                    m = _LABELLED_RE.match(str(obj.get("name", "")))
                    if m:
                        found.add(m.group(1))
        prefix = session_bridge_table(self.installation, "")
        for name in self._bridge_tables():
            suffix = name[len(prefix) :]
            if re.fullmatch(_SID, suffix):
                found.add(suffix)
        state = self.settings.state_dir
        if state.is_dir():
            found |= {p.name for p in state.iterdir() if re.fullmatch(_SID, p.name)}
            for pid in _pids_mentioning(str(state)):
                m = re.search(rf"{re.escape(str(state))}/({_SID})/", _cmdline(pid))
                if m:
                    found.add(m.group(1))
        return found


def attachment_to_json(attachment: EgressAttachment) -> dict[str, object]:
    """The attachment as a JSON-able dict (written to the session's state dir)."""
    return {
        "session_id": attachment.session_id,
        "bridge": attachment.bridge,
        "guest_port": attachment.guest_port,
        "guest_mac": attachment.guest_mac,
        "guest_ip": attachment.guest_ip,
        "gateway_ip": attachment.gateway_ip,
        "prefix_len": attachment.prefix_len,
        "nflog_group": attachment.nflog_group,
    }


def _map_elem(elem: object) -> tuple[str | None, str]:
    # nft -j renders map elements as [key, {"jump": {"target": "fwd_x"}}]; keys are
    # ifnames (quoted back for nft) or IPv4 addresses.
    if not isinstance(elem, list) or len(elem) != 2:
        return None, ""
    key, verdict = elem
    target = ""
    if isinstance(verdict, dict):
        jump = verdict.get("jump") or verdict.get("goto")
        if isinstance(jump, dict):
            target = str(jump.get("target", ""))
    if isinstance(key, str) and not key[:1].isdigit():
        return f'"{key}"', target
    if isinstance(key, str):
        return key, target
    return None, target


def _harden_bridge(bridge: str) -> None:
    """The session bridge's own kernel settings (at attach, and again at adopt).

    IPv6 off. ARP answers only for the bridge's own address (``arp_ignore=1``): by default
    Linux answers for every local address on every interface, so a guest could probe
    which other sessions' gateways (slots) exist. Reverse-path filtering stays as the host
    has it (off, or loose): the session's nft chains drop every packet from another source
    address and log it as a decision, where strict filtering would drop it unrecorded
    before them.

    Raises:
        OSError: the bridge is gone, or the settings cannot be written.
    """
    Path(f"/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6").write_text("1\n")
    Path(f"/proc/sys/net/ipv4/conf/{bridge}/arp_ignore").write_text("1\n")


def _read_new(path: Path, offset: int) -> tuple[int, list[str]]:
    if not path.exists():
        return offset, []
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read()
    end = data.rfind(b"\n") + 1
    return offset + end, data[:end].decode(errors="replace").splitlines()


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _pids_naming(session_id: str) -> set[int]:
    """Processes whose command line contains ``session_id`` anywhere."""
    return {
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and session_id in _cmdline(int(entry.name))
    }


def _pids_mentioning(text: str) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and text + "/" in _cmdline(int(entry.name)):
            pids.add(int(entry.name))
    return pids


def _rmtree(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir():
            child.rmdir()
        else:
            child.unlink()
    path.rmdir()
