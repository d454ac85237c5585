// A batch's encoder pass as one native call (encoder_program.h): fairseq's softmax encoder in eval without autograd,
// the operations of TransformerEncoderBase.forward_scriptable and TransformerEncoderLayerBase.forward in their order
// (the fairseq functions it repeats are fingerprinted: fairseq_mirrors.NATIVE_ENCODER_MIRRORS; another fairseq turns
// it off), on the runtime's linear layers, so fairseq's output within those layers' rounding; what it removes is
// Python between ~25 operations a layer (at one sentence a batch, most of the encoder's time) and the GIL (threads
// that decode different batches encode at once). The pass is named rfa::encoder for torch's profiler.
#include <ATen/record_function.h>
#include <ATen/core/grad_mode.h>
#include <pybind11/stl.h>

#include "encoder_program.h"

namespace py = pybind11;

EncoderLayerProgram EncoderLayerProgram::from(const Record& r) {
  EncoderLayerProgram layer;
  layer.qkv = LinearLayer::from(r.sub("qkv"));
  layer.out_proj = LinearLayer::from(r.sub("out_proj"));
  layer.self_attn_norm = Norm::from(r.optional_sub("self_attn_norm"));
  layer.ffn = FeedForward::from(r);
  TORCH_CHECK(layer.self_attn_norm.defined() && layer.ffn.final_norm.defined(), "rfa encoder program: ", r.path(),
              " needs both of its norms");
  layer.heads = r.integer("heads");
  layer.head_dim = r.integer("head_dim");
  TORCH_CHECK(layer.qkv.out_features == 3 * layer.heads * layer.head_dim, "rfa encoder program: ", r.path(),
              ".qkv has ", layer.qkv.out_features, " outputs for ", layer.heads, " heads of ", layer.head_dim);
  return layer;
}

EncoderProgram::EncoderProgram(const py::object& runtime, std::shared_ptr<LinearLibrary> library)
    : library_(std::move(library)) {
  Record r(runtime, "encoding runtime");
  embed = r.tensor("embed").contiguous();
  embed_scale = r.number("embed_scale");
  padding_idx = r.integer("padding_idx");
  positions_padding_idx = r.integer("positions_padding_idx");
  embed_norm = Norm::from(r.optional_sub("embed_norm"));
  final_norm = Norm::from(r.optional_sub("final_norm"));
  for (const Record& layer : r.items("layers")) layers.push_back(EncoderLayerProgram::from(layer));
  TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == at::kFloat && embed.device().is_cpu(),
              "rfa encoder program: runtime.embed must be a (vocabulary, C) fp32 CPU tensor");
  for (const EncoderLayerProgram& layer : layers) {
    TORCH_CHECK(layer.heads * layer.head_dim == embed.size(1), "rfa encoder program: a layer of ", layer.heads,
                " heads of ", layer.head_dim, " on embeddings of ", embed.size(1));
  }
}

void EncoderProgram::check_encode(const at::Tensor& tokens, const at::Tensor& positions) const {
  TORCH_CHECK(tokens.defined() && tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.dim() == 2,
              "rfa encoder program: src_tokens must be a (batch, length) int64 CPU tensor");
  const int64_t V = embed.size(0), T = tokens.size(1);
  const at::Tensor flat = tokens.contiguous();
  const int64_t* p = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < V, "rfa encoder program: src_tokens[", i / T, ", ", i % T, "] = ", p[i],
                " is not in the source vocabulary (", V, ")");
  }
  if (positions.defined()) {
    TORCH_CHECK(positions.dim() == 2 && positions.size(1) == embed.size(1) && positions.device().is_cpu() &&
                    positions.scalar_type() == at::kFloat,
                "rfa encoder program: the position table must be a (positions, ", embed.size(1), ") fp32 CPU tensor");
    // make_positions numbers a sentence's tokens from positions_padding_idx + 1 on
    TORCH_CHECK(positions_padding_idx + T < positions.size(0), "rfa encoder program: a source of ", T,
                " tokens needs positions up to ", positions_padding_idx + T, ", the table has ", positions.size(0),
                " (--max-source-positions)");
  }
}

