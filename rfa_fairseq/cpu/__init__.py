"""The CPU runtime: the native program of the decoding step and the encoder (csrc/, one C++ module compiled for every
instruction-set level of the architecture), its loader (extension.py) and its Python face (native.py: the kernel set,
its linear layers on the weights kept once)."""
