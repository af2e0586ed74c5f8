"""The matching core on synthetic frames: where, how well, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from agent_bridge.qa.errors import ReferenceInvalid
from agent_bridge.qa.match import (
    Area,
    Reference,
    RefSpec,
    changed,
    diff_overlay,
    find,
    similarity,
)
from agent_bridge.qa.model import Box, Point, as_box, pointer_box
from orchestrator.errors import ConfigError
from tests.qa.helpers import BG, desktop

DIALOG = Box(200, 120, 180, 90)


def _crop(pixels: np.ndarray, box: Box) -> np.ndarray:
    return np.ascontiguousarray(pixels[box.y : box.y1, box.x : box.x1])


def test_a_crop_is_found_where_it_is_with_score_one() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    ref = Reference("dialog", _crop(screen, DIALOG))
    candidate = find(screen, ref)
    assert candidate.ok
    assert candidate.box == DIALOG
    assert candidate.score == pytest.approx(1.0, abs=1e-4)
    assert candidate.click_point == DIALOG.center


def test_a_moved_window_is_found_at_its_new_place() -> None:
    ref = Reference("dialog", _crop(desktop(windows=[(DIALOG, "Save changes?")]), DIALOG))
    moved = DIALOG.shifted(-150, 90)
    candidate = find(desktop(windows=[(moved, "Save changes?")]), ref)
    assert candidate.ok and candidate.box == moved


def test_different_text_scores_below_the_threshold() -> None:
    ref = Reference("dialog", _crop(desktop(windows=[(DIALOG, "Save changes?")]), DIALOG))
    candidate = find(desktop(windows=[(DIALOG, "Discard all?")]), ref)
    assert not candidate.ok
    assert 0.0 <= candidate.score < 0.95
    assert candidate.box == DIALOG  # still the best place: it is reported where it was


def test_colour_counts_red_is_not_green_of_the_same_brightness() -> None:
    screen = np.zeros((100, 200, 3), np.uint8)
    screen[...] = BG
    red, green = (200, 30, 30), (0, 109, 0)  # grey levels 84 and 84 (BT.601)
    screen[20:50, 20:80] = red
    screen[20:50, 120:180] = green
    screen[30:40, 30:70] = 255  # a label on both buttons
    screen[30:40, 130:170] = 255
    ref = Reference("green_button", np.ascontiguousarray(screen[20:50, 120:180]))
    assert find(screen, ref).box == Box(120, 20, 60, 30)
    only_red = screen.copy()
    only_red[20:50, 120:180] = BG
    candidate = find(only_red, ref)
    assert not candidate.ok, candidate.score


def test_a_flat_area_is_scored_by_its_colour_not_matched_everywhere() -> None:
    screen = desktop(windows=[(DIALOG, "x")])
    white = Reference("white", np.full((10, 10, 3), 250, np.uint8))
    hit = find(screen, white)
    assert hit.ok and hit.score == pytest.approx(1.0)
    assert screen[hit.box.y, hit.box.x].tolist() == [250, 250, 250]
    orange = Reference("orange", np.full((10, 10, 3), (250, 150, 0), np.uint8))
    assert not find(screen, orange).ok


def test_exclude_areas_ignore_what_changes_inside_the_match_area() -> None:
    before = desktop(windows=[(DIALOG, "12:00")])
    after = desktop(windows=[(DIALOG, "12:59")])
    clock = Box(DIALOG.x + 5, DIALOG.y + 25, 120, 30)
    strict = Reference("d", before, RefSpec(match=(Area(DIALOG),)))
    lenient = Reference("d", before, RefSpec(match=(Area(DIALOG),), exclude=(clock,)))
    assert not find(after, strict).ok
    assert find(after, lenient).ok


def test_margin_limits_the_search_around_the_area() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    near = desktop(windows=[(DIALOG.shifted(30, 20), "Save changes?")])
    far = desktop(windows=[(DIALOG.shifted(-190, 150), "Save changes?")])
    ref = Reference("d", screen, RefSpec(match=(Area(DIALOG),), margin_px=40))
    assert find(near, ref).ok
    assert not find(far, ref).ok
    anywhere = Reference("d", screen, RefSpec(match=(Area(DIALOG),)))
    assert find(far, anywhere).ok


def test_region_limits_the_search() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    ref = Reference("d", _crop(screen, DIALOG))
    assert find(screen, ref, Box(150, 100, 300, 200)).ok
    assert not find(screen, ref, Box(0, 0, 150, 400)).ok


def test_every_area_must_match_and_the_score_is_the_lowest() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?"), (Box(420, 250, 150, 80), "OK")])
    other = desktop(windows=[(DIALOG, "Save changes?"), (Box(420, 250, 150, 80), "Cancel")])
    ref = Reference(
        "two", screen, RefSpec(match=(Area(DIALOG), Area(Box(420, 250, 150, 80))), margin_px=10)
    )
    assert find(screen, ref).ok
    candidate = find(other, ref)
    assert not candidate.ok
    assert candidate.score == min(h.score for h in candidate.hits)
    assert [h.ok for h in candidate.hits] == [True, False]
    assert candidate.box == Box.union([DIALOG, Box(420, 250, 150, 80)])


def test_the_click_point_moves_with_the_match() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    ref = Reference("d", screen, RefSpec(match=(Area(DIALOG),), click=Point(210, 200)))
    moved = DIALOG.shifted(-100, 50)
    candidate = find(desktop(windows=[(moved, "Save changes?")]), ref)
    assert candidate.click_point == Point(110, 250)


def test_the_pointer_over_a_button_does_not_change_the_verdict() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    ref = Reference("d", _crop(screen, Box(200, 120, 60, 40)))
    covered = screen.copy()
    pointer = Point(215, 130)
    cursor = pointer_box(pointer)
    covered[pointer.y : pointer.y + 16, pointer.x : pointer.x + 10] = 0  # a black arrow
    assert not find(covered, ref).ok
    candidate = find(covered, ref, ignore=(cursor,))
    assert candidate.ok, candidate.score


def test_references_that_cannot_work_are_refused() -> None:
    image = np.zeros((20, 20, 3), np.uint8)
    with pytest.raises(ReferenceInvalid, match="not inside"):
        Reference("r", image, RefSpec(match=(Area(Box(10, 10, 20, 5)),)))
    with pytest.raises(ReferenceInvalid, match="wholly excluded"):
        Reference("r", image, RefSpec(exclude=(Box(0, 0, 20, 20),)))
    with pytest.raises(ReferenceInvalid, match="threshold"):
        Reference("r", image, RefSpec(threshold=1.5))
    with pytest.raises(ReferenceInvalid, match="click point"):
        Reference("r", image, RefSpec(click=Point(25, 3)))
    with pytest.raises(ReferenceInvalid, match="uint8"):
        Reference("r", np.zeros((20, 20), np.uint8))


def test_a_reference_larger_than_the_screen_scores_zero() -> None:
    ref = Reference("big", np.zeros((500, 700, 3), np.uint8))
    candidate = find(desktop(), ref)
    assert not candidate.ok and candidate.score == 0.0


def test_changed_counts_pixels_and_boxes_them_ignoring_given_boxes() -> None:
    before = desktop(windows=[(DIALOG, "abc")])
    after = desktop(windows=[(DIALOG, "abcd")])
    count, box = changed(before, after)
    assert count > 0 and box is not None
    assert DIALOG.intersection(box) == box
    assert changed(before, before) == (0, None)
    assert changed(before, after, Box(0, 0, 100, 100)) == (0, None)
    assert changed(before, after, ignore=(box,)) == (0, None)
    assert changed(before, np.zeros((10, 10, 3), np.uint8))[0] == 100


def test_similarity_tells_a_settled_screen_from_a_moving_one() -> None:
    a = desktop(windows=[(DIALOG, "abc")])
    assert similarity(a, a) == 1.0
    one_char = desktop(windows=[(DIALOG, "abd")])
    assert similarity(a, one_char) > 0.995
    opened = desktop(windows=[(DIALOG, "abc"), (Box(40, 200, 300, 150), "new window")])
    assert similarity(a, opened) < 0.95
    assert similarity(a, opened, Box(400, 0, 200, 100)) == 1.0


def test_diff_overlay_marks_differences_in_red() -> None:
    screen = desktop(windows=[(DIALOG, "Save changes?")])
    ref = Reference("d", _crop(desktop(windows=[(DIALOG, "Discard?")]), DIALOG))
    out = diff_overlay(screen, ref, find(screen, ref))
    assert out.shape == screen.shape
    red = np.all(out == (230, 40, 40), axis=2)
    assert red[DIALOG.y : DIALOG.y1, DIALOG.x : DIALOG.x1].sum() > 20


def test_regions_are_boxes_or_half_open_tuples() -> None:
    assert as_box((10, 20, 30, 60)) == Box(10, 20, 20, 40)
    assert as_box(Box(1, 2, 3, 4)) == Box(1, 2, 3, 4)
    with pytest.raises(ConfigError):
        as_box((10, 20, 10, 60))
    with pytest.raises(ConfigError):
        as_box((1, 2, 3))  # type: ignore[arg-type]
