# The fixtures live in rel_common.py with the helpers the tests import: two modules both named "conftest"
# (this one and tests/conftest.py) cannot both be imported from by name in one pytest run.
from pathlib import Path

from rel_common import disk_engine, s3_engine, s3_proxy, stop_engines  # noqa: F401 - pytest registers these fixtures

_HERE = Path(__file__).resolve().parent
_LAST: list[str] = []  # the node id of this folder's last selected test


def pytest_runtest_teardown(item, nextitem):
    """After this folder's last test: its engines stop (the fixtures' own teardown, at the session's end, then
    finds them stopped)."""
    if not _LAST:
        mine = [i.nodeid for i in item.session.items if _HERE in Path(i.path).resolve().parents]
        _LAST.append(mine[-1] if mine else "")
    if item.nodeid == _LAST[0]:
        stop_engines()
