"""Convert a trained fairseq softmax `transformer` checkpoint into an `rfa_transformer` checkpoint,
ready for `fairseq-train --finetune-from-model` (the T2R recipe of Kasai et al. 2021, "Finetuning
Pretrained Transformers into RNNs", here with RFA).

Console script `rfa-convert-transformer` (also `python -m rfa_fairseq.cli.convert`,
scripts/convert_transformer_to_rfa.py):

  rfa-convert-transformer --input softmax/checkpoint_best.pt --output rfa_init.pt \\
      --rfa-num-features 128 [other --rfa-* options] --calibration-data data-bin
  fairseq-train data-bin --user-dir rfa_fairseq --arch rfa_transformer_... [the same model and
      --rfa-* options] --finetune-from-model rfa_init.pt ...

With --calibration-data (a fairseq-preprocess'd directory with the teacher's dictionaries) and the
default learned map, the new parameters are then distilled (Hedgehog / LoLCATs, Zhang et al. 2024):

  rfa-convert-transformer --input softmax/checkpoint_best.pt --output rfa_init.pt --calibration-data data-bin
  DATA=data-bin RECIPE=... MODEL=rfa MAX_UPDATE=200 SAVE_DIR=ft FINETUNE_FROM=rfa_init.pt scripts/train.sh

Attention distillation (rfa_fairseq/conversion/distillation.py): the teacher runs on --calibration-sentences
training sentences and the inputs of every converted attention layer are kept; then only the learned
feature maps (W, b) and gates of those layers are trained, --distill-steps Adam updates, so that each
layer's RFA attention matches the teacher's softmax attention on the same inputs (--distill-loss ce:
soft cross-entropy of the attention rows; mse: squared error of the attention outputs). A report per
layer, on the held-out tenth of the sentences: attention-output cosine and top-1 agreement of the
attention rows, before -> after. On the GPU when there is one. --distill-steps 0 is the plain swap.

What is kept, what is new and how sigma starts: rfa_fairseq/conversion/ (checkpoint.py,
calibration.py). --sigma-init defaults to fit when --calibration-data is given, else temperature;
arccos is scale-invariant for a uniform sigma, so it always uses temperature.
"""
import argparse
import sys

from . import run_console_script
from ..config import add_rfa_args
from ..conversion import (DEFAULT_CALIBRATION_SENTENCES, DEFAULT_DISTILL_LOSS, DEFAULT_DISTILL_LR,
                          DEFAULT_DISTILL_STEPS, DEFAULT_GATE_BIAS, DISTILL_LOSSES, SIGMA_INITS, ConversionError,
                          convert)

PROG = "rfa-convert-transformer"


def build_parser():
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="fairseq softmax transformer checkpoint")
    parser.add_argument("--output", required=True, help="rfa_transformer checkpoint to write")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the eval random matrices and gate init (default: the checkpoint's --seed)")
    parser.add_argument("--sigma-init", choices=SIGMA_INITS, default=None,
                        help="how sigma starts: temperature (s = --rfa-temperature^-1/2 in every head), norm (s_h^2 = mean |q| mean |k| / sqrt(d) per head on calibration sentences) or fit (per head, the s of a grid that best matches the softmax output on them); default: fit with --calibration-data, else temperature")
    parser.add_argument("--calibration-data", default=None,
                        help="binarized data dir (fairseq-preprocess --destdir) with the checkpoint's dictionaries")
    parser.add_argument("--calibration-subset", default="train",
                        help="split to calibrate and distill on (default: train)")
    parser.add_argument("--calibration-sentences", type=int, default=DEFAULT_CALIBRATION_SENTENCES,
                        help=f"sentences to calibrate and distill on, spread over the split; the last tenth is "
                             f"held out for the report (default: {DEFAULT_CALIBRATION_SENTENCES})")
    parser.add_argument("--distill-steps", type=int, default=DEFAULT_DISTILL_STEPS,
                        help="with --calibration-data and a learned feature map or the gate: Adam updates of "
                             "attention distillation, one batch of 32 sentences each (see above); 0 = plain swap "
                             f"(default: {DEFAULT_DISTILL_STEPS})")
    parser.add_argument("--distill-loss", choices=DISTILL_LOSSES, default=DEFAULT_DISTILL_LOSS,
                        help="ce: soft cross-entropy of the attention weights (Hedgehog); mse: squared error of "
                             f"the attention outputs (LoLCATs) (default: {DEFAULT_DISTILL_LOSS})")
    parser.add_argument("--distill-lr", type=float, default=DEFAULT_DISTILL_LR,
                        help=f"Adam learning rate of the distillation, cosine-decayed to a tenth (default: {DEFAULT_DISTILL_LR})")
    parser.add_argument("--gate-bias", type=float, default=DEFAULT_GATE_BIAS,
                        help=f"with --rfa-gate: initial gate bias, zero gate weights (default: {DEFAULT_GATE_BIAS})")
    add_rfa_args(parser)
    return parser


class ProgressBar:
    """tqdm on a terminal; otherwise a line every tenth of the steps (logs, pipes). The bar opens at the
    first step, so a conversion without distillation draws none."""

    def __init__(self, total, log):
        self.total, self.log, self.bar = total, log, None

    def __call__(self, step, loss):
        if sys.stderr.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, desc="distilling", unit="step", file=sys.stderr)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")
            if step == self.total:
                self.bar.close()
        elif step % max(1, self.total // 10) == 0 or step == self.total:
            self.log(f"distillation step {step}/{self.total}, loss {loss:.4f}")


def main(argv=None):
    def log(message):
        print(f"{PROG}: {message}", file=sys.stderr)

    def run(args):
        convert(args, log=log, progress=ProgressBar(args.distill_steps, log))

    return run_console_script(PROG, build_parser(), run, ConversionError, argv)


if __name__ == "__main__":
    sys.exit(main())
