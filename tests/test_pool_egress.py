"""Warm starts with egress against the fake hypervisor and the fake egress: the egress
target's template, the claim (restore onto the session's own network, link down and up,
lease), the fallbacks to a cold boot, and what is left behind (nothing)."""

from __future__ import annotations

import json
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import pytest

from orchestrator.clock import FakeClock
from orchestrator.egress.base import EgressSettings, check_guest_mac
from orchestrator.egress.fake import FakeEgress
from orchestrator.egress.nftables import NftEgress
from orchestrator.errors import ConfigError, HypervisorError
from orchestrator.hypervisor.base import LIVE_CPU_WEIGHT, NicAttachment, SessionPaths
from orchestrator.hypervisor.domain_xml import clone_domain_xml, render_domain_xml, saved_nic_mac
from orchestrator.hypervisor.fake import FakeHypervisor
from orchestrator.manager import SessionManager
from orchestrator.pool import PoolKey, PoolTarget, WarmPool, parse_warm_pool
from orchestrator.settings import read_serve_config
from orchestrator.spec import BootImage, DisplaySpec, EgressPolicy, SessionSpec

IMAGE = BootImage("debian12-desktop", "cd" * 32, Path("/b"), Path("/k"), Path("/i"))
POLICY_A = EgressPolicy(allow=("allowed.test",))
POLICY_B = EgressPolicy(allow=("198.51.100.7/32:443",))


def manager(tmp_path: Path, hv: FakeHypervisor, egress: FakeEgress, **kw) -> SessionManager:
    m = SessionManager(
        hypervisor=hv,
        resolve_image=lambda _name: IMAGE,
        recordings_dir=tmp_path / "rec",
        ready_poll_s=0.01,
        egress=egress,
        warm_pool=kw.pop("warm_pool", (PoolTarget("debian12-desktop", 1, egress=True),)),
        pool_dir=tmp_path / "pool" / "serve-1",
        **kw,
    )
    assert m.pool is not None
    m.pool._interval_s = 0.05
    m.pool._ready_poll_s = 0.01
    return m


def create(m: SessionManager, **kw):
    return m.create(image="debian12-desktop", display=kw.pop("display", DisplaySpec()), **kw)


def events(session, kind: str) -> list[dict]:
    lines = (Path(session.recorder.path) / "events.jsonl").read_text().splitlines()
    return [e["data"] for e in map(json.loads, lines) if e["kind"] == kind]


def test_parse_egress_targets(tmp_path: Path) -> None:
    assert parse_warm_pool("debian12-desktop:2,debian12-desktop:egress") == (
        PoolTarget("debian12-desktop", 2),
        PoolTarget("debian12-desktop", 1, egress=True),
    )
    for bad in ("x:egress,x:egress", "x:Egress", "x:net"):
        with pytest.raises(ConfigError):
            parse_warm_pool(bad)
    with pytest.raises(ConfigError, match="must be 1"):
        PoolTarget("x", 2, egress=True)
    config = tmp_path / "serve.toml"
    config.write_text('[[warm_pool]]\nimage = "x"\nsize = 1\negress = true\n')
    assert read_serve_config(config, env={}).settings["warm_pool"] == (
        PoolTarget("x", 1, egress=True),
    )
    config.write_text('[[warm_pool]]\nimage = "x"\nsize = 1\negress = "yes"\n')
    with pytest.raises(ConfigError, match=r"warm_pool\[0\]\.egress: must be a boolean"):
        read_serve_config(config, env={})


