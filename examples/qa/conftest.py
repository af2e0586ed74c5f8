"""The example QA suite boots real VMs (the small image, debian12-desktop at 1280x800).

Run it: ``pytest examples/qa`` (as root, with libvirtd and the image built; see the README).
``tests/vm/test_examples_qa_vm.py`` runs it in CI with ``--runxfail`` and checks the
failure report of the test that fails on purpose.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.vm)
