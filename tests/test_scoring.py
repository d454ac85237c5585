"""Tests of rfa_fairseq.cli.scoring: sacreBLEU/chrF scoring, compound-split BLEU and
extraction of hypotheses from fairseq-generate output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu

from rfa_fairseq.cli import scoring

REPO = Path(__file__).resolve().parents[1]

HYPS = [
    "The cat sat on the mat.",
    "A state-of-the-art model translated it quickly.",
    "He went to the market yesterday",
    "Nothing matches here at all",
]
REFS = [
    "The cat sat on the mat.",
    "A state-of-the-art system translated it fast.",
    "He went to the market yesterday.",
    "Completely different reference sentence.",
]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_identical_files_score_100(tmp_path):
    hyp = write(tmp_path / "hyp.txt", REFS)
    ref = write(tmp_path / "ref.txt", REFS)
    scores = scoring.run(scoring.build_parser().parse_args(["--hyp", hyp, "--ref", ref]))
    assert scores["bleu"]["score"] == pytest.approx(100.0)
    assert scores["chrf"]["score"] == pytest.approx(100.0)


def test_bleu_and_chrf_equal_sacrebleu_corpus_scores(tmp_path, capsys):
    hyp = write(tmp_path / "hyp.txt", HYPS)
    ref = write(tmp_path / "ref.de", REFS)
    out_json = tmp_path / "scores" / "test.json"
    assert scoring.main(["--hyp", hyp, "--ref", ref, "--json", str(out_json)]) == 0
    expected_bleu = sacrebleu.corpus_bleu(HYPS, [REFS])
    expected_chrf = sacrebleu.corpus_chrf(HYPS, [REFS])
    data = json.loads(out_json.read_text())
    assert data["bleu"]["score"] == pytest.approx(expected_bleu.score)
    assert 0 < data["bleu"]["score"] < 100
    assert data["chrf"]["score"] == pytest.approx(expected_chrf.score)
    assert data["bleu"]["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    assert data["num_sentences"] == 4 and data["compound_split_bleu"] is None
    printed = capsys.readouterr().out
    assert data["bleu"]["signature"] in printed and f"{expected_bleu.score:6.2f}" in printed


def test_compound_split_rule():
    assert scoring.compound_split("a-b") == "a ##AT##-##AT## b"
    assert scoring.compound_split("Wort-Spiel und Bahn-Hof") == "Wort ##AT##-##AT## Spiel und Bahn ##AT##-##AT## Hof"
    # Like the perl regex: a hyphen needs a non-space on both sides, and matches do not overlap.
    assert scoring.compound_split("a - b") == "a - b"
    assert scoring.compound_split("-a b-") == "-a b-"
    assert scoring.compound_split("x-y-z") == "x ##AT##-##AT## y-z"


def test_compound_split_bleu_is_tokenized_bleu_of_split_text(tmp_path):
    hyps = ["Die Nord-Süd-Verbindung ist fertig.", "Ein gut-gemeinter Rat, nicht wahr?"]
    refs = ["Die Nord-Süd-Bahn ist fertig.", "Ein gut-gemeinter Vorschlag, nicht wahr?"]
    hyp = write(tmp_path / "hyp.txt", hyps)
    ref = write(tmp_path / "test.raw.de", refs)  # language taken from the extension
    scores = scoring.run(scoring.build_parser().parse_args(["--hyp", hyp, "--ref", ref, "--compound-split"]))
    split = scores["compound_split_bleu"]
    assert split["moses_lang"] == "de"
    # Independent re-computation: Moses tokens, perl-style compound split, no further tokenization.
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang="de")
    split_hyps = [scoring.compound_split(tok.tokenize(h, return_str=True, escape=False)) for h in hyps]
    split_refs = [scoring.compound_split(tok.tokenize(r, return_str=True, escape=False)) for r in refs]
    assert split_hyps[1] == "Ein gut ##AT##-##AT## gemeinter Rat , nicht wahr ?"
    expected = sacrebleu.corpus_bleu(split_hyps, [split_refs], tokenize="none", force=True)
    assert split["score"] == pytest.approx(expected.score)
    assert "tok:none" in split["signature"]
    assert split["score"] != pytest.approx(scores["bleu"]["score"])  # splitting changes the n-grams


def test_mismatched_line_counts_name_both_files(tmp_path, capsys):
    hyp = write(tmp_path / "hyp.txt", HYPS[:3])
    ref = write(tmp_path / "ref.txt", REFS)
    assert scoring.main(["--hyp", hyp, "--ref", ref]) == 1
    err = capsys.readouterr().err
    assert f"hypotheses {hyp} has 3 lines, reference {ref} has 4 lines" in err


def test_missing_file_is_named(tmp_path, capsys):
    ref = write(tmp_path / "ref.txt", REFS)
    missing = tmp_path / "nope.txt"
    assert scoring.main(["--hyp", str(missing), "--ref", ref]) == 1
    assert f"hypothesis file not found: {missing}" in capsys.readouterr().err


def test_carriage_return_inside_a_line_does_not_split_it(tmp_path):
    hyp = tmp_path / "hyp.txt"
    hyp.write_bytes("a\rb\u2028c\nsecond\n".encode("utf-8"))
    assert scoring.read_lines(str(hyp), "hypothesis") == ["a\rb\u2028c", "second"]


GENERATE_OUTPUT = """\
2026-01-01 | INFO | fairseq_cli.generate | loading model(s)
S-2\t\u2581das \u2581ist \u2581drei
T-2\t\u2581this \u2581is \u2581three
H-2\t-0.41\t\u2581this \u2581is \u2581th ree
D-2\t-0.41\tthis is three
P-2\t-0.1 -0.2 -0.3 -0.4
S-0\t\u2581null
T-0\t\u2581zero
H-0\t-0.10\t\u2581zero
H-0\t-0.90\t\u2581nothing
D-0\t-0.10\tzero
D-0\t-0.90\tnothing
S-1\t\u2581eins \u2581,\u2581zwei
H-1\t-1.5\t
D-1\t-1.5\t
2026-01-01 | INFO | fairseq_cli.generate | Translated 3 sentences
"""


def test_generate_output_parsing_sorts_ids_and_takes_best(tmp_path):
    gen = tmp_path / "gen.out"
    gen.write_text(GENERATE_OUTPUT, encoding="utf-8")
    # D lines (detokenized by --post-process) are preferred; best of the n-best; empty hypothesis kept.
    assert scoring.extract_hypotheses(str(gen)) == ["zero", "", "this is three"]
    # H lines are SentencePiece pieces: decoded with the marker rule (or the model).
    assert scoring.extract_hypotheses(str(gen), field="H") == ["zero", "", "this is three"]


def test_generate_output_decoded_with_spm_model(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    write(corpus, ["this is three", "zero one two three", "this is zero"] * 30)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=20,
                                   minloglevel=2, hard_vocab_limit=False)
    model = str(tmp_path / "spm.model")
    processor = spm.SentencePieceProcessor(model_file=model)
    sentences = ["this is three", "zero one"]
    lines = [f"H-{i}\t-0.5\t{' '.join(processor.encode(s, out_type=str))}" for i, s in enumerate(sentences)]
    gen = tmp_path / "gen.out"
    write(gen, lines)
    save = tmp_path / "hyp.txt"
    assert scoring.main(["--generate-output", str(gen), "--spm-model", model,
                         "--save-hyp", str(save), "--extract-only"]) == 0
    assert save.read_text(encoding="utf-8").splitlines() == sentences


def test_generate_output_with_missing_ids_is_rejected(tmp_path, capsys):
    gen = tmp_path / "gen.out"
    write(gen, ["H-0\t-0.1\ta", "H-2\t-0.1\tc"])
    ref = write(tmp_path / "ref.txt", ["a", "b", "c"])
    assert scoring.main(["--generate-output", str(gen), "--ref", ref]) == 1
    assert "no hypothesis for 1 sentence id(s): 1" in capsys.readouterr().err


def test_module_cli_runs(tmp_path):
    hyp = write(tmp_path / "hyp.txt", HYPS)
    ref = write(tmp_path / "ref.txt", REFS)
    proc = subprocess.run([sys.executable, "-m", "rfa_fairseq.cli.scoring", "--hyp", hyp, "--ref", ref],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{sacrebleu.corpus_bleu(HYPS, [REFS]).score:6.2f}" in proc.stdout
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "score.sh"), "--hyp", hyp, "--ref", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and "reference file not found" in proc.stderr