def test_an_egress_target_needs_an_egress_seam(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs egress"):
        WarmPool(
            (PoolTarget("x", 1, egress=True),),
            hypervisor=FakeHypervisor(),
            resolve_image=lambda _n: IMAGE,
            pool_dir=tmp_path,
            new_id=lambda: "abcdefabcdef",
        )


def test_two_warm_egress_sessions_each_on_their_own_network(tmp_path: Path) -> None:
    hv, egress = FakeHypervisor(), FakeEgress()
    m = manager(tmp_path, hv, egress)
    m.start_pool()
    try:
        assert m.pool is not None and m.pool.wait_full(5)
        (status,) = m.pool.status()
        assert status["egress"] and status["ready"] == 1 and status["phase"] == "full"
        # The template booted with a NIC on a deny-all network of its own, then let it go.
        (template,) = hv.saved
        assert egress.detached == [template]
        assert hv.restored == []  # nothing restored ahead: each claim restores
        a = create(m, egress=POLICY_A)
        b = create(m, egress=POLICY_B)
        for session, policy in ((a, POLICY_A), (b, POLICY_B)):
            assert session.start_kind == "warm", session.start_phases_s
            assert set(session.start_phases_s) == {
                "claim_s", "egress_s", "restore_s", "clock_s", "link_s", "lease_s", "ready_s",
            }  # fmt: skip
            domain = hv.domains[session.id]
            attachment = session.egress_attachment
            assert attachment is not None and egress._sessions[session.id][1] == policy
            assert domain.restored_from is not None and not domain.paused
            assert domain.nic == NicAttachment(f"dvm{session.id}", attachment.guest_mac,
                                               f"dvg{session.id}")  # fmt: skip
            assert domain.links == [False, True]
            assert domain.clock_set == 1 and domain.cpu_weight == LIVE_CPU_WEIGHT
            leased = [e for e in events(session, "network") if e.get("event") == "leased"]
            assert leased == [{"event": "leased", "guest_ip": attachment.guest_ip}]
        # One MAC (the template's, kept by the restore), two bridges and subnets.
        assert a.egress_attachment.guest_mac == b.egress_attachment.guest_mac  # type: ignore[union-attr]
        assert a.egress_attachment.bridge != b.egress_attachment.bridge  # type: ignore[union-attr]
        assert a.egress_attachment.guest_ip != b.egress_attachment.guest_ip  # type: ignore[union-attr]
        # Each sees only its own decisions.
        egress.zone = {"allowed.test": ("203.0.113.10",)}
        assert egress.resolve(a.id, "allowed.test") == ("203.0.113.10",)
        assert egress.resolve(b.id, "allowed.test") == ()
        assert {d.query for d in egress.decisions(a.id)} == {"allowed.test"}
        assert [d.kind for d in egress.decisions(b.id)] == ["dns_refused"]
        # Its reset is refused (not supported yet), the session stays.
        with pytest.raises(ConfigError) as refused:
            m.reset(a.id)
        assert refused.value.code == "reset_unavailable" and a.state == "ready"
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}
    assert not (tmp_path / "pool" / "serve-1").exists()


def test_sessions_match_targets_by_network(tmp_path: Path) -> None:
    hv, egress = FakeHypervisor(), FakeEgress()
    targets = (PoolTarget("debian12-desktop", 1), PoolTarget("debian12-desktop", 1, egress=True))
    m = manager(tmp_path, hv, egress, warm_pool=targets)
    m.start_pool()
    try:
        assert m.pool is not None and m.pool.wait_full(5)
        plain = create(m)
        networked = create(m, egress=POLICY_A)
        assert plain.start_kind == "warm" and hv.domains[plain.id].nic is None
        assert networked.start_kind == "warm" and hv.domains[networked.id].nic is not None
        # A session asking for something the pool does not keep boots cold.
        other = create(m, egress=POLICY_A, display=DisplaySpec(1024, 768))
        assert other.start_kind == "cold" and "domain_start_s" in other.start_phases_s
        key = PoolKey.of(IMAGE, DisplaySpec(), 2048, 2, network=False)
        assert m.pool.claim_state(key) is None  # the plain target keeps no saved state out
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}


def test_an_empty_pool_boots_cold(tmp_path: Path) -> None:
    hv, egress = FakeHypervisor(), FakeEgress()
    m = manager(tmp_path, hv, egress)  # the pool is never started: nothing saved
    session = create(m, egress=POLICY_A)
    assert session.start_kind == "cold" and hv.restored == []
    assert session.egress_attachment is not None
    # A cold start keeps the session's own MAC.
    assert session.egress_attachment.guest_mac != ""
    m.close_all()
    assert hv.domains == {} and egress._sessions == {}


