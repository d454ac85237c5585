"""Conversion of a trained fairseq softmax `transformer` into an `rfa_transformer` (the T2R recipe of
Kasai et al. 2021, "Finetuning Pretrained Transformers into RNNs", here with RFA), as library code;
rfa-convert-transformer (cli/convert.py) is its command line.

  checkpoint.py    softmax options and weights -> the RFA model of the same sizes -> the new checkpoint
  calibration.py   the teacher's attention inputs on calibration sentences, sigma, teacher-forced fidelity
  distillation.py  the learned feature maps and gates fitted to the teacher's attention (Hedgehog / LoLCATs)
  pipeline.py      convert(): one conversion, start to end
"""
from .calibration import SIGMA_INITS, teacher_forced_agreement  # noqa: F401
from .checkpoint import ARCH_MAP, DEFAULT_GATE_BIAS, RFA_PARAMETER_SUFFIXES, ConversionError  # noqa: F401
from .distillation import DISTILL_LOSSES  # noqa: F401
from .pipeline import (  # noqa: F401
    DEFAULT_CALIBRATION_SENTENCES, DEFAULT_DISTILL_LOSS, DEFAULT_DISTILL_LR, DEFAULT_DISTILL_STEPS, convert,
)
