// program_parts.h: the parts of a layer both native programs read.
#include "program_parts.h"

int64_t ffn_activation_of(const Record& layer) {
  return code_of({{"relu", kFFNReLU}, {"gelu", kFFNGELU}}, layer.text("activation"), layer.path() + " activation");
}

FeedForward FeedForward::from(const Record& r) {
  FeedForward ffn;
  ffn.fc1 = LinearLayer::from(r.sub("fc1"));
  ffn.fc2 = LinearLayer::from(r.sub("fc2"));
  ffn.activation = ffn_activation_of(r);
  ffn.final_norm = Norm::from(r.optional_sub("final_norm"));
  ffn.normalize_before = r.flag("normalize_before");
  return ffn;
}

Norm Norm::from(const std::optional<Record>& r) {
  Norm norm;
  if (!r) return norm;
  norm.weight = r->tensor("weight").contiguous();
  norm.bias = r->tensor("bias").contiguous();
  norm.eps = r->number("eps");
  return norm;
}
