"""The order tests/conftest.py gives the suite: `early` tests first (xdist hands the rest out after them), the
tests that load Ansible in-process last (after it, torch._dynamo no longer imports)."""

from __future__ import annotations

from pathlib import Path

import conftest


class _Item:
    def __init__(self, path: str, early: bool = False):
        self.path, self._early = Path(path), early

    def get_closest_marker(self, name: str):
        return object() if name == "early" and self._early else None


def _rank(item) -> int:
    return conftest._start_order(item)


def test_early_tests_go_first_and_the_ansible_in_process_ones_last():
    items = [_Item("tests/control/test_inventory.py"), _Item("tests/driver/test_faults.py"),
             _Item("tests/control/test_wheelhouse.py", early=True), _Item("tests/ansible/test_molecule.py"),
             _Item("tests/server/test_store.py")]
    conftest.pytest_collection_modifyitems(items)
    assert [str(i.path) for i in items] == [
        "tests/control/test_wheelhouse.py", "tests/driver/test_faults.py", "tests/server/test_store.py",
        "tests/control/test_inventory.py", "tests/ansible/test_molecule.py"]


def test_this_sessions_order_keeps_the_rule(request):
    """The real collection of this session (whatever was selected): ranks never go down."""
    ranks = [_rank(item) for item in request.session.items]
    assert ranks == sorted(ranks)
    early = [item for item in request.session.items if item.get_closest_marker("early")]
    pypi = [item for item in request.session.items if "test_every_stack_resolves_on_pypi" in item.nodeid]
    assert all(item in early for item in pypi), "the PyPI resolution test is not marked early"
    for item in early:  # run before the tests that build models: Ansible must not load in-process there
        source = Path(str(item.path)).read_text()
        assert "import ansible" not in source and "from ansible" not in source, item.nodeid
