// The static beam search's step on the CPU (native_search.h): the decoder's step of the places still translating,
// then the log-softmax fused with the choice of the candidates (the log-probabilities are never written: each row's
// log-sum-exp is taken in one vectorized pass and the candidates are read off the logits), finalization and the
// reorder. Its region for torch's profiler is rfa::search (decode_program.cpp names the decoder's).
#include "native_search.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <variant>

#include "tensor_checks.h"

namespace py = pybind11;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using TensorPair = std::array<at::Tensor, 2>;
using Member = std::variant<TensorPair NativeSearch::*, at::Tensor NativeSearch::*, int64_t NativeSearch::*,
                            double NativeSearch::*>;
struct SearchField {
  const char* name;
  Member member;
  bool optional = false;  // a tensor that may be None
};

// The one declaration of the search record's fields: static_beam_search.py's NativeSearchRecord has exactly these
const std::vector<SearchField>& search_fields() {
  static const std::vector<SearchField> fields = {
      {"token_pair", &NativeSearch::tokens},
      {"score_pair", &NativeSearch::scores},
      {"cand_scores", &NativeSearch::cand_scores},
      {"cand_indices", &NativeSearch::cand_indices},
      {"cands_to_ignore", &NativeSearch::cands_to_ignore},
      {"finished", &NativeSearch::finished},
      {"fin_count", &NativeSearch::fin_count},
      {"fin_tokens", &NativeSearch::fin_tokens},
      {"fin_scores", &NativeSearch::fin_scores},
      {"fin_steps", &NativeSearch::fin_steps},
      {"order", &NativeSearch::order},
      {"step", &NativeSearch::step},
      {"step_rows", &NativeSearch::step_rows},
      {"eos_bias", &NativeSearch::eos_bias},
      {"positions", &NativeSearch::positions, true},
      {"prefix_tokens", &NativeSearch::prefix_tokens, true},
      {"vocabulary", &NativeSearch::vocabulary, true},
      {"no_repeat_ngram_size", &NativeSearch::no_repeat_ngram_size},
      {"sentences", &NativeSearch::sentences},
      {"beam", &NativeSearch::beam},
      {"eos", &NativeSearch::eos},
      {"pad", &NativeSearch::pad},
      {"unk", &NativeSearch::unk},
      {"unk_penalty", &NativeSearch::unk_penalty},
  };
  return fields;
}

std::string declared_fields() {
  std::string names;
  for (const SearchField& field : search_fields()) names += std::string(names.empty() ? "" : ", ") + field.name;
  return names;
}

}  // namespace

// ------------------------------------------------------------------------------------------------ the record

std::vector<std::string> NativeSearch::field_names() {
  std::vector<std::string> names;
  for (const SearchField& field : search_fields()) names.emplace_back(field.name);
  return names;
}

NativeSearch::NativeSearch(const py::handle& object) {
  TORCH_CHECK(py::hasattr(object, "__dict__"), "rfa native search: the search record is a ",
              py::str(py::type::of(object)).cast<std::string>(), ", not a record of fields (NativeSearchRecord)");
  const py::dict given = object.attr("__dict__");
  const auto& fields = search_fields();
  for (const auto& item : given) {
    const std::string name = py::str(item.first).cast<std::string>();
    const bool known = std::any_of(fields.begin(), fields.end(), [&](const SearchField& f) { return name == f.name; });
    TORCH_CHECK(known, "rfa native search: the search record has a field '", name,
                "' that the native search does not declare (it reads ", declared_fields(), ")");
  }
  const Record record(object, "search record");
  for (const SearchField& field : fields) {
    TORCH_CHECK(given.contains(field.name), "rfa native search: the search record has no field '", field.name,
                "' (the native search reads ", declared_fields(), ")");
    if (auto pair = std::get_if<TensorPair NativeSearch::*>(&field.member)) {
      const std::vector<at::Tensor> both = record.tensors(field.name);
      TORCH_CHECK(both.size() == 2, "rfa native search: search record.", field.name, " holds ", both.size(),
                  " tensors, not the 2 used in turn");
      this->*(*pair) = {both[0], both[1]};
    } else if (auto tensor = std::get_if<at::Tensor NativeSearch::*>(&field.member)) {
      this->*(*tensor) = field.optional ? record.optional_tensor(field.name) : record.tensor(field.name);
    } else if (auto integer = std::get_if<int64_t NativeSearch::*>(&field.member)) {
      this->*(*integer) = record.integer(field.name);
    } else {
      this->*std::get<double NativeSearch::*>(field.member) = record.number(field.name);
    }
  }
}

