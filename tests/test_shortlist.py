"""The vocabulary shortlist (rfa_fairseq/shortlist.py, rfa-build-shortlist): IBM Model 1 against a plain reference,
the file's round trip and refusals, a batch's union against a plain set union, the command end to end on a
synthetic data-bin, the CTranslate2 vocabulary map and CTranslate2 reading it."""
import importlib.util
import itertools
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from cli_support import run, synthetic_data
from conftest import REPO
from helpers import make_dictionary
from rfa_fairseq import shortlist
from rfa_fairseq.shortlist import Sentences, ShortlistError

# ---------------------------------------------------------------- helpers


def sentences(token_lists):
    offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(tokens) for tokens in token_lists])
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists]) if token_lists else np.zeros(0)
    return Sentences(tokens=tokens.astype(np.int64), offsets=offsets)


def reference_model1(bitext, iterations):
    """IBM Model 1 as the textbook writes it (Koehn, Statistical MT, fig. 4.3), with NULL (None) on the source side,
    over Python dicts: {(source, target): p(target | source)}."""
    prob = {}
    for src, tgt in bitext:
        for s in [None, *src]:
            for t in tgt:
                prob[(s, t)] = 1.0
    for _ in range(iterations):
        count, total = {}, {}
        for src, tgt in bitext:
            for t in tgt:
                norm = sum(prob[(s, t)] for s in [None, *src])
                for s in [None, *src]:
                    share = prob[(s, t)] / norm
                    count[(s, t)] = count.get((s, t), 0.0) + share
                    total[s] = total.get(s, 0.0) + share
        prob = {(s, t): c / total[s] for (s, t), c in count.items()}
    return prob


def toy_bitext(seed=0, pairs=300):
    """Source words 4..11, each with one translation (its id + 20), sentences of 1-5 words in shuffled order on the
    target side, plus a target filler word (30) in a third of the sentences that no source word translates to."""
    rng = random.Random(seed)
    bitext = []
    for _ in range(pairs):
        src = [rng.randrange(4, 12) for _ in range(rng.randint(1, 5))]
        tgt = [s + 20 for s in src]
        if rng.random() < 0.33:
            tgt.append(30)
        rng.shuffle(tgt)
        bitext.append((src, tgt))
    return bitext


def dictionaries(source_words=20, target_words=40):
    return make_dictionary(source_words), make_dictionary(target_words)


def reference_union(table, src_tokens, extra, k, n, target_dictionary):
    """A batch's union as plain Python sets."""
    union = set(shortlist.special_token_ids(target_dictionary)) | {int(i) for i in table.frequent[:n]}
    for token in src_tokens.reshape(-1).tolist():
        union |= {int(c) for c in table.candidates[token, :k] if c >= 0}
    union |= set(extra)
    return sorted(union)


def random_table(source_dictionary, target_dictionary, k=6, n=5, seed=0):
    rng = np.random.default_rng(seed)
    vs, vt = len(source_dictionary), len(target_dictionary)
    candidates = np.full((vs, k), -1, dtype=np.int32)
    probabilities = np.zeros((vs, k), dtype=np.float32)
    for s in range(source_dictionary.nspecial, vs):
        have = int(rng.integers(0, k + 1))  # some source tokens have fewer than k candidates, some none
        candidates[s, :have] = rng.choice(np.arange(vt), size=have, replace=False)
        probabilities[s, :have] = np.sort(rng.random(have))[::-1]
    frequent = rng.choice(np.arange(target_dictionary.nspecial, vt), size=n, replace=False).astype(np.int32)
    header = {"format": shortlist.FORMAT_NAME, "version": shortlist.FORMAT_VERSION,
              "source_dictionary": shortlist._dictionary_record(source_dictionary),
              "target_dictionary": shortlist._dictionary_record(target_dictionary),
              "k": k, "n": n, "alignment": {"model": "test"}, "data": {}}
    return shortlist.ShortlistTable(header=header, candidates=candidates, probabilities=probabilities, frequent=frequent)