@pytest.mark.parametrize("fault", ["restore", "lease"])
def test_a_failed_warm_start_boots_cold_on_the_same_network(tmp_path: Path, fault: str) -> None:
    hv, egress = FakeHypervisor(), FakeEgress()
    m = manager(tmp_path, hv, egress, clock=FakeClock())
    m.start_pool()
    try:
        assert m.pool is not None and m.pool.wait_full(5)
        if fault == "restore":
            hv.fail_on.add("restore")
        else:
            egress.auto_lease = False  # the restored guest never takes its lease
        session = create(m, egress=POLICY_A)
        assert session.start_kind == "cold" and session.state == "ready"
        (failed,) = [e for e in events(session, "lifecycle") if e["event"] == "warm_failed"]
        assert ("injected failure" if fault == "restore" else "no DHCP lease") in failed["error"]
        assert session.id in hv.started  # booted cold, on its one attachment
        assert list(egress._sessions) == [session.id]
        assert hv.domains[session.id].restored_from is None
        if fault == "lease":
            assert session.id in hv.destroyed  # the restored domain went first
        # The pool keeps its saved desktop for the next claim.
        assert m.pool.status()[0]["ready"] == 1
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}


def test_a_failed_template_leaves_nothing(tmp_path: Path) -> None:
    hv, egress = FakeHypervisor(), FakeEgress()
    hv.fail_on.add("save")
    m = manager(tmp_path, hv, egress)
    m.start_pool()
    try:
        assert m.pool is not None
        for _ in range(200):
            if m.pool.status()[0]["phase"] == "failed":
                break
            time.sleep(0.01)
        assert m.pool.status()[0]["phase"] == "failed"
        assert egress._sessions == {} and len(egress.detached) == 1
        session = create(m, egress=POLICY_A)
        assert session.start_kind == "cold"
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}


def test_restore_checks_the_saved_nic(tmp_path: Path) -> None:
    hv = FakeHypervisor()
    spec = SessionSpec(session_id="tmpl00000000", image=IMAGE)
    nic = NicAttachment("dvmtmpl00000000", "52:54:00:aa:bb:cc", "dvgtmpl00000000")
    hv.start(spec, nic=nic)
    state = hv.save(spec.session_id, tmp_path / "state")
    clone = SessionSpec(session_id="clone0000000", image=IMAGE)
    with pytest.raises(HypervisorError, match="MAC"):
        hv.restore(clone, state)  # a state with a NIC needs the session's network
    with pytest.raises(HypervisorError, match="MAC"):
        hv.restore(clone, state, nic=NicAttachment("dvmclone0000000", "52:54:00:00:00:01"))
    with pytest.raises(HypervisorError, match="NIC"):
        hv.reset(clone, state)
    mine = NicAttachment("dvmclone0000000", nic.mac, "dvgclone0000000")
    assert hv.restore(clone, state, nic=mine).nic == mine


