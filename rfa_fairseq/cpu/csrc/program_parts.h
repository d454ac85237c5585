// What the decoder's and the encoder's programs (decode_program.h, encoder_program.h) both read from their records:
// a layer norm and a feed-forward activation.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "linear_layers.h"
#include "records.h"

enum FFNActivation : int64_t { kFFNReLU = 0, kFFNGELU = 1 };
// a layer record's FFN activation ("relu", "gelu") as its FFNActivation, or an error naming the record
int64_t ffn_activation_of(const Record& layer);

struct Norm {  // NormRecord, or none
  at::Tensor weight, bias;  // undefined: no norm
  double eps = 1e-5;
  bool defined() const { return weight.defined(); }
  static Norm from(const std::optional<Record>& record);
};

// A layer's feed-forward sublayer and what both programs read with it: fc1, its activation, fc2, the norm after (or,
// pre-norm, before) it and whether the layer normalizes before its sublayers (the record's fields of these names)
struct FeedForward {
  LinearLayer fc1, fc2;
  int64_t activation = kFFNReLU;
  Norm final_norm;
  bool normalize_before = false;
  static FeedForward from(const Record& layer);
};
