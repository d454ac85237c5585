"""Every private torch API the plugin uses, called on the installed torch (rfa_fairseq/torch_internals.py).

A torch upgrade that removes or changes one of them fails here, naming it, rather than as a slower or
wrong decoding step somewhere else.
"""
import re
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from rfa_fairseq import torch_internals

PACKAGE = Path(torch_internals.__file__).parent
# torch's private names: torch._C, private mkldnn ops, cpp_extension's private functions, tensor internals
PRIVATE_TORCH = re.compile(r"torch\._C\b|torch\.ops\.mkldnn\._|cpp_extension\._|\._cdata\b|\._version\b")


def test_private_names_exist_in_installed_torch():
    missing = [name for name, present in [
        ("torch.utils.cpp_extension.FileBaton or FileLock (the JIT build's lock)",
         hasattr(cpp_extension, "FileBaton") or hasattr(cpp_extension, "FileLock")),
        ("Tensor._version", hasattr(torch.empty(1), "_version")),
        ("torch.utils.cpp_extension._get_build_directory", hasattr(cpp_extension, "_get_build_directory")),
    ] if not present]
    assert not missing, f"torch {torch.__version__} lacks private APIs rfa_fairseq uses: {missing}"


def test_tensor_version_counts_in_place_updates():
    t = torch.zeros(3)
    before = torch_internals.tensor_version(t)
    t.add_(1)
    t[:1].mul_(2)  # through a view
    assert torch_internals.tensor_version(t) == before + 2
    t.data.add_(1)  # .data leaves the version alone (why the decoder drops its runtime in train())
    assert torch_internals.tensor_version(t) == before + 2


def test_tensor_states_name_each_tensors_identity_storage_and_version():
    a, b = torch.zeros(3), torch.zeros(2)
    before = torch_internals.tensor_states([a, b])
    assert before == ((id(a), a.data_ptr(), torch_internals.tensor_version(a)),
                      (id(b), b.data_ptr(), torch_internals.tensor_version(b)))
    b.add_(1)
    after = torch_internals.tensor_states([a, b])
    assert after[0] == before[0] and after[1][2] == before[1][2] + 1


def test_cpp_extension_build_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = Path(torch_internals.cpp_extension_build_directory("rfa_test_ext"))
    assert build_dir.is_dir() and build_dir.name == "rfa_test_ext"
    assert tmp_path in build_dir.parents, f"{build_dir} is not under TORCH_EXTENSIONS_DIR {tmp_path}"


def test_private_torch_names_only_in_torch_internals():
    naming = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
              if PRIVATE_TORCH.search(path.read_text(encoding="utf-8"))}
    assert naming == {"torch_internals.py"}, \
        f"private torch APIs named outside rfa_fairseq/torch_internals.py: {sorted(naming - {'torch_internals.py'})}"
