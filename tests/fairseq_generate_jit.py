"""fairseq-generate with the fused C++ kernels built just in time (test helper).

    python tests/fairseq_generate_jit.py [--build-lock-timeout-s S] FAIRSEQ_GENERATE_ARGS...

The prebuilt module (setup.py) is skipped, so the first decoding step takes the JIT path of
rfa_fairseq/cpu/extension.py (our flock, then torch's load in TORCH_EXTENSIONS_DIR), as in an install
without the module or with a stale one; --build-lock-timeout-s S waits S seconds for another process's
build instead of the default. The package reads no switches of its own: this launcher patches it, in
this process only, and then runs fairseq's own generate entry point with the remaining arguments.
"""
import sys

from fairseq_cli.generate import cli_main

from rfa_fairseq.cpu import extension


def skip_prebuilt_module() -> None:
    extension.import_prebuilt = lambda: (None, "the prebuilt module is skipped by tests/fairseq_generate_jit.py")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--build-lock-timeout-s":
        extension.BUILD_LOCK_TIMEOUT_S = float(sys.argv[2])
        del sys.argv[1:3]
    skip_prebuilt_module()
    sys.argv[0] = "fairseq-generate"
    sys.exit(cli_main())
