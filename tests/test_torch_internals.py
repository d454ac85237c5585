"""Every private torch API the plugin uses, called on the installed torch (rfa_fairseq/torch_internals.py).

A torch upgrade that removes or changes one of them fails here, naming it, rather than as a slower or
wrong decoding step somewhere else.
"""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
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
        ("torch.ops.mkldnn._reorder_linear_weight", hasattr(torch.ops.mkldnn, "_reorder_linear_weight")),
        ("torch.ops.mkldnn._linear_pointwise", hasattr(torch.ops.mkldnn, "_linear_pointwise")),
        ("torch.ops.mkldnn._linear_pointwise.binary",
         hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn._linear_pointwise, "binary")),
        ("torch.utils.cpp_extension._get_build_directory", hasattr(cpp_extension, "_get_build_directory")),
    ] if not present]
    assert not missing, f"torch {torch.__version__} lacks private APIs rfa_fairseq uses: {missing}"


def test_onednn_operators_resolve_in_the_dispatcher():
    """The names the C++ LinearLibrary looks up in torch's dispatcher exist in the installed torch."""
    if not torch_internals.onednn_linear_available():
        pytest.skip(f"torch {torch.__version__} has no oneDNN linear ops: the native program uses addmm")
    for role, (qualified, overload) in torch_internals.onednn_operators().items():
        if role == "qlinear" and not torch_internals.onednn_int8_linear_available():
            continue  # int8 is then an error naming why (kernel_choice._int8_kernels)
        namespace, op = qualified.split("::")
        packet = getattr(getattr(torch.ops, namespace), op)
        assert hasattr(packet, overload or "default"), f"{role}: {qualified}.{overload or 'default'}"


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


def test_onednn_linear_ops_match_f_linear():
    """oneDNN's linear on a packed weight, through the operators the C++ LinearLibrary calls (their dispatcher names),
    == F.linear: with a bias or none, relu fused, a residual fused, a row count far from the packing hint."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip(f"torch {torch.__version__} was built without oneDNN (mkldnn): the step uses addmm")
    assert torch_internals.onednn_linear_available(), \
        "torch has oneDNN but not its private linear ops on packed weights (torch.ops.mkldnn._reorder_linear_weight, " \
        "_linear_pointwise)"
    ops = torch_internals.onednn_operators()

    def op(role):
        qualified, overload = ops[role]
        namespace, name = qualified.split("::")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")

    linear, linear_add = op("linear"), op("linear_add")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x, residual = torch.randn(5, 16, generator=g), torch.randn(5, 24, generator=g)
    packed = torch_internals.onednn_pack_linear_weight(weight, rows_hint=64)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(linear(x, packed, bias, "none", [], ""), expected)
    torch.testing.assert_close(linear(x, packed, None, "none", [], ""), F.linear(x, weight))
    torch.testing.assert_close(linear(x, packed, bias, "relu", [], ""), expected.relu())
    torch.testing.assert_close(linear_add(x, residual, packed, bias, "add"), expected + residual)
    many = torch.randn(130, 16, generator=g)
    torch.testing.assert_close(linear(many, packed, bias, "none", [], ""), F.linear(many, weight, bias))


def test_missing_onednn_op_names_it():
    with pytest.raises(torch_internals.MissingTorchInternal, match=r"torch\.ops\.mkldnn\._no_such_op"):
        torch_internals._mkldnn_op("_no_such_op")


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
