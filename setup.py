"""Build step of rfa-fairseq (the metadata is in setup.cfg): the fused C++ kernels.

Every .cpp in rfa_fairseq/cpu/csrc, and the CPU kernels once per instruction-set level of the machine's architecture
(cpu/extension.py's LEVELS), is compiled ahead of time into one module, `rfa_fairseq.cpu._cpp_kernels`, when torch is
importable in the build environment
(scripts/setup_env.sh installs with --no-build-isolation into a venv that has the pinned torch).
Editable installs place it in the source tree, where `import rfa_fairseq` finds it (git-ignored).

The build is optional: pip's isolated build environment has no torch (listing torch in
pyproject.toml would make pip install an unpinned torch, several GB of CUDA wheels, just to build),
and a machine may have no C++ compiler. Then the package installs without the module, and the first
decoding step builds it just in time when it can, else decodes on the torch path
(rfa_fairseq/cpu/extension.py, which also names the sources and flags used here).
"""
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def note(message: str) -> None:
    print(f"rfa-fairseq setup.py: {message}", file=sys.stderr, flush=True)


def extension_spec():
    """rfa_fairseq/cpu/extension.py, loaded by path: importing the package would import fairseq."""
    path = os.path.join(HERE, "rfa_fairseq", "cpu", "extension.py")
    spec = importlib.util.spec_from_file_location("rfa_fairseq_extension_spec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpp_kernels() -> dict:
    """setup() arguments that build the C++ kernels, or none when torch is not importable here."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        note(f"torch is not importable in this build environment ({error}): the fused C++ kernels are not "
             "built now; the first decoding step builds them just in time (a C++ compiler is needed)")
        return {}
    spec = extension_spec()

    class OptionalBuildExtension(BuildExtension):
        """A failed compile (no compiler, ...) installs the package without the module. The levels' objects are
        compiled first, all at once, and linked in; the module's sources then compile in parallel (ninja)."""

        def build_extensions(self):
            objects = spec.compile_level_objects(Path(self.build_temp) / spec.LEVEL_DIR_NAME,
                                                 **spec.torch_level_build_args())
            for ext in self.extensions:
                ext.extra_objects = [*ext.extra_objects, *map(str, objects)]
            super().build_extensions()

        def run(self):
            try:
                super().run()
            except Exception as error:
                first_line = (str(error).strip().splitlines() or [""])[0]
                note(f"the fused C++ kernels were not built ({type(error).__name__}: {first_line}); installing "
                     "without them: decoding builds them just in time, or uses the torch path without a compiler")
                self.extensions = []  # nothing to install or copy into the source tree

    extension = CppExtension(
        name=spec.PREBUILT_MODULE,
        sources=[os.path.relpath(path, HERE) for path in spec.source_files()],
        extra_compile_args=spec.compile_flags(torch.__version__),
        extra_link_args=spec.EXTRA_LDFLAGS,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": OptionalBuildExtension}}


# the plugin, and the console scripts' launcher: a package of its own (scripts/rfa_fairseq_cli), since importing
# rfa_fairseq registers it with fairseq (seconds), and --help should answer at once
PACKAGES = {"packages": find_packages(include=["rfa_fairseq", "rfa_fairseq.*"]) + ["rfa_fairseq_cli"],
            "package_dir": {"rfa_fairseq_cli": "scripts/rfa_fairseq_cli"}}

setup(**PACKAGES, **cpp_kernels())
