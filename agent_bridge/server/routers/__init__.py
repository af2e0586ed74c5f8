"""The bridge's routers, one module per resource; :mod:`agent_bridge.server.app` mounts them.

Each module defines ``router`` (a :class:`fastapi.APIRouter`) and reaches shared state only
through :mod:`agent_bridge.server.deps`. Routers do not import each other.
"""
