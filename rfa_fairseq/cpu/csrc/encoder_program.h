// The encoder's inference as one native call (encoder_program.cpp): fairseq's softmax encoder in eval, built from an
// EncodingRuntime (rfa_fairseq/modules/encoding.py) and its records, on the decoder's linear-layer library.
#pragma once
#include <pybind11/pybind11.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <vector>

#include "linear_layers.h"
#include "program_parts.h"
#include "records.h"

struct EncoderLayerProgram {  // modules/encoding.py's EncoderLayerRecord: fairseq's softmax encoder layer
  LinearLayer qkv;  // [q | k | v]
  LinearLayer out_proj;
  Norm self_attn_norm;
  FeedForward ffn;
  int64_t heads = 0, head_dim = 0;
  static EncoderLayerProgram from(const Record& record);
};

// A batch's encoder pass as one native call, built from an EncodingRuntime (modules/encoding.py): fairseq's
// TransformerEncoderBase.forward_scriptable in eval without autograd, the same torch operations in the same order
// (embedding, positions, padding, each layer as fairseq's encoder layer, the final norm) on the runtime's linear
// layers, without Python between them.
class EncoderProgram {
 public:
  EncoderProgram(const pybind11::object& runtime, std::shared_ptr<LinearLibrary> library);
  // tokens (B, T) int64; positions: the position embeddings' table (P, C), or undefined without them
  void check_encode(const at::Tensor& tokens, const at::Tensor& positions) const;
  // -> {encoder_out (T, B, C), encoder_padding_mask (B, T) bool, encoder_embedding (B, T, C), src_lengths (B, 1)
  // int32}: fairseq's encoder output fields
  std::vector<at::Tensor> encode(const at::Tensor& tokens, const at::Tensor& positions) const;

 private:
  std::shared_ptr<LinearLibrary> library_;
  at::Tensor embed;  // (V, C)
  double embed_scale = 1.0;
  int64_t padding_idx = 1, positions_padding_idx = 1;
  Norm embed_norm, final_norm;
  std::vector<EncoderLayerProgram> layers;
};

void bind_encoder_program(pybind11::module_& m);
