"""Session tokens: ``/v1/sessions/{id}/tokens`` (mint, list, revoke)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Response

from agent_bridge.server.deps import AdminPrincipal, Bridge, SessionGuard
from agent_bridge.server.errors import ERROR_RESPONSES
from agent_bridge.server.models import MintTokenRequest, TokenInfo
from agent_bridge.tokens import TokenError, scope_allows

__all__ = ["router"]

log = logging.getLogger("deskvm.bridge")

router = APIRouter(prefix="/v1/sessions/{session_id}/tokens", tags=["tokens"],
                   responses=ERROR_RESPONSES)  # fmt: skip


@router.post("", status_code=201, response_model=TokenInfo)
async def mint_token(
    session_id: str, body: MintTokenRequest, principal: AdminPrincipal, bridge: Bridge
) -> TokenInfo:
    """Mint a token bound to this session with a scope and an expiry.

    Needs the admin token or an ``admin`` token of this session; a token never mints a
    wider scope than its own. The token is in this response only; keep it secret.
    422 if ``ttl_s`` exceeds the server's maximum.
    """
    bridge.manager.get(session_id)
    if not scope_allows(principal.scope, body.scope):
        raise TokenError(f"a {principal.scope} token cannot mint {body.scope}", code="forbidden")
    minted, claims = bridge.authority.mint(
        session_id, body.scope, ttl_s=body.ttl_s, single_use=body.single_use
    )
    log.info("minted token %s (%s) for %s by %s", claims.token_id, claims.scope, session_id,
             principal.who)  # fmt: skip
    return TokenInfo.of(claims, minted)


@router.get("", response_model=list[TokenInfo], dependencies=[Depends(SessionGuard("admin"))])
async def list_tokens(session_id: str, bridge: Bridge) -> list[TokenInfo]:
    """Unexpired, unrevoked tokens of this session (ids and scopes, never the tokens)."""
    return [TokenInfo.of(c) for c in bridge.authority.issued(session_id)]


@router.delete("/{token_id}", status_code=204, dependencies=[Depends(SessionGuard("admin"))])
async def revoke_token(session_id: str, token_id: str, bridge: Bridge) -> Response:
    """Revoke a token of this session: refused from now on.

    Idempotent for this session's tokens (revoking one again answers 204 again); 404
    ``token_not_found`` for an id that is no unexpired token of this session (a typo, another
    session's token, or one that expired and is refused anyway).
    """
    if bridge.authority.minted(session_id, token_id) is None:
        raise TokenError(
            f"session {session_id} has no unexpired token {token_id!r} (list them with GET "
            f"/v1/sessions/{session_id}/tokens)",
            code="token_not_found",
        )
    bridge.authority.revoke(token_id)
    return Response(status_code=204)
