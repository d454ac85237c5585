"""fairseq-train, except that --bf16 trains in bfloat16 on the GPU (or the CPU), not a TPU.

fairseq 0.12.3 reads --bf16 as "on a TPU" (options.parse_args_and_arch sets args.tpu), so
`fairseq-train --bf16` on a CUDA machine looks for torch_xla and stops. This entry point
(`rfa-train`, or `python -m rfa_fairseq.cli.train`) takes the same arguments, clears that
implication unless --tpu is given, and runs fairseq's own training entry point: the model
and batches are cast to bfloat16 on the device fairseq trains on (CUDA, or the CPU with
--cpu) and optimized by fairseq's FP16Optimizer without loss scaling, as fairseq does for
bf16. Without --bf16 it is fairseq-train unchanged.
"""
import sys

from fairseq import options
from fairseq_cli.train import cli_main


def _parse_args_and_arch(*args, _parse=options.parse_args_and_arch, **kwargs):
    parsed = _parse(*args, **kwargs)
    if getattr(parsed, "bf16", False) and "--tpu" not in sys.argv:
        parsed.tpu = False
    return parsed


def main():
    options.parse_args_and_arch = _parse_args_and_arch
    sys.argv[0] = "fairseq-train"
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
