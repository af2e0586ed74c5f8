"""Screenshot scaling: client (scaled image) pixels <-> display pixels, exact and in bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_bridge.protocol.actions import (
    Click,
    CursorPosition,
    Drag,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Scroll,
    Zoom,
)
from agent_bridge.protocol.keys import KeyCombo
from agent_bridge.protocol.scaling import Scaler, scale_action, scaled_size
from orchestrator.errors import ActionError, ConfigError

S = Scaler(1280, 800, 1024, 640)


@pytest.mark.parametrize(
    ("client", "display"),
    [((512, 320), (640, 400)), ((0, 0), (0, 0)), ((1023, 639), (1279, 799))],
)
def test_the_issue_case(client: tuple[int, int], display: tuple[int, int]) -> None:
    assert S.to_display(*client) == display
    assert S.to_client(*display) == client


def test_scaled_size_for_a_max_long_edge() -> None:
    assert scaled_size(1280, 800, 1024) == (1024, 640)
    assert scaled_size(800, 1280, 1024) == (640, 1024)
    assert scaled_size(1920, 1080, 1366) == (1366, 768)
    assert scaled_size(1024, 768, 1568) == (1024, 768)  # never scales up
    assert scaled_size(5000, 1, 100) == (100, 1)  # never shrinks an edge to zero
    assert Scaler.for_max_long_edge(1280, 800, 1024) == S


@pytest.mark.parametrize("args", [(0, 800, 1024), (1280, -1, 1024), (1280, 800, 0)])
def test_scaled_size_rejects_non_positive_sizes(args: tuple[int, int, int]) -> None:
    with pytest.raises(ConfigError):
        scaled_size(*args)


def test_scaler_rejects_non_positive_sizes() -> None:
    with pytest.raises(ConfigError):
        Scaler(1280, 800, 0, 640)


@pytest.mark.parametrize("point", [(-1, 0), (0, -1), (1024, 0), (0, 640)])
def test_client_points_outside_the_screenshot_are_errors(point: tuple[int, int]) -> None:
    with pytest.raises(ActionError) as info:
        S.to_display(*point)
    assert info.value.code == "out_of_screen"
    assert "1024x640" in info.value.message


def test_display_points_outside_the_display_are_errors() -> None:
    with pytest.raises(ActionError) as info:
        S.to_client(1280, 0)
    assert info.value.code == "out_of_screen"


def test_scale_action_maps_every_coordinate() -> None:
    hold = KeyCombo(("shift",))
    assert scale_action(Move(512, 320), S) == Move(640, 400)
    assert scale_action(Click(512, 320, count=2, hold=hold), S) == Click(
        640, 400, count=2, hold=hold
    )
    assert scale_action(Click(None, None), S) == Click(None, None)
    assert scale_action(Scroll(512, 320, dy=-5), S) == Scroll(640, 400, dy=-5)
    assert scale_action(Scroll(None, None, dx=3), S) == Scroll(None, None, dx=3)
    assert scale_action(MouseDown(x=4, y=4), S) == MouseDown(x=5, y=5)
    assert scale_action(MouseUp(), S) == MouseUp()
    assert scale_action(Drag(((0, 0), (512, 320), (1023, 639))), S) == Drag(
        ((0, 0), (640, 400), (1279, 799))
    )
    assert scale_action(Zoom(0, 0, 1024, 640), S) == Zoom(0, 0, 1280, 800)
    assert scale_action(Zoom(1, 1, 3, 3), S) == Zoom(1, 1, 4, 4)
    key = Key((KeyCombo(("ret",)),))
    assert scale_action(key, S) is key
    assert scale_action(CursorPosition(), S) == CursorPosition()


def test_identity_scaler_changes_nothing() -> None:
    same = Scaler.identity(1280, 800)
    assert same.is_identity
    click = Click(1279, 799)
    assert scale_action(click, same) is click


def test_zoom_outside_the_screenshot_is_an_error() -> None:
    with pytest.raises(ActionError) as info:
        scale_action(Zoom(0, 0, 1025, 10), S)
    assert info.value.code == "out_of_screen"


sizes = st.integers(min_value=1, max_value=8192)


@st.composite
def down_scalers(draw: st.DrawFn) -> Scaler:
    """Display at least as large as the client on both axes (screenshots scaled down)."""
    cw, ch = draw(sizes), draw(sizes)
    dw = draw(st.integers(min_value=cw, max_value=max(cw, 8192)))
    dh = draw(st.integers(min_value=ch, max_value=max(ch, 8192)))
    return Scaler(dw, dh, cw, ch)


@st.composite
def scaler_and_client_point(draw: st.DrawFn) -> tuple[Scaler, int, int]:
    s = Scaler(draw(sizes), draw(sizes), draw(sizes), draw(sizes))
    x = draw(st.integers(min_value=0, max_value=s.client_width_px - 1))
    y = draw(st.integers(min_value=0, max_value=s.client_height_px - 1))
    return s, x, y


@given(scaler_and_client_point())
def test_every_client_point_lands_on_the_screen(case: tuple[Scaler, int, int]) -> None:
    s, x, y = case
    dx, dy = s.to_display(x, y)
    assert 0 <= dx < s.display_width_px
    assert 0 <= dy < s.display_height_px
    if s.display_width_px < s.client_width_px or s.display_height_px < s.client_height_px:
        return
    # Scaled down: the display pixel overlaps the area the client pixel shows.
    rx = s.display_width_px / s.client_width_px
    ry = s.display_height_px / s.client_height_px
    assert x * rx < dx + 1 and dx < (x + 1) * rx
    assert y * ry < dy + 1 and dy < (y + 1) * ry


@given(scaler_and_client_point())
def test_corners_map_to_corners(case: tuple[Scaler, int, int]) -> None:
    s, _, _ = case
    assert s.to_display(0, 0) == (0, 0)
    assert s.to_client(0, 0) == (0, 0)
    if s.client_width_px == 1 or s.client_height_px == 1:
        return
    last = (s.client_width_px - 1, s.client_height_px - 1)
    assert s.to_display(*last) == (s.display_width_px - 1, s.display_height_px - 1)


@given(down_scalers(), st.data())
def test_round_trip_from_the_client_is_exact(s: Scaler, data: st.DataObject) -> None:
    x = data.draw(st.integers(min_value=0, max_value=s.client_width_px - 1))
    y = data.draw(st.integers(min_value=0, max_value=s.client_height_px - 1))
    assert s.to_client(*s.to_display(x, y)) == (x, y)


@given(down_scalers(), st.data())
def test_round_trip_from_the_display_stays_within_one_client_pixel(
    s: Scaler, data: st.DataObject
) -> None:
    x = data.draw(st.integers(min_value=0, max_value=s.display_width_px - 1))
    y = data.draw(st.integers(min_value=0, max_value=s.display_height_px - 1))
    bx, by = s.to_display(*s.to_client(x, y))
    assert abs(bx - x) <= math.ceil(s.display_width_px / s.client_width_px)
    assert abs(by - y) <= math.ceil(s.display_height_px / s.client_height_px)


@given(down_scalers(), st.data())
def test_upscaled_round_trip_from_the_display_is_exact(s: Scaler, data: st.DataObject) -> None:
    up = Scaler(s.client_width_px, s.client_height_px, s.display_width_px, s.display_height_px)
    x = data.draw(st.integers(min_value=0, max_value=up.display_width_px - 1))
    y = data.draw(st.integers(min_value=0, max_value=up.display_height_px - 1))
    assert up.to_display(*up.to_client(x, y)) == (x, y)


@given(scaler_and_client_point())
def test_mapping_is_monotonic(case: tuple[Scaler, int, int]) -> None:
    s, x, y = case
    if x + 1 < s.client_width_px:
        assert s.to_display(x, y)[0] <= s.to_display(x + 1, y)[0]


@given(sizes, sizes, sizes)
def test_scaled_size_keeps_the_aspect_ratio(w: int, h: int, edge: int) -> None:
    sw, sh = scaled_size(w, h, edge)
    assert max(sw, sh) == min(max(w, h), edge)
    assert sw >= 1 and sh >= 1
    if max(w, h) > edge:
        # The short edge is the rounded exact value (or 1).
        long_px = max(w, h)
        short, short_scaled = (h, sh) if w >= h else (w, sw)
        assert abs(short_scaled - short * edge / long_px) <= 0.5 or short_scaled == 1


@given(scaler_and_client_point(), st.data())
def test_zoom_regions_cover_what_the_client_saw(
    case: tuple[Scaler, int, int], data: st.DataObject
) -> None:
    s, x0, y0 = case
    x1 = data.draw(st.integers(min_value=x0 + 1, max_value=s.client_width_px))
    y1 = data.draw(st.integers(min_value=y0 + 1, max_value=s.client_height_px))
    dx0, dy0, dx1, dy1 = s.region_to_display(x0, y0, x1, y1)
    assert 0 <= dx0 < dx1 <= s.display_width_px
    assert 0 <= dy0 < dy1 <= s.display_height_px
    assert dx0 <= x0 * s.display_width_px / s.client_width_px
    assert dx1 >= x1 * s.display_width_px / s.client_width_px
