// What the decoder's and the encoder's programs (decode_program.h, encoder_program.h) both read from their records:
// a layer norm and a feed-forward activation.
#pragma once
#include <torch/extension.h>

#include <optional>

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