// ------------------------------------------------------------------------------------------------ checks

namespace {

// The logits' columns: the search's vocabulary (sorted distinct target ids), or every token (column v: token v)
struct Columns {
  const int64_t* ids = nullptr;  // nullptr: the full vocabulary
  int64_t size = 0;
  explicit Columns(const NativeSearch& s, int64_t vocab_size)
      : ids(s.vocabulary.defined() ? s.vocabulary.data_ptr<int64_t>() : nullptr),
        size(s.vocabulary.defined() ? s.vocabulary.numel() : vocab_size) {}
  int64_t token(int64_t column) const { return ids != nullptr ? ids[column] : column; }
  // the column of a target id, -1 where the vocabulary does not hold it
  int64_t of(int64_t token) const {
    if (ids == nullptr) return token;
    const int64_t* at = std::lower_bound(ids, ids + size, token);
    return at != ids + size && *at == token ? at - ids : -1;
  }
};

// the search's vocabulary, where it has one: sorted distinct ids of the model's vocabulary, holding the special tokens
// and every prefix token (the caller's union adds them: none is dropped)
void check_vocabulary(const DecodeProgram& program, const NativeSearch& s) {
  if (!s.vocabulary.defined()) return;
  const at::Tensor& ids = s.vocabulary;
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu() && ids.is_contiguous() &&
                  ids.numel() >= 1,
              "rfa search step: search.vocabulary must be a non-empty (U,) contiguous int64 CPU tensor");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t U = ids.numel(), V = program.vocab_size();
  for (int64_t c = 0; c < U; ++c) {
    TORCH_CHECK(id[c] >= 0 && id[c] < V && (c == 0 || id[c] > id[c - 1]), "rfa search step: search.vocabulary[", c,
                "] = ", id[c], ": the vocabulary must be sorted distinct ids of the model's ", V);
  }
  const Columns columns(s, V);
  for (const int64_t token : {s.eos, s.pad, s.unk}) {
    TORCH_CHECK(columns.of(token) >= 0, "rfa search step: search.vocabulary lacks the special token ", token);
  }
  if (s.prefix_tokens.defined()) {
    const at::Tensor prefix = s.prefix_tokens.contiguous();
    const int64_t* p = prefix.data_ptr<int64_t>();
    for (int64_t i = 0; i < prefix.numel(); ++i) {
      TORCH_CHECK(columns.of(p[i]) >= 0, "rfa search step: the prefix token ", p[i],
                  " is not in search.vocabulary (the batch's union must add its prefix tokens)");
    }
  }
}

