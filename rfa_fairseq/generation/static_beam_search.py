"""Beam search over fixed-shape buffers for one `rfa_transformer`: fairseq's SequenceGenerator with
BeamSearch, step for step, with the batch's shape changing at most log2(N) times.

An RFA decoder's state has a fixed size, so nothing in a step needs to change shape when sentences
finish: finished sentences stay in the batch, masked (they finalize nothing more), and the buffers of
the search (tokens, cumulative scores, candidates) keep their shape from step to step. Only when half
the sentences in the batch have finished does the batch halve (their rows would otherwise cost every
later step: one long sentence keeps a batch going), so a batch sees at most log2(N) + 1 shapes where
SequenceGenerator shrinks it at every step that finishes a sentence. The decoding itself is the model's
one decoding path (`RFATransformerDecoder.forward` with an incremental state, then
`get_normalized_probs`), called as fairseq's EnsembleModel calls it for a single model.

The arithmetic follows SequenceGenerator._generate and search.BeamSearch.step operation by operation
(same masks, same fp32 additions, same top-k over 2 * beam candidates, same finalization and length
normalization), so hypotheses and scores agree with fairseq's. Shapes: N places (sentences still in the
batch), K beams, R = N * K rows, V the vocabulary.
"""
import math
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn
from fairseq.ngram_repeat_block import NGramRepeatBlock

from ..modules.decoding import DecodeState


