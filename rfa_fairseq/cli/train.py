"""fairseq-train, except that --bf16 trains in bfloat16 on the GPU (or the CPU), not a TPU.

fairseq 0.12.3 reads --bf16 as "on a TPU" (options.parse_args_and_arch sets args.tpu), so
`fairseq-train --bf16` on a CUDA machine looks for torch_xla and stops. This entry point
(`rfa-train`, or `python -m rfa_fairseq.cli.train`) takes the same arguments, clears that
implication unless --tpu is given, and runs fairseq's own training entry point: the model
and batches are cast to bfloat16 on the device fairseq trains on (CUDA, or the CPU with
--cpu) and optimized by fairseq's FP16Optimizer without loss scaling, as fairseq does for
bf16. Without --bf16 it is fairseq-train unchanged. The patch is `bf16-on-gpu` of
`rfa_fairseq.fairseq_compat.PATCHES`: where fairseq's parse_args_and_arch is not the source it was
checked against, a warning says so and --bf16 asks for a TPU, as in fairseq-train.
"""
import sys

from fairseq_cli.train import cli_main

from .. import fairseq_compat


def main():
    fairseq_compat.apply_patch("bf16-on-gpu")
    sys.argv[0] = "fairseq-train"
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