def test_clone_xml_plugs_the_saved_nic_into_the_session_bridge(tmp_path: Path) -> None:
    spec = SessionSpec(session_id="tmpl00000000", image=IMAGE)
    nic = NicAttachment("dvmtmpl00000000", "52:54:00:aa:bb:cc", "dvgtmpl00000000")
    paths = SessionPaths.under(tmp_path, spec.session_id)
    created = datetime(2026, 1, 1, tzinfo=UTC)
    saved = render_domain_xml(spec, paths, accel="tcg", created=created, nic=nic)
    assert saved_nic_mac(saved) == nic.mac
    clone_paths = SessionPaths.under(tmp_path, "clone0000000")
    kw = dict(session_id="clone0000000", paths=clone_paths, created=created, owner="o",
              uuid="u", genid="g")  # fmt: skip
    mine = NicAttachment("dvmclone0000000", nic.mac, "dvgclone0000000")
    xml = clone_domain_xml(saved, nic=mine, **kw)  # type: ignore[arg-type]
    (iface,) = ET.fromstring(xml).findall("devices/interface")
    assert iface.find("source").get("bridge") == "dvmclone0000000"  # type: ignore[union-attr]
    assert iface.find("target").get("dev") == "dvgclone0000000"  # type: ignore[union-attr]
    assert iface.find("mac").get("address") == nic.mac  # type: ignore[union-attr]
    assert "dvmtmpl" not in xml and "dvgtmpl" not in xml
    with pytest.raises(ValueError, match="needs a network attachment"):
        clone_domain_xml(saved, **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MAC"):
        other = NicAttachment("dvmclone0000000", "52:54:00:00:00:01", "dvgclone0000000")
        clone_domain_xml(saved, nic=other, **kw)  # type: ignore[arg-type]
    bare = render_domain_xml(spec, paths, accel="tcg", created=created)
    assert saved_nic_mac(bare) is None
    with pytest.raises(ValueError, match="no NIC"):
        clone_domain_xml(bare, nic=mine, **kw)  # type: ignore[arg-type]


def test_guest_mac_checks_and_the_fake_takes_it() -> None:
    assert check_guest_mac("52:54:00:aa:bb:cc") == "52:54:00:aa:bb:cc"
    for bad in ("52:54:00:AA:BB:CC", "01:00:5e:00:00:01", "52:54:00:aa:bb", "x"):
        with pytest.raises(ConfigError):
            check_guest_mac(bad)
    egress = FakeEgress()
    a = egress.attach("abcdefabcdef", POLICY_A, guest_mac="52:54:00:aa:bb:cc")
    assert a.guest_mac == "52:54:00:aa:bb:cc"
    with pytest.raises(ConfigError):
        egress.attach("abcdefabcde2", POLICY_A, guest_mac="ff:ff:ff:ff:ff:ff")


def test_nft_egress_reads_the_lease_of_the_guest_mac(tmp_path: Path) -> None:
    settings = EgressSettings(upstream_iface="eth9", upstream_dns=("192.0.2.53",),
                              state_dir=tmp_path, host_dir=tmp_path / "host")  # fmt: skip
    egress = NftEgress(settings)
    sid = "abcdefabcdef"
    with pytest.raises(Exception, match="not attached"):
        egress.leased_ip(sid)
    (tmp_path / sid).mkdir()
    attachment = {"guest_mac": "52:54:00:aa:bb:cc", "guest_ip": "10.213.0.6"}
    (tmp_path / sid / "attachment.json").write_text(json.dumps(attachment))
    assert egress.leased_ip(sid) is None  # no lease file yet
    leases = tmp_path / sid / "dnsmasq.leases"
    leases.write_text("1796000000 52:54:00:00:00:01 10.213.0.9 other *\n")
    assert egress.leased_ip(sid) is None  # another MAC's lease does not count
    leases.write_text("1796000000 52:54:00:aa:bb:cc 10.213.0.6 debian *\n")
    assert egress.leased_ip(sid) == "10.213.0.6"
    # A line torn by dnsmasq's rewrite, or another address: no lease (the address is
    # written to the recording as the guest's).
    for torn in (
        "1796000000 52:54:00:aa:bb:cc 10.213.0.",
        "1796000000 52:54:00:aa:bb:cc 10.213.0.9",
    ):
        leases.write_text(torn + "\n")
        assert egress.leased_ip(sid) is None, torn


def test_a_warm_egress_session_keeps_its_own_start_state(tmp_path: Path) -> None:
    """The clone restores from the session's own hard links to the saved state, so its
    overlay never backs onto the pool's files: the pool may drop them (image changed,
    template rebuilt in place, server stopping) under a live session."""
    sessions = tmp_path / "sessions"
    hv, egress = FakeHypervisor(sessions_dir=sessions), FakeEgress()
    m = manager(tmp_path, hv, egress)
    m.start_pool()
    try:
        assert m.pool is not None and m.pool.wait_full(5)
        session = create(m, egress=POLICY_A)
        assert session.start_kind == "warm"
        kept = sessions / session.id / "start" / "state.save"
        assert hv.domains[session.id].restored_from == kept
        m.close_pool()  # the pool's files go (as at a rebuild of the template)
        assert not (tmp_path / "pool" / "serve-1").exists()
        assert kept.is_file() and session.state == "ready"
        m.delete(session.id)
        assert not (sessions / session.id).exists()
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}


