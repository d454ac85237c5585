"""The aarch64 levels executed: the levels' kernel tests (the same comparisons against the references that the x86
levels get: tests/test_cpu_levels.py, test_ops.py, test_decoding_step.py, their neon and neon_dotprod parameters) and
one decoding step of a tiny model through the native runtime compared with this machine's (tests/aarch64_native_step.py),
run by pytest on aarch64 Linux under qemu's user-mode emulation, where this machine is not aarch64 itself. The
environment (Debian's arm64 Python, PyPI's aarch64 torch, fairseq and the C++ module built for aarch64 by the
project's setup.py with Debian's cross compiler) is scripts/setup_aarch64_emulation.sh's, cached; this test runs it
first (quick when nothing changed). Skipped, with the reason, only where the emulator or the cross compiler is missing
and cannot be installed (no apt-get, not root, RFA_NO_APT). The emulated count is printed in the suite's summary
(conftest.py)."""
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

SETUP = Path(REPO) / "scripts" / "setup_aarch64_emulation.sh"
UNAVAILABLE = 3  # the set-up's exit status where the tools are missing and cannot be installed
# the emulated run: the level-parametrized kernel tests (their ids name the level) and the cross-machine step
EMULATED_FILES = ["tests/test_cpu_levels.py", "tests/test_ops.py", "tests/test_decoding_step.py",
                  "tests/aarch64_native_step.py"]
EMULATED_SELECTION = "neon or one_place_chooses or decoding_option_names or cpu_runs_are or reference_machines"


def _summary_counts(output):
    """pytest's closing line as {outcome: count}."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {outcome: int(count) for count, outcome in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                                   lines[-1])}


@pytest.mark.slow
def test_the_aarch64_levels_run_under_emulation(tmp_path, record_property):
    if platform.machine() == "aarch64":
        pytest.skip("this machine is aarch64: the suite runs the neon levels natively")
    if platform.machine() != "x86_64":
        pytest.skip(f"the emulated run is set up from an x86-64 Debian machine; this one is {platform.machine()}")
    setup = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=3000)
    if setup.returncode == UNAVAILABLE:
        pytest.skip(f"no aarch64 emulation here: {setup.stderr.strip().splitlines()[-1]}")
    assert setup.returncode == 0, f"scripts/setup_aarch64_emulation.sh failed:\n{setup.stdout[-2000:]}\n{setup.stderr[-3000:]}"
    env_dir = Path(setup.stdout.strip().splitlines()[-1].split("ready: ", 1)[1])

    # this machine's step: the weights and the results the aarch64 run compares with
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from aarch64_native_step import REFERENCE_ENV, native_step

    state_dict, log_probs, level = native_step()
    reference = tmp_path / "x86_step.pt"
    torch.save({"state_dict": state_dict, "log_probs": log_probs, "level": level, "machine": platform.machine()},
               reference)

    root = env_dir / "root"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "PYTHON"))}
    env.update(PYTHONPATH=f"{env_dir}/site-fairseq:{env_dir}/site:{env_dir}/site-torch", OMP_NUM_THREADS="1",
               **{REFERENCE_ENV: str(reference)}, RFA_CACHE_DIR=str(tmp_path / "cache"))
    # -cpu max: an ARMv8 CPU with the dot-product extension (neon_dotprod runs, and neon below it)
    command = ["qemu-aarch64-static", "-cpu", "max", "-L", str(root), str(root / "usr/bin/python3.11"), "-m", "pytest",
               "-p", "no:cacheprovider", "-v", "-rs", "-k", EMULATED_SELECTION, *EMULATED_FILES]
    proc = subprocess.run(command, cwd=env_dir / "checkout", env=env, capture_output=True, text=True, timeout=3000)
    counts = _summary_counts(proc.stdout)
    print(proc.stdout[-6000:])
    record_property("aarch64_emulated", f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, "
                                        f"{counts.get('skipped', 0)} skipped")
    assert proc.returncode == 0, f"the emulated aarch64 tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert counts.get("passed", 0) > 0 and not counts.get("failed")
    for ran in ("-neon] PASSED", "[neon] PASSED", "neon_dotprod] PASSED", "test_the_native_step_equals_the_reference_machines PASSED"):
        assert ran in proc.stdout.replace("[cpp-neon", "[neon"), f"nothing like '{ran}' in the emulated run"
