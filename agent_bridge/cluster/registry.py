"""The registry: a named, detached Ray actor that knows every node and who owns each session.

``deskvm-registry`` in namespace ``deskvm`` is created by the first bridge or node that asks
(:func:`ensure_registry`, ``get_if_exists``), pinned to the head node and kept alive by Ray
independently of any bridge: bridges restart, the registry does not. It holds

* **nodes**: Ray node id -> name, URL of the node's bridge app, labels, resources,
  incarnation (random per NodeAgent start), time of the last heartbeat;
* **sessions**: id -> node, placement group, state, ``closed_reason``, the session's last
  JSON (to answer about lost sessions), recording URL;
* **the cluster's credentials**: the admin token and the token-signing secret every bridge
  and node shares (docs/scale-out.md, "Tokens valid on every bridge").

A reconcile loop (every ``reconcile_interval_s``) removes the placement groups of ended
sessions, ends the sessions of dead nodes (Ray's GCS says ``Alive: false``) and of replaced
agents with ``session_lost: ...`` and seals their stored recordings ``truncated``, and frees
reservations a bridge made but never used.

Actor methods return plain dicts (never raise deskvm errors across Ray: exceptions lose
their ``code`` when pickled); :func:`ensure_registry` and callers turn them into errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import ray
from ray.util.placement_group import (
    get_placement_group,
    placement_group_table,
    remove_placement_group,
)

from orchestrator.errors import ConfigError

__all__ = [
    "ENDED_STATES",
    "LOST",
    "NAMESPACE",
    "PLACEMENT_PREFIX",
    "REGISTRY_NAME",
    "Registry",
    "ensure_registry",
    "get_registry",
]

log = logging.getLogger("deskvm.cluster")

REGISTRY_NAME = "deskvm-registry"
NAMESPACE = "deskvm"
PLACEMENT_PREFIX = "deskvm-session-"
"""Each session's placement group is named ``deskvm-session-<session id>``."""
LOST = "session_lost"
"""Prefix of the ``closed_reason`` of a session whose node died."""
ENDED_STATES = frozenset({"closing", "closed", "failed"})
_HISTORY = 4096
"""Ended sessions remembered (for ``GET`` of a lost session), oldest forgotten first."""


def _now_utc() -> str:
    return datetime.now(UTC).isoformat()