def _block(hv: FakeHypervisor, step: str, *, fail: bool = False):
    """Make ``hv.<step>`` wait for ``go`` (set by the test) once it was called (``entered``);
    with ``fail`` it then raises instead of doing its work."""
    import threading

    entered, go = threading.Event(), threading.Event()
    real = getattr(hv, step)

    def blocked(*args, **kw):
        entered.set()
        assert go.wait(10)
        if fail:
            raise HypervisorError(f"injected failure in {step}")
        return real(*args, **kw)

    setattr(hv, step, blocked)
    return entered, go


@pytest.mark.parametrize(
    ("step", "fail"), [("restore", False), ("restore", True), ("start", False)]
)
def test_a_close_during_the_start_leaves_nothing(tmp_path: Path, step: str, fail: bool) -> None:
    """A session closed (DELETE, TTL) while its warm egress restore (which then succeeds,
    or fails) or its cold boot runs, its network's detach still under way: what the step
    makes after close's teardown destroyed the domain is destroyed too, and a closed
    session never falls back to a cold boot (before: the restored or booted domain stayed
    running, with no network, until the next sweep reaped it)."""
    import threading

    from orchestrator.errors import SessionClosed

    hv, egress = FakeHypervisor(sessions_dir=tmp_path / "sessions"), FakeEgress()
    m = manager(tmp_path, hv, egress)
    if step == "restore":
        m.start_pool()
        assert m.pool is not None and m.pool.wait_full(5)
    entered, go = _block(hv, step, fail=fail)
    started: list = []
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            create(m, egress=POLICY_A, on_started=started.append)
            outcome.append(None)
        except BaseException as exc:  # the test looks at it
            outcome.append(exc)

    creating = threading.Thread(target=run)
    detaching = threading.Event()
    real_detach = egress.detach

    def slow_detach(session_id: str) -> None:  # close's detach ends after the start did
        detaching.set()
        creating.join(5)
        real_detach(session_id)

    egress.detach = slow_detach  # type: ignore[method-assign]
    creating.start()
    try:
        assert entered.wait(10)
        (session,) = started
        closing = threading.Thread(target=m.delete, args=(session.id,))
        closing.start()  # close's teardown: the domain (none yet) destroyed, then detach
        assert detaching.wait(10)
        go.set()
        creating.join(10)
        closing.join(10)
        assert not creating.is_alive() and not closing.is_alive()
        assert isinstance(outcome[0], SessionClosed), outcome
        assert hv.domains == {}, "a domain was left running"
        assert egress._sessions == {}
        if step == "restore":
            assert session.id not in hv.started  # no cold boot for a closed session
        assert not (tmp_path / "sessions" / session.id).exists()
    finally:
        go.set()
        creating.join(10)
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}


def test_a_guest_that_misses_the_first_link_flap_gets_a_second(tmp_path: Path) -> None:
    """No lease soon after the link came up (the guest handled the carrier loss too late
    to see it): the link goes down again, longer, and the guest leases then."""
    hv, egress = FakeHypervisor(), FakeEgress()
    m = manager(tmp_path, hv, egress, clock=FakeClock())
    m.start_pool()
    try:
        assert m.pool is not None and m.pool.wait_full(5)
        egress.auto_lease = False
        real_restore = hv.restore

        def restore(spec, state, **kw):
            domain = real_restore(spec, state, **kw)
            real_set_link = domain.set_link

            def set_link(up: bool) -> None:
                real_set_link(up)
                if domain.links == [False, True, False, True]:
                    egress.lease(spec.session_id)  # the second flap is seen

            domain.set_link = set_link  # type: ignore[method-assign]
            return domain

        hv.restore = restore  # type: ignore[method-assign]
        session = create(m, egress=POLICY_A)
        assert session.start_kind == "warm", events(session, "lifecycle")
        assert hv.domains[session.id].links == [False, True, False, True]
        assert {"link_s", "relink_s", "lease_s"} <= set(session.start_phases_s)
        net = [e["event"] for e in events(session, "network") if "event" in e]
        assert net.index("relink") < net.index("leased")
    finally:
        m.close_all()
        m.close_pool()
    assert hv.domains == {} and egress._sessions == {}