// the search's buffers are fit for steps up to t
void check_search_buffers(const DecodeProgram& program, const NativeSearch& s, int64_t t, int64_t parity, bool first) {
  TORCH_CHECK(parity == 0 || parity == 1, "rfa search step: parity must be 0 or 1, got ", parity);
  check_vocabulary(program, s);
  const int64_t N = s.sentences, K = s.beam, R = N * K, V = Columns(s, program.vocab_size()).size;
  TORCH_CHECK(N >= 1 && K >= 1, "rfa search step: ", N, " places x ", K, " beams");
  expect(s.tokens[0], "search.token_pair[0]", at::kLong, {R, -1});
  const int64_t L = s.tokens[0].size(1);
  TORCH_CHECK(t >= 0 && t + 1 < L, "rfa search step: step ", t, " of a token buffer of length ", L);
  expect(s.tokens[1], "search.token_pair[1]", at::kLong, {R, L});
  expect(s.scores[0], "search.score_pair[0]", at::kFloat, {R, L - 1});
  expect(s.scores[1], "search.score_pair[1]", at::kFloat, {R, L - 1});
  const int64_t k = std::min(2 * K, (first ? V : K * V) - 1);
  TORCH_CHECK(k >= K, "rfa search step: ", k, " candidates for ", K, " beams (the vocabulary is too small)");
  expect(s.cand_scores, "search.cand_scores", at::kFloat, {N * k}, true);
  expect(s.cand_indices, "search.cand_indices", at::kLong, {N * k}, true);
  expect(s.cands_to_ignore, "search.cands_to_ignore", at::kBool, {N, K});
  expect(s.finished, "search.finished", at::kBool, {N});
  expect(s.fin_count, "search.fin_count", at::kLong, {N});
  expect(s.fin_tokens, "search.fin_tokens", at::kLong, {R, L}, true);
  expect(s.fin_scores, "search.fin_scores", at::kFloat, {R, L - 1}, true);
  expect(s.fin_steps, "search.fin_steps", at::kLong, {R}, true);
  expect(s.eos_bias, "search.eos_bias", at::kFloat, {t + 1}, true);
  expect(s.step, "search.step", at::kLong, {1});
  expect(s.step_rows, "search.step_rows", at::kLong, {L});
  if (s.positions.defined()) expect(s.positions, "search.positions", at::kFloat, {t + 1, program.model_dim()}, true);
  for (const int64_t token : {s.eos, s.pad, s.unk}) {
    TORCH_CHECK(token >= 0 && token < program.vocab_size(), "rfa search step: the special token ", token,
                " is not in the vocabulary");
  }
  const int64_t* fin = s.fin_count.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(fin[n] >= 0 && fin[n] <= K, "rfa search step: search.fin_count[", n, "] = ", fin[n], " of ", K);
  }
  expect(s.order, "search.order", at::kLong, {R}, true);
  if (s.prefix_tokens.defined()) expect(s.prefix_tokens, "search.prefix_tokens", at::kLong, {N, -1});
  TORCH_CHECK(s.no_repeat_ngram_size >= 0, "rfa search step: search.no_repeat_ngram_size = ", s.no_repeat_ngram_size,
              " is negative");
}

}  // namespace

void check_search_logits(const DecodeProgram& program, const NativeSearch& s, const at::Tensor& logits, int64_t t,
                         int64_t parity, bool first) {
  check_search_buffers(program, s, t, parity, first);
  expect(logits, "logits", at::kFloat, {-1, Columns(s, program.vocab_size()).size}, false, false);
}

void check_search(const DecodeProgram& program, const NativeBatch& batch, const NativeSearch& s, int64_t t0,
                  int64_t t_last, int64_t parity, bool first) {
  TORCH_CHECK(0 <= t0 && t0 <= t_last, "rfa search step: steps ", t0, " to ", t_last);
  check_search_buffers(program, s, t_last, parity, first);  // the sizes must hold up to the last step
  // the batch's output projection gives the vocabulary's columns (both or neither)
  TORCH_CHECK(s.vocabulary.defined() == batch.output.has_value() &&
                  (!batch.output || batch.output->out_features == s.vocabulary.numel()),
              "rfa search step: the batch's output projection has ",
              batch.output ? std::to_string(batch.output->out_features) + " columns" : std::string("no columns of its own"),
              ", the search's vocabulary ",
              s.vocabulary.defined() ? std::to_string(s.vocabulary.numel()) + " ids" : std::string("is the model's"));
  // the first step decodes one row per sentence (its beams are one hypothesis), with no state to reorder; later
  // steps read tokens and an order the steps before wrote
  const int64_t K = s.beam, R = s.sentences * K;
  const at::Tensor column = s.tokens[parity].select(1, t0);
  program.check_decode(batch, first ? column.slice(0, 0, R, K).contiguous() : column.contiguous(), at::Tensor(),
                       first ? at::Tensor() : s.order.narrow(0, 0, R), parity, first, at::Tensor(), first ? 1 : K);
  for (size_t i = 0; i < batch.states0.size(); ++i) {  // each place's rows keep their states (R rows at every step)
    TORCH_CHECK(batch.states0[i].size(0) >= R && batch.states1[i].size(0) >= R, "rfa search step: state.layers[", i,
                "] holds ", std::min(batch.states0[i].size(0), batch.states1[i].size(0)), " state rows for ", R);
  }
}

// ------------------------------------------------------------------------------------------------ the steps

std::vector<int64_t> live_places(const NativeSearch& s, bool first) {
  // the places still translating: a finished place finalizes nothing more, and its rows cost nothing (the batch keeps
  // its places to its end: no halving needed); the first step decodes every place (its rows are one per sentence)
  std::vector<int64_t> live;
  const bool* finished = s.finished.data_ptr<bool>();
  for (int64_t n = 0; n < s.sentences; ++n) {
    if (first || !finished[n]) live.push_back(n);
  }
  return live;
}

