"""`deskvm replay export --osworld` writes OSWorld's own trajectory format (issue 10, s3).

The fields are those OSWorld's ``lib_run_single.run_single_example`` writes to
``traj.jsonl`` for the ``pyautogui`` action space: ``step_num``, ``action_timestamp``
(``%Y%m%d@%H%M%S%f``), ``action`` (a pyautogui code string, or ``WAIT``/``DONE``/``FAIL``),
``response``, ``reward``, ``done``, ``info``, ``screenshot_file``
(``step_{step_num}_{action_timestamp}.png``). Each action string must be code an OSWorld
pyautogui agent could have sent: it parses with deskvm's OSWorld parser back into the
recorded action.
"""

from __future__ import annotations

import ast
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from agent_bridge.protocol.actions import Action, action_to_dict
from agent_bridge.protocol.keys import parse_combo
from agent_bridge.protocol.messages import parse_deskvm_action
from agent_bridge.protocol.vocab.osworld import osworld_key
from agent_bridge.protocol.vocab.pyautogui import parse_pyautogui
from agent_bridge.protocol.vocab.pyautogui_export import PYAUTOGUI_KEY_NAMES, to_pyautogui
from orchestrator.clock import SystemClock
from orchestrator.replay import OSWORLD_TIMESTAMP, export_osworld, osworld_action
from tests.recording.conftest import record

FIELDS = {
    "step_num": int, "action_timestamp": str, "action": str, "response": str,
    "reward": (int, float), "done": bool, "info": dict, "screenshot_file": str,
}  # fmt: skip

ACTIONS: list[dict[str, Any]] = [
    {"action": "screenshot"},
    {"action": "click", "x": 200, "y": 150},
    {"action": "click", "x": 20, "y": 15, "button": "right"},
    {"action": "click", "x": 30, "y": 40, "count": 2, "hold": "ctrl"},
    {"action": "type", "text": "echo 'it''s'\n"},
    {"action": "type", "text": "hunter2", "secret": True},
    {"action": "key", "keys": "ctrl+l Return shift+Tab"},
    {"action": "scroll", "x": 300, "y": 200, "dy": 3},
    {"action": "scroll", "x": 300, "y": 200, "dx": -2},
    {"action": "drag", "path": [[10, 10], [100, 120]]},
    {"action": "move", "x": 600, "y": 300},
    {"action": "mouse_down", "button": "left"},
    {"action": "mouse_up", "button": "left", "x": 601, "y": 301},
    {"action": "hold_key", "keys": "shift", "duration_ms": 300},
    {"action": "wait", "ms": 2000},
    {"action": "wait", "ms": 250},
    {"action": "zoom", "region": [0, 0, 64, 64]},
    {"action": "cursor_position"},
]


def test_trajectory_has_osworlds_fields(tmp_path: Path) -> None:
    bundle = record(tmp_path / "rec", clock=SystemClock(), actions=ACTIONS, capture_fps=5)
    out = tmp_path / "osw"
    steps = export_osworld(bundle, out)
    lines = [json.loads(x) for x in (out / "traj.jsonl").read_text().splitlines()]
    observations = {"screenshot", "zoom", "cursor_position"}
    assert steps == len(lines) == sum(1 for a in ACTIONS if a["action"] not in observations)
    for number, line in enumerate(lines, start=1):
        assert set(line) == set(FIELDS), line
        for key, kind in FIELDS.items():
            assert isinstance(line[key], kind), (key, line)
        assert line["step_num"] == number
        datetime.strptime(line["action_timestamp"], OSWORLD_TIMESTAMP)
        assert re.fullmatch(r"\d{8}@\d{12}", line["action_timestamp"])
        assert line["screenshot_file"] == f"step_{number}_{line['action_timestamp']}.png"
        with Image.open(out / line["screenshot_file"]) as image:
            assert image.size == (640, 400)
        assert line["reward"] == 0 and line["done"] is False and line["info"] == {}
        if line["action"] not in ("WAIT", "DONE", "FAIL"):
            ast.parse(line["action"])  # Python source
    assert (out / "initial_state.png").is_file()
    # The action strings are what an OSWorld pyautogui agent sends for these actions.
    acting = [a for a in ACTIONS if a["action"] not in observations]
    codes = [line["action"] for line in lines]
    assert codes[0] == "import pyautogui\npyautogui.click(200, 150)"
    assert codes[1] == "import pyautogui\npyautogui.click(20, 15, button='right')"
    assert codes[4] == "# deskvm: secret text (7 characters) is not exported"
    assert codes[-2] == "WAIT"
    for body, code in zip(acting, codes, strict=True):
        if body.get("secret"):
            assert "hunter2" not in code
            continue
        want = [action_to_dict(parse_deskvm_action(body))]
        got = [action_to_dict(a) for a in parse_pyautogui(code)]
        if body["action"] == "drag":  # dragTo comes back as its input events
            assert [a["action"] for a in got] == ["move", "mouse_down", "move", "mouse_up"]
            continue
        if body["action"] == "key":  # one call per combo: the same keys in order
            assert [c for a in got for c in a["combos"]] == want[0]["combos"]
            continue
        if body["action"] == "wait" and code == "WAIT":
            assert got == want
            continue
        assert got == want, (body, code)


@pytest.mark.parametrize("qcode", sorted(PYAUTOGUI_KEY_NAMES))
def test_every_key_name_is_pyautoguis_name_for_that_key(qcode: str) -> None:
    name = PYAUTOGUI_KEY_NAMES[qcode]
    expected = "ret" if qcode == "kp_enter" else qcode  # pyautogui has one Enter
    assert osworld_key(name).qcodes == (expected,)


def test_what_pyautogui_cannot_say_stays_a_comment() -> None:
    back = osworld_action({"action": "click", "x": 1, "y": 2, "button": "side", "count": 1})
    assert back is not None and back.startswith("# deskvm: click")
    assert osworld_action({"action": "screenshot"}) is None
    assert to_pyautogui(_key("ctrl+alt+delete")) == (
        "import pyautogui\npyautogui.hotkey('ctrl', 'alt', 'delete')"
    )


def _key(spec: str) -> Action:
    from agent_bridge.protocol.actions import Key

    return Key((parse_combo(spec),))
