import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PLUGIN_DIR = os.path.join(REPO, "rfa_fairseq")

# Without a GPU, Triton's interpreter runs the CUDA path's Triton kernels on CPU tensors (tests/test_triton_kernels.py).
# Triton reads the variable as it is imported (its own library functions are made interpreted then), so it is set
# here, before anything imports it; with a GPU the compiled kernels are tested (tests/test_cuda.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The heaviest files first (1.0-3.5 min each on 2 cores): scripts/run_tests.sh hands whole files to its workers in
# collection order (--dist loadfile --no-loadscope-reorder), so a heavy file started last would run alone at the end.
HEAVIEST_FIRST = ("test_convert.py", "test_kill_resume.py", "test_configs.py", "test_extension_loading.py", "test_cli.py",
                  "test_data_prep.py", "test_recipe_multi30k_en_fr.py", "test_benchmarks.py", "test_bad_input.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests that take more than ~20 s (still run in CI)")


@pytest.fixture(scope="session")
def plugin_dir():
    return PLUGIN_DIR
