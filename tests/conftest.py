from pathlib import Path

import pytest

from shared_files import DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"shared data folder not found at {DATA}")
    return DATA