class StaticBeamSearchGenerator(nn.Module):
    """SequenceGenerator's beam search for a single RFATransformerModel (`generate` returns what
    SequenceGenerator.generate returns). Built by `generation.build_generator` only for options it
    serves: plain beam search, lenpen, min/max length, unkpen, no-repeat n-grams, prefix tokens."""

    def __init__(self, model, tgt_dict, beam_size=1, max_len_a=0, max_len_b=200, max_len=0, min_len=1,
                 normalize_scores=True, len_penalty=1.0, unk_penalty=0.0, no_repeat_ngram_size=0,
                 symbols_to_strip_from_output=None):
        super().__init__()
        self.model = model
        self.tgt_dict = tgt_dict
        self.pad, self.unk, self.eos = tgt_dict.pad(), tgt_dict.unk(), tgt_dict.eos()
        self.symbols_to_strip_from_output = set(symbols_to_strip_from_output or ()) | {self.eos}
        self.vocab_size = len(tgt_dict)
        self.beam_size = min(beam_size, self.vocab_size - 1)  # pad is never chosen (as SequenceGenerator)
        if self.beam_size > 1:
            model.set_beam_size(self.beam_size)  # cross-attention K/V once per sentence
        self.max_len_a, self.max_len_b, self.min_len = max_len_a, max_len_b, min_len
        self.max_len = max_len or model.max_decoder_positions()
        self.normalize_scores, self.len_penalty, self.unk_penalty = normalize_scores, len_penalty, unk_penalty
        self.repeat_ngram_blocker = NGramRepeatBlock(no_repeat_ngram_size) if no_repeat_ngram_size > 0 else None
        self.model.eval()
        self._prepare_weights()

    @torch.no_grad()
    def _prepare_weights(self) -> None:
        """The encoder and one decoding step on a one-token source: the layers pack their weights for the
        kernels now, as the generator is built (CTranslate2 prepares its weights when it loads a model), not
        inside the first batch's translation."""
        weight = self.model.decoder.embed_tokens.weight
        src_tokens = torch.full((1, 1), self.eos, dtype=torch.long, device=weight.device)
        encoder_out = self.model.encoder.forward_torchscript(
            {"src_tokens": src_tokens, "src_lengths": torch.ones(1, dtype=torch.long, device=weight.device)})
        rows = torch.zeros(self.beam_size, dtype=torch.long, device=weight.device)
        encoder_out = self.model.encoder.reorder_encoder_out(encoder_out, rows)
        self._log_probs(torch.full((self.beam_size, 1), self.eos, dtype=torch.long, device=weight.device), encoder_out, {})

    @torch.no_grad()
    def generate(self, models, sample: Dict[str, Dict[str, Tensor]], prefix_tokens: Optional[Tensor] = None,
                 constraints: Optional[Tensor] = None, bos_token: Optional[int] = None) -> List[List[Dict[str, Tensor]]]:
        """SequenceGenerator.generate's signature and result (`models` is ignored: the model is fixed)."""
        if constraints is not None:
            raise NotImplementedError("the static beam search takes no constraints (build_generator falls back)")
        src_tokens = sample["net_input"]["src_tokens"]
        N, src_len = src_tokens.shape[:2]
        K, V, device = self.beam_size, self.vocab_size, src_tokens.device
        max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"

        encoder_out = self.model.encoder.forward_torchscript(sample["net_input"])
        rows_of_sentences = torch.arange(N, device=device).repeat_interleave(K)  # (R,): each sentence K times
        encoder_out = self.model.encoder.reorder_encoder_out(encoder_out, rows_of_sentences)
        search = _SearchBuffers(N, K, V, max_len, self.pad, self.eos if bos_token is None else bos_token, device)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(N)]
        sentence_ids = list(range(N))  # the batch's sentence at each place of the search (places only halve)
        finished = torch.zeros(N, dtype=torch.bool, device=device)  # (N,)
        incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
        reorder: Optional[Tensor] = None
        kernels = None

        for step in range(max_len + 1):  # one extra step for EOS
            if reorder is not None:
                # rows move within their sentence's beams or leave with it, and the decoder reads the
                # encoder output at its first step only: the encoder output needs no reorder
                self.model.decoder.reorder_incremental_state_scripting(incremental_state, reorder)
            lprobs = self._log_probs(search.tokens[:, : step + 1], encoder_out, incremental_state)  # (R, V)
            self._mask_log_probs(lprobs, step, max_len)
            if prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len:
                self._force_prefix(lprobs, step, prefix_tokens, search)
            elif step < self.min_len:
                lprobs[:, self.eos] = -math.inf  # minimum length (not with prefix tokens)
            if self.repeat_ngram_blocker is not None:
                lprobs = self.repeat_ngram_blocker(search.tokens, lprobs, search.N, K, step)

            if kernels is None:  # the kernels the decoder picked for this batch
                kernels = incremental_state[DecodeState.KEY]["state"].kernels
            cand_scores, cand_tokens, cand_rows = search.candidates(lprobs, step, kernels)  # (N, 2K) each
            eos_mask = cand_tokens.eq(self.eos) & cand_scores.ne(-math.inf)  # (N, 2K)
            eos_mask[:, :K] &= ~search.cands_to_ignore
            eos_mask &= ~finished.unsqueeze(1)  # finished sentences stay in the batch, finalizing nothing
            finalized_some = bool(eos_mask[:, :K].any())
            if finalized_some:
                self._finalize(step, eos_mask[:, :K], cand_rows[:, :K], cand_scores[:, :K], search, finalized,
                               sentence_ids, finished, max_len)
                if bool(finished.all()):
                    break
            if step >= max_len:
                break
            kept_rows = None
            if finalized_some and 2 * int((~finished).sum()) <= search.N:
                # half the places finished: halve the batch. Finished sentences otherwise cost every later
                # step all their rows (fairseq-generate was 17-35 % slower than SequenceGenerator on Multi30k
                # without this); halving keeps the shapes to log2(N) + 1 sizes
                kept = (~finished).nonzero().squeeze(1)  # (N',)
                eos_mask, cand_scores, cand_tokens, cand_rows, kept_rows = search.keep_sentences(
                    kept, eos_mask, cand_scores, cand_tokens, cand_rows)
                finished = finished.index_select(0, kept)
                sentence_ids = [sentence_ids[n] for n in kept.tolist()]
                if prefix_tokens is not None:
                    prefix_tokens = prefix_tokens.index_select(0, kept)
            reorder = search.advance(eos_mask, cand_scores, cand_tokens, cand_rows, step)
            if kept_rows is not None:  # the decoder's rows are still the old places'
                reorder = kept_rows.index_select(0, reorder)

        for n, hypos in enumerate(finalized):  # best first, as SequenceGenerator sorts them
            scores = torch.tensor([float(h["score"].item()) for h in hypos])
            _, best_first = torch.sort(scores, descending=True)
            finalized[n] = [hypos[i] for i in best_first]
        return finalized

    def _log_probs(self, tokens: Tensor, encoder_out, incremental_state) -> Tensor:
        """The decoder's step and fp32 log-softmax, as fairseq's EnsembleModel.forward_decoder does for one
        model at temperature 1. -> (R, V), a buffer of the decoder's workspace."""
        logits, extra = self.model.decoder.forward(tokens, encoder_out=encoder_out, incremental_state=incremental_state)
        return self.model.get_normalized_probs((logits[:, -1:, :], extra), log_probs=True, sample=None)[:, -1, :]

    def _mask_log_probs(self, lprobs: Tensor, step: int, max_len: int) -> None:
        """Pad, unk penalty and the maximum length, in SequenceGenerator's order; in place."""
        lprobs[:, self.pad] = -math.inf  # NaN: -inf in the candidates kernel
        lprobs[:, self.unk] -= self.unk_penalty
        if step >= max_len:  # only EOS is left
            lprobs[:, : self.eos] = -math.inf
            lprobs[:, self.eos + 1:] = -math.inf

    def _force_prefix(self, lprobs: Tensor, step: int, prefix_tokens: Tensor, search: "_SearchBuffers") -> None:
        """SequenceGenerator._prefix_tokens over the whole batch: a row whose prefix has a token at `step`
        may only choose it; a sentence whose prefix ends (EOS) gets its first beam copied to every beam."""
        K = self.beam_size
        forced = prefix_tokens[:, step].repeat_interleave(K).unsqueeze(1)  # (R, 1)
        forced_lprobs = lprobs.gather(1, forced)
        lprobs.masked_fill_(forced.ne(self.pad), -math.inf)
        lprobs.scatter_(1, forced, forced_lprobs)  # rows without a prefix token scatter pad's -inf onto itself
        ends = forced.view(-1, K)[:, 0].eq(self.eos)  # (N,)
        if bool(ends.any()):
            for tensor in (search.tokens, search.scores, lprobs):
                beams = tensor.view(-1, K, tensor.size(-1))
                beams[ends] = beams[ends][:, :1, :]

    def _finalize(self, step: int, eos_mask: Tensor, eos_rows: Tensor, eos_scores: Tensor,
                  search: "_SearchBuffers", finalized, sentence_ids: List[int], finished: Tensor, max_len: int) -> None:
        """SequenceGenerator.finalize_hypos: the hypotheses ending in EOS among each sentence's top K
        candidates join `finalized` (at most K per sentence), with per-position and normalized scores.
        eos_mask, eos_rows, eos_scores: (N, K); place n holds the batch's sentence sentence_ids[n]."""
        rows = eos_rows.masked_select(eos_mask)  # (E,), sentence-major as SequenceGenerator's
        scores = eos_scores.masked_select(eos_mask)  # (E,)
        tokens = search.tokens.index_select(0, rows)[:, 1: step + 2]  # (E, step + 1), without the BOS
        tokens[:, step] = self.eos
        positional = search.scores.index_select(0, rows)[:, : step + 1]
        positional[:, step] = scores
        positional[:, 1:] = positional[:, 1:] - positional[:, :-1]  # cumulative -> per position
        if self.normalize_scores:
            scores /= (step + 1) ** self.len_penalty
        places: List[int] = torch.div(rows, self.beam_size, rounding_mode="trunc").tolist()
        # one view per hypothesis from one call each (indexing hypothesis by hypothesis costs more)
        hypotheses = zip(places, tokens.unbind(0), scores.unbind(0), positional.unbind(0))
        for place, hypo_tokens, score, hypo_positional in hypotheses:
            n = sentence_ids[place]
            if len(finalized[n]) < self.beam_size:
                # no attention weights or alignment: fairseq's empty tensors, one shared (--print-alignment
                # falls back to SequenceGenerator)
                finalized[n].append({"tokens": hypo_tokens, "score": score, "attention": search.empty,
                                     "alignment": search.empty, "positional_scores": hypo_positional})
        for place in set(places):  # SequenceGenerator.is_finished
            if len(finalized[sentence_ids[place]]) == self.beam_size or step == max_len:
                finished[place] = True