int64_t search_step(const DecodeProgram& program, const NativeBatch& batch, NativeSearch& s, int64_t t,
                    int64_t parity, bool first, bool last) {
  const int64_t N = s.sentences, K = s.beam, R = N * K;
  const at::Tensor& tokens = s.tokens[parity];
  at::Tensor position = s.positions.defined() ? s.positions.narrow(0, t, 1) : at::Tensor();
  // each live place decoded at its place among them (p), its states read and written at its own rows
  const std::vector<int64_t> live = live_places(s, first);
  const int64_t live_count = static_cast<int64_t>(live.size());
  if (live_count == 0) {
    s.step_rows.data_ptr<int64_t>()[t] = 0;
    s.step.fill_(t + 1);
    return N;
  }
  at::Tensor last_tokens, state_order, state_rows, sentences;
  if (first) {
    // the first step decodes one row per sentence: its beams are copies of one hypothesis (BOS, no state), and only
    // the first beam's candidates count; each row's state goes to its place's first row, which the reorder names
    last_tokens = tokens.select(1, t).slice(0, 0, R, K).contiguous();
    state_rows = at::arange(0, R, K, s.order.options());
  } else if (live_count == N) {
    last_tokens = tokens.select(1, t).contiguous();
    state_order = s.order.narrow(0, 0, R);
  } else {  // the live places' rows, packed: row p * K + b is place live[p]'s beam b, its state at that place's rows
    sentences = at::tensor(live, s.order.options());
    state_rows = (sentences.unsqueeze(1) * K + at::arange(K, s.order.options())).view(-1);
    last_tokens = tokens.select(1, t).index_select(0, state_rows);
    state_order = s.order.index_select(0, state_rows);
  }
  // the logits into this thread's buffer, grown on demand and kept: a step's largest tensor (R x V: 16 MB at 128 rows
  // and 32k entries) allocated and freed at every step would leave the allocator's heap fragmented (a higher peak)
  thread_local at::Tensor logits_buffer;
  const int64_t V = Columns(s, program.vocab_size()).size, rows = last_tokens.size(0);  // a shortlist: its columns
  if (!logits_buffer.defined() || logits_buffer.numel() < rows * V) {
    logits_buffer = at::Tensor();  // the old buffer freed before the new one is made
    logits_buffer = at::empty({rows * V}, tokens.options().dtype(at::kFloat));
  }
  const at::Tensor logits = program.decode(batch, last_tokens, position, state_order, parity, first, false,
                                           at::Tensor(), first ? 1 : K, sentences, state_rows,
                                           logits_buffer.narrow(0, 0, rows * V).view({rows, V}));
  s.step_rows.data_ptr<int64_t>()[t] = logits.size(0);
  return choose(program, s, logits, live, t, parity, first, last);
}