namespace {

// torch's LayerNorm, as fairseq's modules apply it (not the decoding step's add_layer_norm kernel: the encoder's
// output stays bit for bit fairseq's)
at::Tensor torch_layer_norm(const Norm& norm, const at::Tensor& x) {
  return at::layer_norm(x, {x.size(-1)}, norm.weight, norm.bias, norm.eps);
}

// fairseq's TransformerEncoderLayerBase.forward: x (T, B, C), key_padding_mask (B, T) bool or undefined -> the layer's output (T, B, C)
at::Tensor encoder_layer(const EncoderLayerProgram& layer, const LinearLibrary& lib, const at::Tensor& input,
                         const at::Tensor& key_padding_mask) {
  const int64_t T = input.size(0), B = input.size(1), C = input.size(2), H = layer.heads, d = layer.head_dim;
  const bool pre = layer.ffn.normalize_before;
  at::Tensor x = input.reshape({T * B, C});
  at::Tensor h = pre ? torch_layer_norm(layer.self_attn_norm, x) : x;
  at::Tensor qkv = lib.unrecorded_linear(layer.qkv, h, false, at::Tensor());
  std::vector<at::Tensor> heads = qkv.view({T, B, 3, H, d}).permute({2, 1, 3, 0, 4}).unbind(0);  // (B, H, T, d) each
  std::optional<at::Tensor> mask;
  if (key_padding_mask.defined()) mask = key_padding_mask.view({B, 1, 1, T}).logical_not();
  at::Tensor o = at::scaled_dot_product_attention(heads[0], heads[1], heads[2], mask);  // scale d^-0.5: fairseq's
  o = o.permute({2, 0, 1, 3}).reshape({T * B, C});
  x = lib.unrecorded_linear(layer.out_proj, o, false, x);
  if (!pre) x = torch_layer_norm(layer.self_attn_norm, x);
  const FeedForward& ffn = layer.ffn;
  h = pre ? torch_layer_norm(ffn.final_norm, x) : x;
  const bool relu = ffn.activation == kFFNReLU;
  at::Tensor hidden = lib.unrecorded_linear(ffn.fc1, h, relu, at::Tensor());
  if (!relu) hidden = at::gelu(hidden);
  x = lib.unrecorded_linear(ffn.fc2, hidden, false, x);
  if (!pre) x = torch_layer_norm(ffn.final_norm, x);
  return x.view({T, B, C});
}

}  // namespace

std::vector<at::Tensor> EncoderProgram::encode(const at::Tensor& tokens, const at::Tensor& positions) const {
  RECORD_FUNCTION("rfa::encoder", std::vector<c10::IValue>());
  at::Tensor padding_mask = tokens.eq(padding_idx);  // (B, T)
  const bool has_pads = padding_mask.any().item<bool>();
  // forward_embedding
  at::Tensor embedding = at::embedding(embed, tokens) * embed_scale;  // (B, T, C)
  at::Tensor x = embedding;
  if (positions.defined()) {  // fairseq's utils.make_positions, then the table's rows
    at::Tensor mask = tokens.ne(positions_padding_idx).to(at::kInt);
    at::Tensor index = (at::cumsum(mask, 1).to(at::kInt) * mask).to(at::kLong) + positions_padding_idx;
    x = embedding + at::embedding(positions, index);
  }
  if (embed_norm.defined()) x = torch_layer_norm(embed_norm, x);
  if (has_pads) x = x * (1 - padding_mask.unsqueeze(-1).to(x.scalar_type()));
  x = x.transpose(0, 1);  // (T, B, C)
  const at::Tensor key_padding_mask = has_pads ? padding_mask : at::Tensor();
  for (const EncoderLayerProgram& layer : layers) x = encoder_layer(layer, *library_, x, key_padding_mask);
  if (final_norm.defined()) x = torch_layer_norm(final_norm, x);
  at::Tensor src_lengths = padding_mask.logical_not().sum(1, false, at::kInt).reshape({-1, 1}).contiguous();
  return {x, padding_mask, embedding, src_lengths};
}

void bind_encoder_program(py::module_& m) {
  py::class_<EncoderProgram>(m, "EncoderProgram")
      .def(py::init<const py::object&, std::shared_ptr<LinearLibrary>>(), py::arg("runtime"), py::arg("library"))
      .def(
          "encode",
          [](const EncoderProgram& program, const at::Tensor& tokens, const std::optional<at::Tensor>& positions) {
            const at::Tensor table = positions.has_value() ? *positions : at::Tensor();
            program.check_encode(tokens, table);
            py::gil_scoped_release release;
            at::NoGradGuard no_grad;
            return program.encode(tokens, table);
          },
          py::arg("src_tokens"), py::arg("positions"),
          "fairseq's encoder output fields for src_tokens (decode_program.h): [encoder_out, encoder_padding_mask, "
          "encoder_embedding, src_lengths]");
}
