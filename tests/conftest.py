import importlib.util
from pathlib import Path

import pytest

from shared_files import DATA

# The test dependencies (tests/requirements.txt and the runtime ones they
# rely on). Tests import some of them
# with importorskip; without this check a missing one would turn whole files
# into skips and a broken install would pass.
TEST_DEPS = ("scipy", "mlx_lm", "gguf", "matplotlib")


def pytest_sessionstart(session):
    missing = [m for m in TEST_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.exit(f"test dependencies not installed: {', '.join(missing)} "
                    "(pip install . && pip install -r tests/requirements.txt, see README)", returncode=4)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    # Shipped with the tests: a missing folder is a broken checkout, not a skip.
    assert DATA.is_dir(), f"test data folder missing: {DATA}"
    return DATA
