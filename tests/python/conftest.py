import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rankpool import RankPool  # noqa: E402


@pytest.fixture(scope="session")
def pool():
    p = RankPool(8)
    yield p
    p.close()