int64_t choose(const DecodeProgram& program, NativeSearch& s, const at::Tensor& logits,
               const std::vector<int64_t>& live, int64_t t, int64_t parity, bool first, bool last) {
  const int64_t N = s.sentences, K = s.beam, live_count = static_cast<int64_t>(live.size());
  at::Tensor& tokens = s.tokens[parity];
  at::Tensor& scores = s.scores[parity];
  at::Tensor& next_tokens = s.tokens[1 - parity];
  at::Tensor& next_scores = s.scores[1 - parity];
  const int64_t L = tokens.size(1);
  bool* finished = s.finished.data_ptr<bool>();
  const int64_t V = logits.size(1);  // the vocabulary's columns (a shortlist: fewer than the model's tokens)
  const Columns columns(s, program.vocab_size());
  const int64_t k = std::min(2 * K, (first ? V : K * V) - 1);  // -1: never pad (SequenceGenerator)
  const int64_t beams = first ? 1 : K;  // the first step: a sentence's beams are one hypothesis
  const float* lg = logits.data_ptr<float>();
  const int64_t ldl = logits.stride(0);
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* sc = scores.data_ptr<float>();
  int64_t* next_tok = next_tokens.data_ptr<int64_t>();
  float* next_sc = next_scores.data_ptr<float>();
  float* cand_scores = s.cand_scores.data_ptr<float>();
  int64_t* cand_indices = s.cand_indices.data_ptr<int64_t>();
  bool* ignore = s.cands_to_ignore.data_ptr<bool>();
  int64_t* fin_count = s.fin_count.data_ptr<int64_t>();
  int64_t* fin_tok = s.fin_tokens.data_ptr<int64_t>();
  float* fin_sc = s.fin_scores.data_ptr<float>();
  int64_t* fin_steps = s.fin_steps.data_ptr<int64_t>();
  int64_t* order = s.order.data_ptr<int64_t>();
  const float eos_bias = s.eos_bias.data_ptr<float>()[t];
  const float unk_penalty = static_cast<float>(s.unk_penalty);
  const int64_t eos = s.eos, pad = s.pad, Ls = L - 1;
  // the masks' tokens as columns of the logits (check_vocabulary: each is there)
  const int64_t eos_column = columns.of(eos), pad_column = columns.of(pad), unk_column = columns.of(s.unk);
  // prefix tokens (fairseq's --prefix-size, SequenceGenerator._prefix_tokens): at a step inside the prefix a place's
  // beams may only take its token there (none where the place's prefix has pad), and the minimum length's EOS mask is
  // off; a prefix that ends in EOS makes every beam of its place a copy of the first
  const bool prefix_step = s.prefix_tokens.defined() && t < s.prefix_tokens.size(1) && !last;
  const int64_t* prefix = prefix_step ? s.prefix_tokens.data_ptr<int64_t>() : nullptr;
  const int64_t prefix_len = prefix_step ? s.prefix_tokens.size(1) : 0;
  // --no-repeat-ngram-size n: a beam never takes a token that would repeat one of its n-grams (the n - 1 tokens it
  // ends with, followed by the token that followed them before), over its tokens so far, BOS included
  const int64_t ngram = s.no_repeat_ngram_size, check_from = t + 2 - ngram;

  const rfa::cpu::Kernels& kernels = program.kernels();
  RECORD_FUNCTION("rfa::search", std::vector<c10::IValue>());
  at::parallel_for(0, live_count, 1, [&](int64_t begin, int64_t end) {
    std::vector<char> eos_mask(k), ended(k);
    std::vector<int64_t> active(K);
    std::vector<float> row_max(beams), row_log_sum(beams), row_add(beams);
    std::vector<std::vector<int64_t>> banned(beams);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = live[p];
      const int64_t forced = prefix_step ? prefix[n * prefix_len + t] : pad;
      const int64_t forced_column = forced == pad ? pad_column : columns.of(forced);
      const bool copy_first_beam = forced == eos && !first;
      if (copy_first_beam) {  // the place's beams become copies of its first: tokens and scores so far, logits
        for (int64_t b = 1; b < K; ++b) {
          std::copy(tok + n * K * L, tok + n * K * L + t + 1, tok + (n * K + b) * L);
          std::copy(sc + n * K * Ls, sc + n * K * Ls + t, sc + (n * K + b) * Ls);
        }
      }
      // the logits of place p's beam b
      auto row = [&](int64_t b) { return lg + (first ? p : p * K + (copy_first_beam ? 0 : b)) * ldl; };
      // candidates: per beam, log_softmax(logits) with the masks (pad never, unk penalized, EOS only from the
      // minimum length and alone at the last step, the prefix's token alone, no repeated n-gram) plus the beam's
      // score so far; the k best over the beams
      for (int64_t b = 0; b < beams; ++b) {
        kernels.row_log_sum_exp(row(b), V, &row_max[b], &row_log_sum[b]);
        row_add[b] = first ? 0.0f : sc[(n * K + b) * Ls + t - 1];
        banned[b].clear();
        if (ngram > 0 && check_from >= 0) {
          const int64_t* history = tok + (n * K + b) * L;  // tokens 0 .. t
          const int64_t* tail = history + t + 2 - ngram;   // the last n - 1
          for (int64_t i = 0; i < check_from; ++i) {
            if (std::equal(tail, tail + ngram - 1, history + i)) banned[b].push_back(history[i + ngram - 1]);
          }
        }
      }
      // v: a column of the logits (token columns.token(v))
      auto value = [&](int64_t b, int64_t v) {
        if (v == pad_column || (last && v != eos_column) || (forced != pad && v != forced_column)) return kNegInf;
        float lp = (row(b)[v] - row_max[b]) - row_log_sum[b];
        if (!last) {
          if (v == unk_column) lp -= unk_penalty;
          if (v == eos_column && !prefix_step) lp += eos_bias;
        }
        if (!banned[b].empty() &&
            std::find(banned[b].begin(), banned[b].end(), columns.token(v)) != banned[b].end()) {
          return kNegInf;
        }
        return std::isnan(lp) ? kNegInf : lp + row_add[b];
      };
      // the block's largest logit bounds its candidates: the masks only lower a value, but for a negative unk
      // penalty (which raises <unk>)
      auto bound = [&](int64_t b, int64_t start, int64_t len) {
        const bool raises_unk = !last && unk_penalty < 0.0f && unk_column >= start && unk_column < start + len;
        return (kernels.block_max(row(b) + start, len) - row_max[b]) - row_log_sum[b] + row_add[b] -
               (raises_unk ? unk_penalty : 0.0f);
      };
      TopK best{cand_scores + n * k, cand_indices + n * k, k};
      sentence_candidates(best, beams, V, value, bound);
      const float* cs = cand_scores + n * k;
      const int64_t* ci = cand_indices + n * k;
      // EOS candidates (finite) end a hypothesis, but not those the last step's advance ignored, nor in a
      // sentence already finished
      for (int64_t j = 0; j < k; ++j) {
        const bool is_eos = ci[j] % V == eos_column && cs[j] != kNegInf;
        eos_mask[j] = is_eos && !(j < K && ignore[n * K + j]) && !finished[n];
        ended[j] = eos_mask[j] || (j < K && ignore[n * K + j]);
      }
      // finalize: the EOS hypotheses among the top K take the sentence's free slots (at most K), in order
      int64_t count = fin_count[n];
      bool any_eos = false;
      for (int64_t j = 0; j < K; ++j) {
        if (!eos_mask[j]) continue;
        any_eos = true;
        if (count >= K) continue;
        const int64_t slot = n * K + count++;
        const int64_t source = n * K + ci[j] / V;
        std::copy(tok + source * L, tok + source * L + t + 1, fin_tok + slot * L);
        fin_tok[slot * L + t + 1] = eos;
        std::copy(sc + source * Ls, sc + source * Ls + t, fin_sc + slot * Ls);
        fin_sc[slot * Ls + t] = cs[j];
        fin_steps[slot] = t;
      }
      fin_count[n] = count;
      if (count == K || (last && any_eos)) finished[n] = true;
      // advance: each beam continues with the next best candidate that does not end in EOS (EOS ones, and those
      // ignored, only when fewer than K remain: then ignored at the next step)
      int64_t taken = 0;
      for (int pass = 0; pass < 2 && taken < K; ++pass) {
        for (int64_t j = 0; j < k && taken < K; ++j) {
          if (static_cast<bool>(ended[j]) == (pass == 1)) active[taken++] = j;
        }
      }
      for (int64_t j = 0; j < K; ++j) {
        const int64_t c = active[j], row_j = n * K + j;
        ignore[row_j] = ended[c];
        const int64_t source = n * K + ci[c] / V;
        // the row of place n the beam continues (its state kept at that row)
        order[row_j] = source;
        std::copy(tok + source * L, tok + source * L + t + 1, next_tok + row_j * L);
        next_tok[row_j * L + t + 1] = columns.token(ci[c] % V);
        std::copy(sc + source * Ls, sc + source * Ls + t, next_sc + row_j * Ls);
        next_sc[row_j * Ls + t] = cs[c];
      }
    }
  });
  s.step.fill_(t + 1);
  return std::count(finished, finished + N, true);
}

SearchRun search_steps(const DecodeProgram& program, const NativeBatch& batch, NativeSearch& s, int64_t t0,
                       int64_t parity, int64_t last_step, int64_t max_len) {
  SearchRun run;
  for (int64_t t = t0;; ++t) {
    run.finished = search_step(program, batch, s, t, parity, t == 0, t >= max_len);
    run.last_step = t;
    run.steps += 1;
    parity ^= 1;
    if (t >= last_step || run.finished == s.sentences) return run;
  }
}
