import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PLUGIN_DIR = os.path.join(REPO, "rfa_fairseq")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests that take more than ~20 s (still run in CI)")


@pytest.fixture(scope="session")
def plugin_dir():
    return PLUGIN_DIR
