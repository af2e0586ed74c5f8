"""Layer 1: message and action schemas and vendor adapters. Pure: no I/O.

Everything here takes decoded JSON or text and returns frozen values (or raises a
:class:`~orchestrator.errors.ProtocolError`); nothing here touches sockets, files,
libvirt or the event loop.
"""

from agent_bridge.protocol.actions import (
    Action,
    Button,
    Click,
    CursorPosition,
    Drag,
    HoldKey,
    Key,
    MouseDown,
    MouseUp,
    Move,
    Point,
    Screenshot,
    Scroll,
    Type,
    Wait,
    Zoom,
    action_name,
    action_to_dict,
)
from agent_bridge.protocol.keys import KeyCombo, parse_combo, parse_combos, text_to_combos
from agent_bridge.protocol.messages import (
    DESKVM_ACTIONS,
    Envelope,
    check_bounds,
    decode_envelope,
    encode_error,
    encode_result,
    parse_deskvm_action,
)
from agent_bridge.protocol.results import CursorResult, Done, ImageResult, Result, to_deskvm_result

__all__ = [
    "DESKVM_ACTIONS",
    "Action",
    "Button",
    "Click",
    "CursorPosition",
    "CursorResult",
    "Done",
    "Drag",
    "Envelope",
    "HoldKey",
    "ImageResult",
    "Key",
    "KeyCombo",
    "MouseDown",
    "MouseUp",
    "Move",
    "Point",
    "Result",
    "Screenshot",
    "Scroll",
    "Type",
    "Wait",
    "Zoom",
    "action_name",
    "action_to_dict",
    "check_bounds",
    "decode_envelope",
    "encode_error",
    "encode_result",
    "parse_combo",
    "parse_combos",
    "parse_deskvm_action",
    "text_to_combos",
    "to_deskvm_result",
]
