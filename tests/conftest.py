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


def pytest_terminal_summary(terminalreporter):
    """The count of the tests that ran on aarch64 under emulation (tests/test_aarch64_emulated.py records it)."""
    for report in [*terminalreporter.stats.get("passed", []), *terminalreporter.stats.get("failed", [])]:
        for name, value in getattr(report, "user_properties", ()):
            if name == "aarch64_emulated":
                terminalreporter.write_line(f"aarch64 under emulation (tests/test_aarch64_emulated.py): {value}")


@pytest.fixture(scope="session")
def plugin_dir():
    return PLUGIN_DIR


TRITON_INTERPRETER_FROM = (3, 7)  # Triton 3.6's interpreter cannot loop over a runtime bound under numpy >= 2.3


@pytest.fixture(scope="session")
def triton_interpreter():
    """Skips, with the reason, where Triton's interpreter cannot run the plugin's kernels on CPU tensors: the tests
    using it call the kernel modules (and triton_self_check's entry points) with CPU tensors directly."""
    import importlib.util

    from rfa_fairseq.gpu.triton_support import triton_import_error

    if not importlib.util.find_spec("triton"):
        pytest.skip("triton is not installed (the test extra installs it on Linux)")
    if triton_import_error() is not None:
        pytest.skip(f"Triton is not usable here: {triton_import_error()}")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("TRITON_INTERPRET is off (a GPU is present: tests/test_cuda.py runs the compiled kernels)")
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < TRITON_INTERPRETER_FROM:
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run these kernels (needs >= 3.7)")
