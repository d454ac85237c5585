"""The CPU runtime: the native program of the decoding step and the encoder (csrc/, one C++ module compiled for every
instruction-set level of the architecture), its loader (extension.py), its Python face (native.py: the kernel set and
its linear-layer libraries), the few-rows limits measured per machine (few_rows_limits.py) and the instruction-set
level's effect outside the module (isa.py)."""