def synthetic_translation():
    """data-prep/make_synthetic_corpus.py's word -> translation function and its source words."""
    spec = importlib.util.spec_from_file_location("make_synthetic_corpus",
                                                  os.path.join(REPO, "data-prep", "make_synthetic_corpus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    words = module.NOUNS + module.ADJECTIVES + module.VERBS + module.FUNCTION[:2]
    return module._target_word, words


# ---------------------------------------------------------------- IBM Model 1


@pytest.mark.parametrize("chunk_pairs,cached", [(10 ** 6, True), (37, True), (37, False), (1, False)])
def test_ibm_model1_equals_the_textbook_estimate(chunk_pairs, cached, monkeypatch):
    """Every p(t | s), NULL's included, equals the plain dict-of-floats estimate after the same iterations, whatever
    the chunking and whether the pairs' indices are kept between iterations."""
    monkeypatch.setattr(shortlist, "CACHED_PAIRS", 10 ** 9 if cached else 0)
    bitext = toy_bitext(pairs=60)
    bitext[5:5] = [([], [21, 30]), ([5, 6], []), ([], [])]  # a side without tokens (once its specials are dropped)
    source, target = sentences([s for s, _ in bitext]), sentences([t for _, t in bitext])
    table = shortlist.ibm_model1(source, target, source_size=16, target_size=40, iterations=4, chunk_pairs=chunk_pairs)
    reference = reference_model1(bitext, iterations=4)
    got = {(None if s == table.null_id else int(s), int(t)): p
           for s, t, p in zip(table.source, table.target, table.probability)}
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_ibm_model1_finds_the_known_translations():
    """On a bitext where each source word has one translation, every source word's best candidate is it (the target
    filler word, which no source word translates to, goes to NULL instead), and p(t | s) sums to 1."""
    bitext = toy_bitext(pairs=300)
    source, target = sentences([s for s, _ in bitext]), sentences([t for _, t in bitext])
    table = shortlist.ibm_model1(source, target, source_size=16, target_size=40, iterations=5)
    candidates, probabilities = shortlist.top_candidates(table, source_size=16, k=3)
    for word in range(4, 12):
        assert candidates[word, 0] == word + 20
        assert probabilities[word, 0] > 0.5
        assert probabilities[word, 0] >= probabilities[word, 1] >= probabilities[word, 2]
    assert (candidates[:4] == -1).all() and (candidates[12:] == -1).all()  # never seen: no candidates
    null = table.source == table.null_id
    assert table.target[null][np.argmax(table.probability[null])] == 30
    sums = np.bincount(table.source, weights=table.probability)
    assert np.allclose(sums[np.unique(table.source)], 1.0)


def test_most_frequent_and_dropped_tokens():
    tokens = np.array([5, 7, 7, 9, 9, 9, 2, 2, 2, 2], dtype=np.int64)
    assert shortlist.most_frequent(tokens, 12, 2, excluded=[2]).tolist() == [9, 7]
    assert shortlist.most_frequent(tokens, 12, 10, excluded=[2]).tolist() == [9, 7, 5]  # fewer than asked occur
    data = sentences([[4, 2], [2], [], [5, 6, 2], []])
    kept = shortlist.drop_tokens(data, [2])
    assert [kept.tokens[a:b].tolist() for a, b in zip(kept.offsets[:-1], kept.offsets[1:])] == [[4], [], [], [5, 6], []]


# ---------------------------------------------------------------- the file


def test_file_round_trip_is_exact_deterministic_and_atomic(tmp_path, monkeypatch):
    source_dictionary, target_dictionary = dictionaries()
    table = random_table(source_dictionary, target_dictionary)
    path = str(tmp_path / "shortlist.npz")
    shortlist.save(path, table)
    first = open(path, "rb").read()
    back = shortlist.read(path)
    assert back.header == table.header
    for name in ("candidates", "probabilities", "frequent"):
        assert np.array_equal(getattr(back, name), getattr(table, name))
        assert getattr(back, name).dtype == getattr(table, name).dtype
    shortlist.save(path, table)
    assert open(path, "rb").read() == first  # the same table, the same bytes

    # a write that fails midway leaves the old file whole and no temporary file behind
    calls = []

    def failing_write_array(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write_array(*args, **kwargs)

    real_write_array = np.lib.format.write_array
    monkeypatch.setattr(np.lib.format, "write_array", failing_write_array)
    with pytest.raises(OSError, match="disk full"):
        shortlist.save(path, random_table(source_dictionary, target_dictionary, seed=1))
    assert open(path, "rb").read() == first
    assert os.listdir(tmp_path) == ["shortlist.npz"]


def test_loading_refuses_other_dictionaries_and_other_files(tmp_path):
    source_dictionary, target_dictionary = dictionaries()
    path = str(tmp_path / "shortlist.npz")
    shortlist.save(path, random_table(source_dictionary, target_dictionary))
    assert shortlist.Shortlist.load(path, source_dictionary, target_dictionary).k == 6

    bigger = make_dictionary(41)
    with pytest.raises(ShortlistError, match=r"shortlist\.npz: built for another target dictionary \(44 symbols, the "
                                             r"model's has 45\)"):
        shortlist.Shortlist.load(path, source_dictionary, bigger)
    renamed = make_dictionary(20)
    renamed.symbols[7] = "other"
    with pytest.raises(ShortlistError, match="built for another source dictionary .*other symbols or ids"):
        shortlist.Shortlist.load(path, renamed, target_dictionary)
    with pytest.raises(ShortlistError, match="asked for K=7, N=5, but the file holds K=6, N=5"):
        shortlist.Shortlist.load(path, source_dictionary, target_dictionary, k=7)

    other = tmp_path / "other.npz"
    np.savez(other, candidates=np.zeros((2, 2)))
    with pytest.raises(ShortlistError, match="other.npz: not a shortlist file"):
        shortlist.read(str(other))
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(ShortlistError, match="text.npz: not a shortlist file"):
        shortlist.read(str(tmp_path / "text.npz"))
    with pytest.raises(ShortlistError, match="missing.npz: file not found"):
        shortlist.read(str(tmp_path / "missing.npz"))
    future = random_table(source_dictionary, target_dictionary)
    future.header["version"] = shortlist.FORMAT_VERSION + 1
    shortlist.save(str(tmp_path / "future.npz"), future)
    with pytest.raises(ShortlistError, match="future.npz: shortlist format version 2, this rfa-fairseq reads version 1"):
        shortlist.read(str(tmp_path / "future.npz"))


# ---------------------------------------------------------------- a batch's union


@pytest.mark.parametrize("k,n", [(6, 5), (2, 0), (1, 3)])
def test_union_equals_the_set_union_with_specials_and_forced_tokens(tmp_path, k, n):
    source_dictionary, target_dictionary = dictionaries()
    table = random_table(source_dictionary, target_dictionary)
    path = str(tmp_path / "shortlist.npz")
    shortlist.save(path, table)
    loaded = shortlist.Shortlist.load(path, source_dictionary, target_dictionary, k=k, n=n)
    generator = torch.Generator().manual_seed(0)
    pad = source_dictionary.pad()
    for batch in (1, 3, 8):
        src = torch.randint(0, len(source_dictionary), (batch, 7), generator=generator)
        src[0, :3] = pad  # left padding, as fairseq batches sources
        src[:, -1] = source_dictionary.eos()
        for extra in (None, [], [0, 39, 39], torch.tensor([[12, 13], [13, 2]])):
            union = loaded.union(src, extra)
            assert union.dtype == torch.long and union.dim() == 1
            assert torch.equal(union, torch.unique(union))  # sorted, distinct
            extra_ids = [] if extra is None else torch.as_tensor(extra).reshape(-1).tolist()
            assert union.tolist() == reference_union(table, src, extra_ids, k, n, target_dictionary)
            assert set(shortlist.special_token_ids(target_dictionary)) <= set(union.tolist())
            assert set(extra_ids) <= set(union.tolist())
    with pytest.raises(ShortlistError, match="forced target token ids must be in 0..43"):
        loaded.union(src, [len(target_dictionary)])
    with pytest.raises(ShortlistError, match="a source token id outside the source dictionary"):
        loaded.union(torch.tensor([[len(source_dictionary)]]))


def test_special_token_ids_include_the_extra_special_symbols():
    from fairseq.data import Dictionary

    dictionary = Dictionary(extra_special_symbols=["<mask>", "<sep>"])
    dictionary.add_symbol("word")
    assert shortlist.special_token_ids(dictionary) == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------- the command


def _decode_vmap(path):
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().split("\n")
    assert lines[-1] == ""  # every line ends with a newline
    rows = {}
    for line in lines[:-1]:
        key, tab, values = line.partition("\t")
        assert tab and "\t" not in values and "  " not in values and values == values.strip()
        assert key not in rows
        rows[key] = values.split(" ")
    return rows


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return synthetic_data(tmp_path_factory) / "bin"


def test_command_builds_the_known_translations_idempotently(data_bin, tmp_path, capsys):
    """rfa-build-shortlist on the synthetic corpus: every source word's first candidate is its translation, the
    frequent list is the training targets' most frequent tokens, the CTranslate2 map holds the same table; a second
    run leaves the file alone, --force writes the same bytes."""
    from fairseq.data import Dictionary

    data = tmp_path / "bin"
    shutil.copytree(data_bin, data)
    proc = run("rfa-build-shortlist", data, "--k", "4", "--n", "6", "--ct2-vmap", tmp_path / "vmap.txt")
    assert "IBM Model 1" in proc.stderr  # the progress bar
    path = data / "shortlist.src-tgt.npz"
    source_dictionary = Dictionary.load(str(data / "dict.src.txt"))
    target_dictionary = Dictionary.load(str(data / "dict.tgt.txt"))
    table = shortlist.read(str(path))
    assert table.header["k"] == 4 and table.header["n"] == 6
    translate, words = synthetic_translation()
    for word in words:
        assert target_dictionary[table.candidates[source_dictionary.index(word), 0]] == translate(word), word
    targets = shortlist.read_binarized(str(data / "train.src-tgt.tgt"))
    counts = np.bincount(targets.tokens, minlength=len(target_dictionary))
    counts[shortlist.special_token_ids(target_dictionary)] = 0
    assert sorted(counts[table.frequent].tolist(), reverse=True) == sorted(counts.tolist(), reverse=True)[:6]

    # the vmap: the always-on line, then each source word with candidates, spelled as the dictionaries spell them
    rows = _decode_vmap(tmp_path / "vmap.txt")
    always = sorted(set(shortlist.special_token_ids(target_dictionary)) | set(table.frequent.tolist()))
    assert rows.pop("") == ["<blank>" if target_dictionary[i] == "<pad>" else target_dictionary[i] for i in always]
    expected = {source_dictionary[s]: [target_dictionary[c] for c in table.candidates[s] if c >= 0]
                for s in range(source_dictionary.nspecial, len(source_dictionary)) if table.candidates[s, 0] >= 0}
    assert rows == expected
    assert open(tmp_path / "vmap.txt", encoding="utf-8").readline().startswith("\t<s> <blank> </s> <unk> ")

    before = path.read_bytes(), path.stat().st_mtime_ns
    code, err = build_in_process(capsys, data, "--k", "4", "--n", "6")
    assert code == 0 and "is up to date" in err
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    code, err = build_in_process(capsys, data, "--k", "4", "--n", "6", "--force", "--quiet")
    assert code == 0 and "IBM Model 1" not in err and "wrote" in err
    assert path.read_bytes() == before[0]
    code, err = build_in_process(capsys, data, "--k", "3", "--n", "6", "--quiet")  # another K: built again
    assert code == 0 and "wrote" in err and shortlist.read(str(path)).header["k"] == 3
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(".")) == []  # no temporary file left


def build_in_process(capsys, *args):
    """rfa-build-shortlist's main() in this process (no interpreter start, no fairseq import): (exit code, stderr)."""
    from rfa_fairseq.cli import build_shortlist

    try:
        code = build_shortlist.main([str(a) for a in args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


def test_command_refuses_a_mismatched_dictionary_and_bad_data(data_bin, tmp_path, capsys):
    data = tmp_path / "bin"
    shutil.copytree(data_bin, data)
    # a dictionary with fewer symbols than the data's ids
    lines = (data / "dict.tgt.txt").read_text(encoding="utf-8").splitlines()
    (data / "dict.tgt.txt").write_text("\n".join(lines[:5]) + "\n", encoding="utf-8")
    code, err = build_in_process(capsys, data, "--quiet")
    assert code == 1
    assert f"rfa-build-shortlist: error: {data / 'dict.tgt.txt'} does not match {data / 'train.src-tgt.tgt.bin'}" in err
    assert not (data / "shortlist.src-tgt.npz").exists()
    (data / "dict.tgt.txt").unlink()
    code, err = build_in_process(capsys, data, "--quiet")
    assert code == 1 and f"{data / 'dict.tgt.txt'}: dictionary not found" in err
    shutil.copy(data_bin / "dict.tgt.txt", data / "dict.tgt.txt")
    # the two sides of another size
    shutil.copy(data / "valid.src-tgt.tgt.idx", data / "train.src-tgt.tgt.idx")
    shutil.copy(data / "valid.src-tgt.tgt.bin", data / "train.src-tgt.tgt.bin")
    code, err = build_in_process(capsys, data, "--quiet")
    assert code == 1 and "sentences, but" in err and "train.src-tgt.src.idx has 1500" in err
    # a truncated .bin
    binary = (data_bin / "train.src-tgt.tgt.bin").read_bytes()
    shutil.copy(data_bin / "train.src-tgt.tgt.idx", data / "train.src-tgt.tgt.idx")
    (data / "train.src-tgt.tgt.bin").write_bytes(binary[:-10])
    code, err = build_in_process(capsys, data, "--quiet")
    assert code == 1 and f"{data / 'train.src-tgt.tgt.bin'}: {len(binary) - 10} bytes, but" in err
    # not fairseq's mmap index
    (data / "train.src-tgt.tgt.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(32))
    code, err = build_in_process(capsys, data, "--quiet")
    assert code == 1 and f"{data / 'train.src-tgt.tgt.idx'}: not fairseq's mmap index" in err
    code, err = build_in_process(capsys, data, "--k", "0")
    assert code == 2 and "--k must be at least 1" in err
    code, err = build_in_process(capsys, tmp_path / "nowhere")
    assert code == 1 and "data directory not found" in err
    code, err = build_in_process(capsys, data, "-s", "xx")
    assert code == 1 and "holds no xx-* pair (pairs found: src-tgt)" in err
    code, err = build_in_process(capsys, data, "-s", "xx", "-t", "tgt")
    assert code == 1 and f"{data / 'dict.xx.txt'}: dictionary not found" in err


def test_command_answers_help_without_importing_fairseq():
    probe = ("import sys, rfa_fairseq_cli\nsys.argv = ['rfa-build-shortlist', '--help']\ntry:\n"
             "    rfa_fairseq_cli.build_shortlist()\nexcept SystemExit as exc:\n    print('EXIT', exc.code)\n"
             "print('IMPORTED', sorted(m for m in ('fairseq', 'torch', 'rfa_fairseq') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(REPO))
    assert proc.stdout.startswith("usage: rfa-build-shortlist"), proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-2:] == ["EXIT 0", "IMPORTED []"], proc.stdout + proc.stderr


def test_command_defaults_agree_with_the_library():
    from rfa_fairseq.cli import build_shortlist

    assert (build_shortlist.DEFAULT_K, build_shortlist.DEFAULT_N, build_shortlist.DEFAULT_ITERATIONS) == \
        (shortlist.DEFAULT_K, shortlist.DEFAULT_N, shortlist.DEFAULT_ITERATIONS)


# ---------------------------------------------------------------- CTranslate2


@pytest.mark.slow
def test_ctranslate2_reads_the_vmap_and_restricts_to_the_same_union(data_bin, tmp_path):
    """A tiny fairseq softmax transformer converted with the vmap (ct2-fairseq-converter --vocab_mapping): CTranslate2
    loads it, and with use_vmap=True every hypothesis token is in the union Shortlist.union gives the sentence, while
    without it some are not (so the map does restrict)."""
    if importlib.util.find_spec("ctranslate2") is None:
        pytest.skip("ctranslate2 is not installed (the bench extra installs it: pip install -e '.[bench]')")
    import ctranslate2
    from fairseq.data import Dictionary

    from conftest import PLUGIN_DIR
    from tiny_models import CLI_TINY_MODEL

    save = tmp_path / "model"
    run("fairseq-train", data_bin, "--user-dir", PLUGIN_DIR, "--arch", "transformer", *CLI_TINY_MODEL,
        "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "2000", "--num-workers", "0", "--seed", "3",
        "--max-update", "10", "--no-epoch-checkpoints", "--save-dir", save, "--cpu")
    vmap, short = tmp_path / "vmap.txt", tmp_path / "shortlist.npz"
    # one candidate per source word and no frequent tokens: a union small enough that an unrestricted model leaves it
    run("rfa-build-shortlist", data_bin, "--k", "1", "--n", "0", "--output", short, "--ct2-vmap", vmap, "--quiet")
    converted = tmp_path / "ct2"
    run(os.path.join(os.path.dirname(sys.executable), "ct2-fairseq-converter"), "--model_path",
        save / "checkpoint_last.pt", "--data_dir", data_bin, "--user_dir", PLUGIN_DIR, "--vocab_mapping", vmap,
        "--output_dir", converted)
    assert (converted / "vmap.txt").read_bytes() == vmap.read_bytes()
    source_dictionary = Dictionary.load(str(data_bin / "dict.src.txt"))
    target_dictionary = Dictionary.load(str(data_bin / "dict.tgt.txt"))
    loaded = shortlist.Shortlist.load(str(short), source_dictionary, target_dictionary)
    translator = ctranslate2.Translator(str(converted), device="cpu", intra_threads=1)
    sources = [line.split() for line in (data_bin.parent / "raw" / "test.src").read_text().splitlines()[:12]]
    outside_without = 0
    for source in sources:
        ids = torch.tensor([[source_dictionary.index(w) for w in source] + [source_dictionary.eos()]])
        union = {target_dictionary[i] for i in loaded.union(ids).tolist()} | {"<blank>"}
        restricted = translator.translate_batch([source], beam_size=2, max_decoding_length=12, use_vmap=True)
        assert set(restricted[0].hypotheses[0]) <= union, (source, restricted[0].hypotheses[0])
        free = translator.translate_batch([source], beam_size=2, max_decoding_length=12)
        outside_without += len(set(free[0].hypotheses[0]) - union)
    assert outside_without > 0


# ---------------------------------------------------------------- the benchmark


@pytest.mark.slow
def test_shortlist_sizes_benchmark_rows_skip_and_hypothesis_coverage(data_bin, tmp_path):
    """benchmarks/shortlist_sizes.py on the synthetic data-bin: a row per (split, batch size, k, n) with unions that
    grow with the batch and with k, a second run measures nothing again, and hypotheses equal to the references (as
    fairseq-generate prints them) are covered exactly as the references are."""
    import csv

    from fairseq.data import Dictionary

    prep = tmp_path / "prep"
    prep.mkdir()
    shutil.copytree(data_bin, prep / "data-bin")
    target_dictionary = Dictionary.load(str(data_bin / "dict.tgt.txt"))
    test = shortlist.read_binarized(str(data_bin / "test.src-tgt.tgt"))
    generated = tmp_path / "generate-test.txt"
    generated.write_text("".join(
        f"S-{i}\tignored\nH-{i}\t-0.5\t{target_dictionary.string(torch.from_numpy(test.tokens[a:b]))}\n"
        for i, (a, b) in reversed(list(enumerate(zip(test.offsets[:-1], test.offsets[1:]))))), encoding="utf-8")
    results, builds = tmp_path / "sizes.csv", tmp_path / "build.csv"
    command = [sys.executable, os.path.join(REPO, "benchmarks", "shortlist_sizes.py"), "--prep", str(prep),
               "--csv", str(results), "--build-csv", str(builds), "--batch-sizes", "1", "8", "--k", "1", "3",
               "--n", "0", "4", "--hypotheses", f"src-tgt:test={generated}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(results)))
    assert {(r["split"], r["batch_size"], r["k"], r["n"]) for r in rows} == set(
        itertools.product(["valid", "test"], ["1", "8"], ["1", "3"], ["0", "4"]))
    size = {(r["split"], int(r["batch_size"]), int(r["k"]), int(r["n"])): float(r["union_mean"]) for r in rows}
    for split, k, n in itertools.product(["valid", "test"], [1, 3], [0, 4]):
        assert size[(split, 8, k, n)] > size[(split, 1, k, n)]
    assert all(size[(s, b, 3, n)] >= size[(s, b, 1, n)] for s, b, _, n in size)
    for r in rows:
        assert 0 < float(r["token_coverage"]) <= 1 and 0 <= float(r["sentence_coverage"]) <= 1
        if r["split"] == "test":
            assert (r["hyp_token_coverage"], r["hyp_sentence_coverage"]) == (r["token_coverage"], r["sentence_coverage"])
        else:
            assert r["hyp_token_coverage"] == ""
    assert [r["pair"] for r in csv.DictReader(open(builds))] == ["src-tgt"]
    before = results.read_bytes()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr[-2000:]
    assert results.read_bytes() == before