class Registry:
    """The registry actor's state and methods (run as a Ray async actor).

    Args:
        admin_token: the cluster's admin token (default: a new random one).
        reconcile_interval_s: how often dead nodes and ended sessions are handled, s.
        reserve_timeout_s: a reservation no node has reported after this long is freed, and
            so is a session placement group no session record owns, s.
    """

    def __init__(
        self,
        admin_token: str | None = None,
        *,
        reconcile_interval_s: float = 1.0,
        reserve_timeout_s: float = 60.0,
    ) -> None:
        self._admin_token = admin_token or secrets.token_urlsafe(32)
        self._secret = secrets.token_hex(32)
        self._interval_s = reconcile_interval_s
        self._reserve_timeout_s = reserve_timeout_s
        self._nodes: dict[str, dict[str, Any]] = {}
        self._sessions: dict[str, dict[str, Any]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._removals: list[str] = []
        self._seals: list[tuple[str, str]] = []
        self._orphans: dict[str, float] = {}  # group name -> when first seen unowned
        self._task: asyncio.Task[None] | None = None
        self.lost_total = 0

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> bool:
        """Start the reconcile loop (idempotent); ``True`` if this call started it."""
        if self._task is not None and not self._task.done():
            return False
        self._task = asyncio.get_running_loop().create_task(self._loop())
        return True

    async def pid(self) -> int:
        """The actor's process id (benchmarks measure its memory)."""
        return os.getpid()

    async def credentials(self) -> dict[str, str]:
        """``{"admin_token", "token_secret"}`` (hex) shared by every bridge and node."""
        return {"admin_token": self._admin_token, "token_secret": self._secret}

    # --- nodes ---------------------------------------------------------------------

    async def register_node(self, info: dict[str, Any]) -> dict[str, Any]:
        """A NodeAgent announces itself: ``node_id``, ``name``, ``url``, ``incarnation``,
        ``labels``, ``resources``, ``recordings_url``, ``backend``.

        A new incarnation on a known node means the previous agent died: its sessions are
        lost.
        """
        node_id = str(info["node_id"])
        old = self._nodes.get(node_id)
        if old is not None and old["incarnation"] != info["incarnation"]:
            self._lose_node_sessions(node_id, f"{LOST}: the agent of node {old['name']} restarted")
        self._nodes[node_id] = {**info, "last_seen": time.monotonic(), "alive": True}
        log.info("node %s registered at %s", info["name"], info["url"])
        return {"ok": True}

    async def unregister_node(self, node_id: str, incarnation: str) -> dict[str, Any]:
        """A node leaves on purpose (``deskvm node`` stopped); sessions left are lost."""
        node = self._nodes.get(node_id)
        if node is None or node["incarnation"] != incarnation:
            return {"ok": False}
        self._lose_node_sessions(node_id, f"{LOST}: node {node['name']} left the cluster")
        del self._nodes[node_id]
        return {"ok": True}

    async def heartbeat(
        self, node_id: str, incarnation: str, sessions: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """A node's periodic report: every session its manager knows, with state.

        Args:
            sessions: ``[{"session_id", "state", "closed_reason", "recording_url"}]``.

        Returns:
            ``{"ok": True}``, or ``{"ok": False, "reregister": True}`` when this registry
            does not know the node (it was restarted, or the node was declared dead).
        """
        node = self._nodes.get(node_id)
        if node is None or node["incarnation"] != incarnation:
            return {"ok": False, "reregister": True}
        node["last_seen"] = time.monotonic()
        for report in sessions:
            session_id = str(report["session_id"])
            record = self._sessions.get(session_id)
            if record is None:
                if report["state"] in ENDED_STATES:
                    continue  # ended before the registry heard of it: nothing to own
                record = self._new_record(session_id, node_id, None)
            if record["ended"] or record["node_id"] != node_id:
                continue
            record["reported"] = True
            record["state"] = report["state"]
            record["closed_reason"] = report.get("closed_reason")
            if report.get("recording_url"):
                record["recording_url"] = report["recording_url"]
            if record["snapshot"] is not None:
                record["snapshot"] = {
                    **record["snapshot"],
                    "state": report["state"],
                    "closed_reason": report.get("closed_reason"),
                }
            if report["state"] in ENDED_STATES:
                self._end(record)
        return {"ok": True}

    async def nodes(self) -> list[dict[str, Any]]:
        """Every registered node (alive ones; dead ones are dropped)."""
        return [dict(n) for n in self._nodes.values()]

    # --- sessions ------------------------------------------------------------------

    def _new_record(self, session_id: str, node_id: str, pg_name: str | None) -> dict[str, Any]:
        node = self._nodes.get(node_id, {})
        record: dict[str, Any] = {
            "session_id": session_id,
            "node_id": node_id,
            "node_name": node.get("name"),
            "placement_group": pg_name,
            "state": "placing",
            "closed_reason": None,
            "snapshot": None,
            "recording_url": None,
            "reserved_at": time.monotonic(),
            "reported": False,
            "ended": False,
        }
        self._sessions[session_id] = record
        return record

    async def reserve(self, session_id: str, node_id: str, pg_name: str) -> dict[str, Any]:
        """A bridge placed ``session_id`` on ``node_id`` with placement group ``pg_name``."""
        if session_id in self._sessions:
            return {"ok": False, "message": f"session id {session_id} is taken"}
        if node_id not in self._nodes:
            return {"ok": False, "message": "that node has no deskvm agent registered"}
        self._new_record(session_id, node_id, pg_name)
        return {"ok": True, "url": self._nodes[node_id]["url"]}

    async def bind(self, session_id: str, snapshot: dict[str, Any]) -> dict[str, Any]:
        """The session started: keep its JSON (answers about it if its node is lost)."""
        record = self._sessions.get(session_id)
        if record is None:
            return {"ok": False}
        record["snapshot"] = dict(snapshot)
        if not record["ended"]:
            record["state"] = snapshot.get("state", record["state"])
        return {"ok": True}

    async def release(self, session_id: str) -> dict[str, Any]:
        """The create failed: free the reservation (the node reports its own record)."""
        record = self._sessions.get(session_id)
        if record is None:
            return {"ok": False}
        if not record["ended"]:
            record["state"] = "failed"
            self._end(record)
        return {"ok": True}

    async def lookup(self, session_id: str) -> dict[str, Any] | None:
        """Who owns ``session_id``: the record plus ``url`` and ``node_alive``; ``None``
        if unknown."""
        record = self._sessions.get(session_id)
        if record is None:
            return None
        node = self._nodes.get(record["node_id"])
        return {
            **record,
            "url": node["url"] if node else None,
            "node_alive": node is not None,
        }

    async def sessions(self) -> list[dict[str, Any]]:
        """Every known session record (live first, then ended, oldest first)."""
        live = [dict(r) for r in self._sessions.values() if not r["ended"]]
        return live + [dict(self._sessions[s]) for s in self._ended if s in self._sessions]

    async def counts(self) -> dict[str, int]:
        """``{"nodes", "live", "ended", "lost", "pending_removals"}``."""
        live = sum(not r["ended"] for r in self._sessions.values())
        return {
            "nodes": len(self._nodes),
            "live": live,
            "ended": len(self._sessions) - live,
            "lost": self.lost_total,
            "pending_removals": len(self._removals),
        }

    def _end(self, record: dict[str, Any]) -> None:
        record["ended"] = True
        if record["placement_group"]:
            self._removals.append(record["placement_group"])
            record["placement_group"] = None
        self._ended[record["session_id"]] = None
        while len(self._ended) > _HISTORY:
            old, _ = self._ended.popitem(last=False)
            self._sessions.pop(old, None)

    def _lose_node_sessions(self, node_id: str, reason: str) -> None:
        for record in list(self._sessions.values()):
            if record["node_id"] != node_id or record["ended"]:
                continue
            record["state"] = "closed"
            record["closed_reason"] = reason
            if record["snapshot"] is not None:
                record["snapshot"] = {
                    **record["snapshot"],
                    "state": "closed",
                    "closed_reason": reason,
                }
            self.lost_total += 1
            if record["recording_url"]:
                self._seals.append((record["recording_url"], reason))
            self._end(record)
            log.warning("session %s: %s", record["session_id"], reason)

    # --- reconciliation ------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """One pass (the loop calls it; tests may too). Returns what it did."""
        alive = await asyncio.to_thread(_alive_node_ids)
        dead = 0
        for node_id, node in list(self._nodes.items()):
            if alive is not None and node_id not in alive:
                self._lose_node_sessions(node_id, f"{LOST}: node {node['name']} died")
                del self._nodes[node_id]
                dead += 1
        now = time.monotonic()
        stale = 0
        for record in list(self._sessions.values()):
            if (
                not record["ended"]
                and not record["reported"]
                and now - record["reserved_at"] > self._reserve_timeout_s
            ):
                record["state"] = "failed"
                record["closed_reason"] = "the reservation was never used"
                self._end(record)
                stale += 1
        orphans = await asyncio.to_thread(_session_groups)
        for name in orphans:
            session_id = name.removeprefix(PLACEMENT_PREFIX)
            owner = self._sessions.get(session_id)
            if owner is not None and owner["placement_group"] == name:
                self._orphans.pop(name, None)
                continue
            # A bridge died between creating the group and reserving it, or the group
            # outlived its session's record: free it once it stays unknown for a while.
            first = self._orphans.setdefault(name, now)
            if now - first > self._reserve_timeout_s:
                self._removals.append(name)
                del self._orphans[name]
        for name in [n for n in self._orphans if n not in orphans]:
            del self._orphans[name]
        removals, self._removals = self._removals, []
        if removals:
            await asyncio.to_thread(_remove_placement_groups, removals)
        seals, self._seals = self._seals, []
        for url, reason in seals:
            await asyncio.to_thread(_seal, url, reason)
        return {"dead_nodes": dead, "stale": stale, "removed": len(removals), "sealed": len(seals)}

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.reconcile()
            except Exception:
                log.exception("registry reconcile failed")


def _alive_node_ids() -> set[str] | None:
    try:
        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    except Exception:
        log.exception("cannot list the cluster's nodes")
        return None


def _session_groups() -> set[str]:
    """Names of the live (not removed) placement groups of deskvm sessions."""
    try:
        table = placement_group_table()
    except Exception:
        log.exception("cannot list the cluster's placement groups")
        return set()
    return {
        str(g["name"])
        for g in table.values()
        if str(g.get("name", "")).startswith(PLACEMENT_PREFIX) and g.get("state") != "REMOVED"
    }


def _remove_placement_groups(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(Exception):  # already gone, or its name was never created
            remove_placement_group(get_placement_group(name))


def _seal(url: str, reason: str) -> None:
    from orchestrator.errors import DeskvmError
    from orchestrator.storage import open_store, seal_truncated, split_recording_url

    try:
        base, name = split_recording_url(url)
        seal_truncated(open_store(base), name, reason=reason, ended_at=_now_utc())
    except DeskvmError as exc:
        log.error("cannot seal the recording at %s: %s", url, exc.message)


def get_registry() -> Any:
    """The registry actor's handle (Ray must be initialised).

    Raises:
        ConfigError: there is no registry (no bridge or node ever started on this cluster).
    """
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ConfigError(
            "this Ray cluster has no deskvm registry yet: start `deskvm serve --ray ADDRESS`"
            " or `deskvm node --ray ADDRESS` first"
        ) from None


def ensure_registry(
    admin_token: str | None = None,
    *,
    reconcile_interval_s: float = 1.0,
    reserve_timeout_s: float = 60.0,
) -> tuple[Any, dict[str, str]]:
    """Get or create the registry (pinned to the head node) and the cluster's credentials.

    Args:
        admin_token: the admin token to use if this call creates the registry; if the
            registry exists with another one, that is an error.

    Returns:
        ``(handle, {"admin_token", "token_secret"})``.

    Raises:
        ConfigError: ``admin_token`` differs from the cluster's.
    """
    actor = ray.remote(Registry).options(
        name=REGISTRY_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        resources={"node:__internal_head__": 0.001},
        max_restarts=0,
    )
    handle = actor.remote(
        admin_token,
        reconcile_interval_s=reconcile_interval_s,
        reserve_timeout_s=reserve_timeout_s,
    )
    ray.get(handle.start.remote())
    credentials: dict[str, str] = ray.get(handle.credentials.remote())
    if admin_token and not secrets.compare_digest(
        credentials["admin_token"].encode(), admin_token.encode()
    ):
        raise ConfigError(
            "this cluster already has another admin token (every bridge of a cluster shares"
            " one): start without --token / DESKVM_TOKEN to use the cluster's"
        )
    return handle, credentials
