"""Scoped session tokens: every way a token can be wrong is refused (pure, fake clock)."""

from __future__ import annotations

import pytest

from agent_bridge.tokens import TOKEN_PREFIX, TokenAuthority, TokenError, scope_allows
from orchestrator.errors import ConfigError

SID, OTHER = "abcdef012345", "zzzzzz999999"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def authority(clock: Clock) -> TokenAuthority:
    return TokenAuthority(secret=b"k" * 32, default_ttl_s=900, max_ttl_s=3600, clock=clock)


def test_scopes_are_ordered() -> None:
    assert scope_allows("admin", "control") and scope_allows("control", "view")
    assert not scope_allows("view", "control") and not scope_allows("control", "admin")


def test_valid_token_verifies_with_default_15_min_expiry(
    authority: TokenAuthority, clock: Clock
) -> None:
    token, claims = authority.mint(SID, "control")
    assert token.startswith(TOKEN_PREFIX)
    assert claims.expires_at == clock.now + 900
    got = authority.verify(token, session_id=SID, need="view")
    assert got == claims


def test_expired_token_is_refused(authority: TokenAuthority, clock: Clock) -> None:
    token, _ = authority.mint(SID, "admin", ttl_s=10)
    clock.now += 10
    with pytest.raises(TokenError, match="expired") as info:
        authority.verify(token, session_id=SID, need="view")
    assert info.value.code == "unauthorized"


def test_wrong_scope_is_forbidden(authority: TokenAuthority) -> None:
    token, _ = authority.mint(SID, "view")
    with pytest.raises(TokenError) as info:
        authority.verify(token, session_id=SID, need="control")
    assert info.value.code == "forbidden"


def test_wrong_session_is_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint(SID, "admin")
    with pytest.raises(TokenError, match="not for this session"):
        authority.verify(token, session_id=OTHER, need="view")


@pytest.mark.parametrize(
    "forge",
    [
        # a signature character (not the last: its unused low bits would not change it)
        lambda t: t[:-10] + ("A" if t[-10] != "A" else "B") + t[-9:],
        lambda t: t.replace(".", ".x", 2),  # payload edited
        lambda t: "dvt1.e30.abc",  # made up
        lambda t: t.removeprefix(TOKEN_PREFIX),  # no prefix
        lambda t: "",
    ],
)
def test_forged_tokens_are_refused(authority: TokenAuthority, forge) -> None:  # type: ignore[no-untyped-def]
    token, _ = authority.mint(SID, "admin")
    with pytest.raises(TokenError) as info:
        authority.verify(forge(token), session_id=SID, need="view")
    assert info.value.code == "unauthorized"


def test_token_signed_by_another_server_is_refused(authority: TokenAuthority) -> None:
    other = TokenAuthority(secret=b"o" * 32)
    token, _ = other.mint(SID, "admin")
    with pytest.raises(TokenError, match="signature"):
        authority.verify(token, session_id=SID, need="view")


def test_scope_cannot_be_raised_by_editing_the_payload(authority: TokenAuthority) -> None:
    view, _ = authority.mint(SID, "view")
    # An "admin" payload (signed by someone else's key) spliced onto the real signature.
    admin_elsewhere, _ = TokenAuthority(secret=b"o" * 32).mint(SID, "admin")
    body = admin_elsewhere.removeprefix(TOKEN_PREFIX).rsplit(".", 1)[0]
    sig = view.rsplit(".", 1)[1]
    with pytest.raises(TokenError, match="signature"):
        authority.verify(f"{TOKEN_PREFIX}{body}.{sig}", session_id=SID, need="admin")


def test_revoked_token_is_refused(authority: TokenAuthority) -> None:
    token, claims = authority.mint(SID, "control")
    assert authority.revoke(claims.token_id) == claims
    with pytest.raises(TokenError, match="revoked"):
        authority.verify(token, session_id=SID, need="view")
    assert authority.issued(SID) == []


def test_revoke_session_revokes_all_its_tokens(authority: TokenAuthority) -> None:
    a, _ = authority.mint(SID, "view")
    b, _ = authority.mint(SID, "admin")
    c, _ = authority.mint(OTHER, "admin")
    assert authority.revoke_session(SID) == 2
    for token in (a, b):
        with pytest.raises(TokenError):
            authority.verify(token, session_id=SID, need="view")
    authority.verify(c, session_id=OTHER, need="view")


def test_replayed_single_use_token_is_refused(authority: TokenAuthority) -> None:
    token, _ = authority.mint(SID, "view", single_use=True)
    authority.verify(token, session_id=SID, need="view")  # a check does not consume it
    authority.verify(token, session_id=SID, need="view", use=True)
    with pytest.raises(TokenError, match="already used"):
        authority.verify(token, session_id=SID, need="view", use=True)


def test_mint_limits(authority: TokenAuthority) -> None:
    with pytest.raises(ConfigError):
        authority.mint(SID, "view", ttl_s=3601)
    with pytest.raises(ConfigError):
        authority.mint(SID, "view", ttl_s=0)
    with pytest.raises(ConfigError):
        authority.mint(SID, "root")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TokenAuthority(secret=b"short")


def test_error_messages_never_contain_the_token(authority: TokenAuthority, clock: Clock) -> None:
    token, _ = authority.mint(SID, "view", ttl_s=1)
    clock.now += 5
    with pytest.raises(TokenError) as info:
        authority.verify(token, session_id=SID, need="control")
    assert token not in str(info.value)
    assert token.removeprefix(TOKEN_PREFIX) not in str(info.value)
