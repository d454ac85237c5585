"""The linear layers of few rows on AVX-512 (ops/csrc/few_rows.cpp) against oneDNN's on the same weights (fp32) and the
same codes (int8: quantize_rows, onednn::qlinear_pointwise, scale_rows), and the library's choice between them."""
import dataclasses

import pytest
import torch

from helpers import cpp_extension
from rfa_fairseq import torch_internals
from rfa_fairseq.ops.decode_step import OneDNNInt8Linear, OneDNNLinear

PRECISIONS = {"fp32": (OneDNNLinear, "onednn"), "int8": (OneDNNInt8Linear, "onednn_int8")}


@pytest.fixture(scope="module")
def ext():
    return cpp_extension()


def _library_for(ext, precision):
    int8 = precision == "int8"
    if not ext.few_rows_available(int8=int8):
        pytest.skip(f"this CPU has no AVX-512{' VNNI' if int8 else ''}: {precision} products run on oneDNN alone "
                    f"(tests/test_decoding_step.py)")
    available = torch_internals.onednn_int8_linear_available() if int8 else torch_internals.onednn_linear_available()
    if not available:
        pytest.skip(f"torch {torch.__version__} has no oneDNN {precision} linear ops: nothing to compare with")
    library, code = PRECISIONS[precision]
    return library, ext.LinearLibrary(code, torch_internals.onednn_operators())


def _few_rows(ext, precision, packed, x, relu, residual):
    """The few-rows kernel itself on `packed`'s blocks."""
    y = torch.full((x.size(0), packed.out_features), float("nan"))
    if precision == "fp32":
        ext.few_rows_linear_fp32(x, packed.rows_weight, packed.bias, residual, relu, y)
    else:
        codes, row_scales = torch.empty(x.shape, dtype=torch.uint8), torch.empty(x.size(0))
        ext.quantize_rows(x, codes, row_scales)
        ext.few_rows_linear_int8(codes, row_scales, packed.rows_weight, packed.rows_sums, packed.w_scales, packed.bias,
                                 residual, relu, y)
    return y


def _onednn(library, packed, x, relu, residual):
    """oneDNN's product on the packed layer, its few-rows blocks dropped (the library's other path)."""
    plain = dataclasses.replace(packed, rows_weight=None, rows_sums=None)
    return library.linear(plain, x, relu, residual)


# inputs not a multiple of 4 (int8: a last partial group of codes) and past one fp32 chunk of 512, outputs not a
# multiple of 16 or 64 (masked lanes, a ragged last tile), rows past a tile of 4
@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("in_features,out_features", [(256, 516), (13, 7), (258, 50), (1030, 131)])
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9])
def test_few_rows_kernel_matches_onednn(ext, precision, in_features, out_features, rows):
    library_class, library = _library_for(ext, precision)
    torch.manual_seed(in_features * 1000 + out_features + rows)
    weight, bias = torch.randn(out_features, in_features) * 0.1, torch.randn(out_features)
    x, residual = torch.randn(rows, in_features) * 3, torch.randn(rows, out_features)
    for relu, res, b in [(False, None, bias), (True, None, bias), (False, residual, bias), (True, residual, None)]:
        packed = library_class(ext).pack_linear(weight, b)
        # int8: the same exact int32 sums; fp32: the sums in about oneDNN's order. A few ulps of the terms apart (a
        # wrong weight, lane or row is off by the terms themselves)
        torch.testing.assert_close(_few_rows(ext, precision, packed, x, relu, res), _onednn(library, packed, x, relu, res),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_library_takes_the_few_rows_kernel_for_few_rows_only(ext, precision):
    """The library's pick by rows (decode_program.cpp's LinearLibrary::few_rows): zeroed few-rows blocks change the
    output at 4 rows (the kernel runs) and not at 200 (oneDNN runs), where it is oneDNN's exactly."""
    library_class, library = _library_for(ext, precision)
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) * 0.1, torch.randn(96)
    packed = library_class(ext).pack_linear(weight, bias)
    few, many = torch.randn(4, 64), torch.randn(200, 64)
    torch.testing.assert_close(library.linear(packed, few), _onednn(library, packed, few, False, None), rtol=1e-6, atol=1e-5)
    packed.rows_weight = torch.zeros_like(packed.rows_weight)
    assert not torch.allclose(library.linear(packed, few), _onednn(library, packed, few, False, None))
    torch.testing.assert_close(library.linear(packed, many), _onednn(library, packed, many, False, None), rtol=0, atol=0)


def test_the_kernels_reject_blocks_of_another_shape(ext):
    if not ext.few_rows_available(int8=True):
        pytest.skip("this CPU has no AVX-512 VNNI: the few-rows kernels are not called")
    x, y = torch.zeros(4, 64), torch.empty(4, 32)
    with pytest.raises(RuntimeError, match="few_rows_pack_fp32's blocks for 64 inputs"):
        ext.few_rows_linear_fp32(x, ext.few_rows_pack_fp32(torch.zeros(32, 60)), None, None, False, y)
    weight, sums = ext.few_rows_pack_int8(torch.zeros(32, 60, dtype=torch.int8))  # blocks for 60 inputs, not 64
    with pytest.raises(RuntimeError, match="few_rows_pack_int8's blocks for 64 inputs"):
        ext.few_rows_linear_int8(torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4), weight, sums, torch.ones(32), None,
                                 None, False, y)
