"""Scale-out over a Ray cluster (docs/scale-out.md): ``deskvm node`` and ``deskvm serve --ray``.

* :mod:`~agent_bridge.cluster.capacity` — what a node declares (Ray resources and labels)
  and what a session asks for; pure, no Ray.
* :mod:`~agent_bridge.cluster.registry` — the named, detached registry actor: nodes,
  session ownership, cluster credentials, reconciliation (dead nodes -> ``session_lost``).
* :mod:`~agent_bridge.cluster.node` — the NodeAgent actor: one per VM host, runs the
  one-machine ``SessionManager`` and bridge app there, ships recordings.
* :mod:`~agent_bridge.cluster.bridge` — the cluster bridge: places sessions with Ray
  (one placement group each) and proxies REST and WebSockets to the owning node.

Importing this package does not import Ray; its submodules other than ``capacity`` do.
Ray is the optional extra ``deskvm[cluster]``.
"""

from __future__ import annotations

__all__: list[str] = []
