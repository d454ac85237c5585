"""The command-line tools (console scripts in setup.cfg), apart from the plugin itself:

  rfa-convert-transformer   convert.py            softmax transformer checkpoint -> rfa_transformer
  rfa-average-checkpoints   average_checkpoints.py  average the last N checkpoints
  rfa-check-data            check_data.py         check a parallel corpus before fairseq sees it
  rfa-score                 scoring.py            sacreBLEU/chrF scoring, hypotheses from fairseq-generate
  rfa-train                 train.py              fairseq-train with --bf16 on GPUs/CPUs

Each also runs as `python -m rfa_fairseq.cli.<module>`.
"""
