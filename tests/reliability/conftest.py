# The fixtures live in rel_common.py with the helpers the tests import: two modules both named "conftest"
# (this one and tests/conftest.py) cannot both be imported from by name in one pytest run.
from rel_common import disk_engine, s3_engine, s3_proxy  # noqa: F401 - pytest registers these fixtures
