#!/usr/bin/env python3
"""Convert a fairseq softmax transformer checkpoint into an rfa_transformer checkpoint.

Thin wrapper around rfa_fairseq.cli.convert (console script rfa-convert-transformer); see
`--help` there for the options and the method.
"""
import os
import sys

if __name__ == "__main__":
    # run from a checkout without installing: the repository root holds the rfa_fairseq package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rfa_fairseq.cli.convert import main

    sys.exit(main())
