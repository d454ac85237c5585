// The static beam search's step on the CPU (native_search.cpp): the decoder's step (decode_program.h) of the places
// still translating, then the search's choice of candidates, finalization and reorder, the same arithmetic as the
// torch search (rfa_fairseq/generation/static_beam_search.py's _Search and StaticBeamSearchGenerator._step).
//
// The boundary with Python is typed. The search's buffers and constants come in one record
// (static_beam_search.py's NativeSearchRecord), whose fields NativeSearch declares once (native_search.cpp's table):
// it is read whole as the search is created, and a record with a field missing or one it does not know is refused
// there, naming the field. The rows' account (modules/decoding.py's BatchRows) stays Python's: a call takes its
// parity and says how many steps it ran (SearchRun), which the account applies.
//
// One meaning of a row's order: the search's `order` buffer says, for place n's beam b, which row of place n the
// hypothesis continues (order[n * K + b], a row n * K + b' of the step before), and the causal state of place n's beam
// b is kept at row n * K + b of the state buffers, as the torch search keeps them. A step decodes only the places still
// translating, their rows packed for the products; their states are read and written at their places' rows.
#pragma once
#include <pybind11/pybind11.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "decode_program.h"

// The static beam search's buffers for N places of K beams (R = N * K rows, L tokens a row) and its constants, read
// from its record (NativeSearchRecord, one field each, declared in native_search.cpp's table)
struct NativeSearch {
  std::array<at::Tensor, 2> tokens;  // token_pair: (R, L) int64, used in turn (the rows' parity names the one read)
  std::array<at::Tensor, 2> scores;  // score_pair: (R, L - 1) fp32 cumulative, likewise
  at::Tensor cand_scores, cand_indices;  // (>= N * 2K)
  at::Tensor cands_to_ignore;            // (N, K) bool
  at::Tensor finished;                   // (N,) bool
  at::Tensor fin_count;                  // (N,) int64
  at::Tensor fin_tokens, fin_scores, fin_steps;  // (>= N * K, L), (>= N * K, L - 1), (>= N * K,)
  at::Tensor order;      // (R,) int64: the rows' order buffer: place n's beam b continues row order[n * K + b] of place n
  at::Tensor step;       // (1,) int64: the step number, set to t + 1 after step t (the torch steps read it)
  at::Tensor step_rows;  // (L,) int64: the rows step t decoded, written at t (profiles read it)
  at::Tensor eos_bias;   // (>= max_len + 1,) fp32: -inf before the minimum length
  at::Tensor positions;  // (>= max_len + 1, C) or undefined
  at::Tensor prefix_tokens;  // (N, P) int64 prefix tokens (pad: none at that step), or undefined
  // (U,) int64 sorted distinct target ids, the logits' columns (a vocabulary shortlist: the batch's output projection
  // is these rows, NativeBatch::output), or undefined: column v is token v. Candidates are columns, mapped back to ids
  // as the tokens are written; the masks' ids (pad, unk, EOS, a prefix's token, a repeated n-gram's) are found among
  // them
  at::Tensor vocabulary;
  int64_t no_repeat_ngram_size = 0;  // --no-repeat-ngram-size (0: off)
  int64_t sentences = 0, beam = 1;   // N places of K beams
  int64_t eos = 2, pad = 1, unk = 3;
  double unk_penalty = 0.0;

  // reads the record's every field; a field missing, or one more than the table declares, is an error naming it
  explicit NativeSearch(const pybind11::handle& record);
  // the record's fields, as the table declares them
  static std::vector<std::string> field_names();
};

// What a run of search steps did: the last step run, the places finished after it, and how many steps ran (the rows'
// account turns its parity once per step: BatchRows.steps_ran)
struct SearchRun {
  int64_t last_step = -1, finished = 0, steps = 0;
};

// the places a step decodes: every place at the first step, else those not finished
std::vector<int64_t> live_places(const NativeSearch& search, bool first);

// The search's whole step t, reading the token / score pair and the causal states of parity `parity` and writing the
// other: decode the live places' rows (packed; the first step one row per place, its beams being one hypothesis),
// then choose. -> how many places have finished (search.finished).
int64_t search_step(const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, int64_t t,
                    int64_t parity, bool first, bool last);
// The search's part of step t on the logits (live.size() places' rows, packed as search_step packs them) of the places
// `live`: log-softmax with the masks (min length, unk, prefix, repeated n-grams, EOS alone at the last step), the 2K
// best candidates per place, finalization and the reorder into the other pair and the order buffer. -> finished places
int64_t choose(const DecodeProgram& program, NativeSearch& search, const at::Tensor& logits,
               const std::vector<int64_t>& live, int64_t t, int64_t parity, bool first, bool last);
// search_step at t = t0, t0 + 1, ... (the first step at t = 0; the last, EOS only, at t = max_len), the pairs turning
// after each, until every place has finished or step `last_step` ran: a batch's whole search in one call, without
// Python (or the GIL) between its steps (each step decodes only the places still translating, so the batch never
// halves).
SearchRun search_steps(const DecodeProgram& program, const NativeBatch& batch, NativeSearch& search, int64_t t0,
                       int64_t parity, int64_t last_step, int64_t max_len);

// the search's buffers are fit for its steps t0 .. t_last (the tokens read at t0 from pair `parity`)
void check_search(const DecodeProgram& program, const NativeBatch& batch, const NativeSearch& search, int64_t t0,
                  int64_t t_last, int64_t parity, bool first);
// the search's buffers are fit for steps up to t, and `logits` for choose at step t
void check_search_logits(const DecodeProgram& program, const NativeSearch& search, const at::Tensor& logits, int64_t t,
                         int64_t parity, bool first);