class _SearchBuffers:
    """Tokens, cumulative scores and candidates of one batch's beam search, allocated once per batch shape
    (`keep_sentences` halves it). Two token and score buffers are used in turn: a step's reorder reads
    one and writes the other."""

    def __init__(self, N: int, K: int, V: int, max_len: int, pad: int, bos: int, device):
        self.N, self.K, self.V = N, K, V
        self.cand_size = 2 * K  # 2 x beam in case half are EOS (SequenceGenerator)
        self.tokens = torch.full((N * K, max_len + 2), pad, dtype=torch.long, device=device)  # +2: BOS and EOS
        self.tokens[:, 0] = bos
        self.scores = torch.zeros(N * K, max_len + 1, device=device)  # +1 for EOS
        self.spare_tokens, self.spare_scores = torch.empty_like(self.tokens), torch.empty_like(self.scores)
        self.cand_scores = torch.empty(N * self.cand_size, device=device)  # (N, 2K) at most, flat
        self.cand_indices = torch.empty(N * self.cand_size, dtype=torch.long, device=device)
        self.row_offsets = (torch.arange(N, device=device) * K).unsqueeze(1)  # (N, 1): first row of a sentence
        self.cand_offsets = torch.arange(self.cand_size, device=device)  # (2K,)
        self.cands_to_ignore = torch.zeros(N, K, dtype=torch.bool, device=device)
        self.empty = torch.empty(0)  # a finalized hypothesis' attention and alignment

    def candidates(self, lprobs: Tensor, step: int, kernels):
        """search.BeamSearch.step: the top 2K (cumulative score, token, row) per sentence, best first
        (kernels.beam_candidates). lprobs (R, V)."""
        N, K, V = self.N, self.K, self.V
        k = min(self.cand_size, (V if step == 0 else K * V) - 1)  # -1: never pad (SequenceGenerator)
        cand_scores, flat = self.cand_scores[: N * k].view(N, k), self.cand_indices[: N * k].view(N, k)
        prev_scores = self.scores[:, step - 1] if step > 0 else None  # (R,)
        kernels.beam_candidates(lprobs, prev_scores, K, cand_scores, flat)
        cand_beams = torch.div(flat, V, rounding_mode="trunc")
        return cand_scores, flat.fmod(V), cand_beams + self.row_offsets

    def keep_sentences(self, kept: Tensor, eos_mask: Tensor, cand_scores: Tensor, cand_tokens: Tensor,
                       cand_rows: Tensor):
        """Keep only the places `kept` (N',): the buffers shrink, and this step's candidates follow.
        -> the candidates of the kept places, and the old rows of the new rows (N' * K,)."""
        K = self.K
        old_rows = (kept.unsqueeze(1) * K + torch.arange(K, device=kept.device)).view(-1)  # (N'K,)
        cand_beams = (cand_rows - self.row_offsets).index_select(0, kept)
        self.N = kept.numel()
        self.tokens, self.scores = self.tokens.index_select(0, old_rows), self.scores.index_select(0, old_rows)
        self.spare_tokens, self.spare_scores = torch.empty_like(self.tokens), torch.empty_like(self.scores)
        self.row_offsets = self.row_offsets[: self.N]
        self.cands_to_ignore = self.cands_to_ignore.index_select(0, kept)
        return (eos_mask.index_select(0, kept), cand_scores.index_select(0, kept), cand_tokens.index_select(0, kept),
                cand_beams + self.row_offsets, old_rows)

    def advance(self, eos_mask: Tensor, cand_scores: Tensor, cand_tokens: Tensor, cand_rows: Tensor, step: int) -> Tensor:
        """Continue each sentence with its K best candidates that do not end in EOS (SequenceGenerator's
        active hypotheses): tokens and scores follow their rows. -> the rows' new order (R,)."""
        K, cand = self.K, eos_mask.size(1)
        eos_mask[:, :K] |= self.cands_to_ignore
        # EOS candidates sort after every other: the K smallest are the best non-EOS ones
        active_key = eos_mask.long() * self.cand_size + self.cand_offsets[:cand]  # (N, 2K)
        ignored_key, active = torch.topk(active_key, k=K, dim=1, largest=False)  # (N, K)
        self.cands_to_ignore = ignored_key.ge(self.cand_size)
        order = torch.gather(cand_rows, 1, active).view(-1)  # (R,)
        torch.index_select(self.tokens, 0, order, out=self.spare_tokens)
        torch.index_select(self.scores, 0, order, out=self.spare_scores)
        self.tokens, self.spare_tokens = self.spare_tokens, self.tokens
        self.scores, self.spare_scores = self.spare_scores, self.scores
        self.tokens.view(self.N, K, -1)[:, :, step + 1] = torch.gather(cand_tokens, 1, active)
        self.scores.view(self.N, K, -1)[:, :, step] = torch.gather(cand_scores, 1, active)
        return order
