"""End-to-end tests of data-prep/prepare-*.sh, run offline on synthetic archives in
the real layout (tests/data_prep_fixtures.py) and on the real Multi30k copy in
<repo>/../shared/data/multi30k when present.

Each fixture sentence pair carries a shared id token on both sides, so the tests
check alignment after normalisation, cleaning, SentencePiece and binarisation.
"""
import functools
import gzip
import importlib.util
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_prep_fixtures import (  # noqa: E402
    IWSLT_TEST_SETS,
    build_iwslt,
    build_multi30k,
    build_wmt,
)

REPO = Path(__file__).resolve().parents[1]
DATA_PREP = REPO / "data-prep"
SHARED_MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
PYTHON_BIN = Path(sys.executable).parent  # the environment that has fairseq-preprocess
FIXTURE_VOCAB = "120"
ID = re.compile(r"^id(\d{5})\b")


# ---------------------------------------------------------------- helpers


def script_env(path=None, **extra):
    env = dict(os.environ)
    env["PATH"] = path or f"{PYTHON_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    for name in ("RFA_DATA_MIRROR", "MULTI30K_DIR", "SPM_INPUT_SENTENCE_SIZE"):
        env.pop(name, None)
    env.update(extra)
    return env


def run_prep(script, *args, env=None, expect_ok=True):
    proc = subprocess.run(
        ["bash", str(DATA_PREP / script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env or script_env(),
        timeout=600,
    )
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{script} failed with exit {proc.returncode}:\n{proc.stderr[-5000:]}")
    if not expect_ok:
        # the scripts refuse with die (exit 1); anything else, a crash included, is not a refusal
        assert proc.returncode == 1, f"{script} should have refused (exit 1), got {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def read(path):
    with open(path, encoding="utf-8", newline="\n") as handle:
        return [line[:-1] if line.endswith("\n") else line for line in handle]


def decode(out, path):
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(Path(out) / "spm.model"))
    return [processor.decode(line.split()) for line in read(path)]


def ids_of(lines, path="?"):
    ids = []
    for line in lines:
        match = ID.match(line)
        assert match, f"line without id token in {path}: {line[:60]!r}"
        ids.append(int(match.group(1)))
    return ids


def assert_aligned(out, split, src, tgt):
    """Both sides have the same number of lines and the same id on every line."""
    src_text = decode(out, Path(out) / f"{split}.spm.{src}")
    tgt_text = decode(out, Path(out) / f"{split}.spm.{tgt}")
    assert len(src_text) == len(tgt_text)
    assert ids_of(src_text, f"{split}.{src}") == ids_of(tgt_text, f"{split}.{tgt}")
    return src_text, tgt_text


def check_data_bin(out, src, tgt, unk_free_train=True):
    """data-bin holds exactly the SentencePiece text, with one shared dictionary
    (pieces outside the vocabulary, e.g. characters below the coverage, are <unk>)."""
    from fairseq.data import Dictionary
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    bin_dir = Path(out) / "data-bin"
    assert (bin_dir / f"dict.{src}.txt").read_text() == (bin_dir / f"dict.{tgt}.txt").read_text()
    dictionary = Dictionary.load(str(bin_dir / f"dict.{src}.txt"))
    n_pieces = sum(1 for _ in open(Path(out) / "spm.vocab", encoding="utf-8"))
    assert len(read(bin_dir / f"dict.{src}.txt")) == n_pieces - 3  # minus <unk> <s> </s>
    for split in ("train", "valid", "test"):
        for lang in (src, tgt):
            lines = read(Path(out) / f"{split}.spm.{lang}")
            dataset = MMapIndexedDataset(str(bin_dir / f"{split}.{src}-{tgt}.{lang}"))
            assert len(dataset) == len(lines), f"{split}.{lang}"
            for index in range(0, len(lines), max(1, len(lines) // 200)):
                pieces = lines[index].split()
                expected = [p if dictionary.index(p) != dictionary.unk() else "<unk>" for p in pieces]
                assert dictionary.string(dataset[index]) == " ".join(expected)
                assert len(dataset[index]) == len(pieces) + 1  # + </s>
                if split == "train" and unk_free_train:
                    assert "<unk>" not in expected, f"train piece outside the vocabulary: {lines[index]}"


def assert_no_final_outputs(out):
    out = Path(out)
    assert not (out / "spm.model").exists()
    assert not (out / "data-bin").exists()
    assert not list(out.glob("*.spm.*")), list(out.glob("*.spm.*"))
    assert not list(out.rglob("*.tmp")), list(out.rglob("*.tmp"))


def clean_corpus_keep(n_src, n_tgt, ratio, max_len):
    """clean-corpus-n.perl, written independently of data-prep/textprep.py."""
    if n_src == 0 or n_tgt == 0 or n_src > max_len or n_tgt > max_len:
        return False
    return max(n_src / n_tgt, n_tgt / n_src) <= ratio


# ---------------------------------------------------------------- IWSLT14


@pytest.fixture(scope="module")
def iwslt(tmp_path_factory):
    mirror = tmp_path_factory.mktemp("iwslt-mirror")
    manifest = build_iwslt(mirror)
    out = tmp_path_factory.mktemp("iwslt-out")
    proc = run_prep("prepare-iwslt14.sh", "--mirror", mirror, "--vocab-size", FIXTURE_VOCAB, "--workers", "1", out)
    return manifest, out, proc


def expected_iwslt_splits(manifest):
    kept = [
        (number, de.lower(), en.lower())
        for number, de, en in manifest.train_pairs
        if clean_corpus_keep(len(de.split()), len(en.split()), 1.5, 175)
    ]
    valid = [pair for index, pair in enumerate(kept, start=1) if index % 23 == 0]
    train = [pair for index, pair in enumerate(kept, start=1) if index % 23 != 0]
    test = []
    for set_name in IWSLT_TEST_SETS:  # fairseq's concatenation order
        for number, de, en in manifest.test_sets[set_name]:
            fix = lambda s: s.replace("&amp;", "&").replace("\u2019", "'").lower()  # noqa: E731
            test.append((number, fix(de), fix(en)))
    return {"train": train, "valid": valid, "test": test}


@pytest.mark.slow
def test_iwslt14_reproduces_fairseq_split(iwslt):
    manifest, out, _ = iwslt
    expected = expected_iwslt_splits(manifest)
    for split, rows in expected.items():
        de_text, en_text = assert_aligned(out, split, "de", "en")
        # Exact text after lowercasing, metadata removal and the SentencePiece round trip.
        assert de_text == [row[1] for row in rows], split
        assert en_text == [row[2] for row in rows], split
    assert len(expected["valid"]) >= 10 and len(expected["test"]) == 30
    # Metadata lines never reach the data; <title>/<description> text does.
    train_text = "\n".join(read(out / "train.spm.en") + read(out / "valid.spm.en"))
    for tag in ("url", "keywords", "speaker", "talkid", "reviewer", "title", "description"):
        assert tag not in train_text
    title_ids = {manifest.train_pairs[0][0], manifest.train_pairs[1][0]}
    all_ids = {row[0] for rows in expected.values() for row in rows}
    assert title_ids <= all_ids
    for number, reason in manifest.dropped.items():
        assert number not in all_ids, f"id {number} ({reason}) should have been cleaned away"
    # The scoring reference is the recipe's (lowercased) test text.
    assert read(out / "test.raw.en") == [row[2] for row in expected["test"]]
    assert read(out / "test.raw.de") == [row[1] for row in expected["test"]]


@pytest.mark.slow
def test_iwslt14_binarized_with_joined_dictionary(iwslt):
    _, out, proc = iwslt
    check_data_bin(out, "de", "en")
    assert "vocab: " + FIXTURE_VOCAB in proc.stdout
    assert (out / ".done" / "binarize.done").exists()


@pytest.mark.slow
def test_iwslt14_rerun_skips_finished_steps_and_redoes_interrupted_ones(iwslt, tmp_path):
    _, original, _ = iwslt
    out = tmp_path / "out"
    shutil.copytree(original, out, symlinks=True)
    mirror_args = ["--vocab-size", FIXTURE_VOCAB]
    # download/de-en.tgz is a symlink into the mirror, so no --mirror is needed to skip the fetch.
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.spm.*")}
    proc = run_prep("prepare-iwslt14.sh", *mirror_args, out)
    assert "step " not in proc.stderr and "skip binarize" in proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.spm.*")} == finished

    # Simulate a run killed while encoding: a half-written output, no marker, and
    # a stale temporary directory from binarisation.
    train_en = out / "train.spm.en"
    full_text = train_en.read_text()
    train_en.write_text(full_text[: len(full_text) // 3])
    (out / ".done" / "spm-encode.done").unlink()
    (out / "data-bin.tmp").mkdir()
    (out / "data-bin.tmp" / "junk").write_text("x")
    proc = run_prep("prepare-iwslt14.sh", *mirror_args, out)
    assert "skip spm-train-unigram-120" in proc.stderr
    assert "step spm-encode" in proc.stderr and "step binarize" in proc.stderr
    assert train_en.read_text() == full_text
    assert not (out / "data-bin.tmp").exists()
    check_data_bin(out, "de", "en")

    # Another vocabulary size retrains SentencePiece and redoes everything after it.
    proc = run_prep("prepare-iwslt14.sh", "--vocab-size", "100", out)
    assert "step spm-train-unigram-100" in proc.stderr and "step binarize" in proc.stderr
    assert len(read(out / "spm.vocab")) == 100
    check_data_bin(out, "de", "en")


def test_iwslt14_corrupt_archive_fails_cleanly(tmp_path):
    mirror = tmp_path / "mirror"
    manifest = build_iwslt(mirror)
    data = manifest.archive.read_bytes()
    manifest.archive.write_bytes(data[: len(data) // 2])  # truncated download
    out = tmp_path / "out"
    proc = run_prep("prepare-iwslt14.sh", "--mirror", mirror, "--vocab-size", FIXTURE_VOCAB, out, expect_ok=False)
    assert "de-en.tgz" in proc.stderr and "corrupt" in proc.stderr
    assert not (out / ".done" / "fetch-de-en.tgz.done").exists()
    assert not (out / "download" / "de-en.tgz").exists()
    assert not list((out / "orig").iterdir())
    assert_no_final_outputs(out)


def test_iwslt14_missing_archive_is_named(tmp_path):
    mirror = tmp_path / "empty-mirror"
    mirror.mkdir()
    out = tmp_path / "out"
    proc = run_prep("prepare-iwslt14.sh", "--mirror", mirror, out, expect_ok=False)
    assert f"de-en.tgz not found in mirror {mirror}" in proc.stderr
    assert "https://dl.fbaipublicfiles.com/fairseq/data/iwslt14/de-en.tgz" in proc.stderr
    assert_no_final_outputs(out)


def test_missing_fairseq_preprocess_is_reported(tmp_path):
    # A PATH with python3 and coreutils but without fairseq-preprocess.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = script_env(path=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    out = tmp_path / "out"
    proc = run_prep("prepare-multi30k.sh", "--local-dir", tmp_path, out, env=env, expect_ok=False)
    assert "fairseq-preprocess not found on PATH" in proc.stderr
    assert not (out / ".done").exists() or not list((out / ".done").iterdir())


# ---------------------------------------------------------------- WMT14


@pytest.fixture(scope="module")
def wmt_mirror(tmp_path_factory):
    return build_wmt(tmp_path_factory.mktemp("wmt-mirror"))


@functools.lru_cache(maxsize=None)
def moses_punct_normalizer(lang):
    from sacremoses import MosesPunctNormalizer

    return MosesPunctNormalizer(lang=lang)


def normalize_like_moses(text, lang):
    import regex

    text = moses_punct_normalizer(lang).normalize(text)
    text = regex.sub(r"\p{C}", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def check_wmt_output(manifest, out, xx):
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    expected_ids = []
    for number, en, tr in manifest.train_pairs[xx]:
        n_en = len(processor.encode(normalize_like_moses(en, "en"), out_type=str))
        n_tr = len(processor.encode(normalize_like_moses(tr, xx), out_type=str))
        if clean_corpus_keep(n_en, n_tr, 1.5, 250):  # fairseq cleans on subword counts
            expected_ids.append(number)
    en_text, tr_text = assert_aligned(out, "train", "en", xx)
    assert ids_of(en_text) == expected_ids  # every corpus, in the recipe's order
    for number in manifest.dropped[xx]:
        assert number not in expected_ids
    by_id = dict(zip(ids_of(tr_text), tr_text))
    for number, _, tr in manifest.train_pairs[xx]:
        if number in by_id:
            assert by_id[number] == normalize_like_moses(tr, xx)

    for split, rows in (("valid", manifest.valid[xx]), ("test", manifest.test[xx])):
        en_text, tr_text = assert_aligned(out, split, "en", xx)
        assert ids_of(en_text) == [row[0] for row in rows]  # never filtered
        assert tr_text == [normalize_like_moses(row[2], xx) for row in rows]
    # References exactly as sacrebleu extracts them: no normalisation, no unescaping.
    assert read(out / f"test.raw.{xx}") == [re.sub(r"\s+", " ", row[2]).strip() for row in manifest.test[xx]]
    assert read(out / "test.raw.en") == [re.sub(r"\s+", " ", row[1]).strip() for row in manifest.test[xx]]
    # Character coverage 0.9999: a character this rare in the tiny corpus may be <unk>.
    check_data_bin(out, "en", xx, unk_free_train=False)


@pytest.mark.slow
def test_wmt14_en_de_offline(wmt_mirror, tmp_path):
    out = tmp_path / "out"
    proc = run_prep(
        "prepare-wmt14en2de.sh", "--mirror", wmt_mirror.mirror, "--no-checksum",
        "--vocab-size", FIXTURE_VOCAB, "--workers", "2", out,
    )
    check_wmt_output(wmt_mirror, out, "de")
    assert "train " in proc.stdout and "pairs" in proc.stdout
    # '\r' and tab inside a sentence stay inside it (fairseq would otherwise split the line).
    assert any(line.endswith("kaxo lox") for line in decode(out, out / "train.spm.de"))


@pytest.mark.slow
def test_wmt14_en_fr_offline(wmt_mirror, tmp_path):
    out = tmp_path / "out"
    run_prep(
        "prepare-wmt14en2fr.sh", "--mirror", wmt_mirror.mirror, "--no-checksum",
        "--vocab-size", FIXTURE_VOCAB, "--workers", "1", out,
    )
    check_wmt_output(wmt_mirror, out, "fr")
    # The gzipped giga-fren corpus inside the .tar is the last one.
    giga_last_id = wmt_mirror.train_pairs["fr"][-1][0]
    assert ids_of(decode(out, out / "train.spm.fr"))[-1] == giga_last_id


def test_wmt14_published_checksum_is_enforced(wmt_mirror, tmp_path):
    out = tmp_path / "out"
    proc = run_prep("prepare-wmt14en2de.sh", "--mirror", wmt_mirror.mirror, out, expect_ok=False)
    assert "test.tgz checksum mismatch" in proc.stderr
    assert "48eca5d02f637af44e85186847141f67" in proc.stderr
    assert not (out / ".done" / "fetch-test.tgz.done").exists()
    assert_no_final_outputs(out)


def test_wmt14_missing_archive_is_named(wmt_mirror, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(wmt_mirror.mirror, mirror)
    (mirror / "training-parallel-commoncrawl.tgz").unlink()
    out = tmp_path / "out"
    proc = run_prep("prepare-wmt14en2de.sh", "--mirror", mirror, "--no-checksum", out, expect_ok=False)
    assert "training-parallel-commoncrawl.tgz not found in mirror" in proc.stderr
    assert not (out / ".done" / "fetch-training-parallel-commoncrawl.tgz.done").exists()
    assert_no_final_outputs(out)


def test_wmt14_misaligned_corpus_is_rejected(wmt_mirror, tmp_path):
    import io
    import tarfile

    mirror = tmp_path / "mirror"
    shutil.copytree(wmt_mirror.mirror, mirror)
    archive = mirror / "training-parallel-nc-v9.tgz"
    with tarfile.open(archive) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    files["training/news-commentary-v9.de-en.de"] += b"one line too many\n"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    n_en = files["training/news-commentary-v9.de-en.en"].count(b"\n")
    out = tmp_path / "out"
    proc = run_prep("prepare-wmt14en2de.sh", "--mirror", mirror, "--no-checksum", out, expect_ok=False)
    assert (
        f"news-commentary-v9.de-en.en has {n_en} lines but {out}/orig/training/"
        f"news-commentary-v9.de-en.de has {n_en + 1} lines" in proc.stderr
    )
    assert "step 'train-text' failed" in proc.stderr
    assert not (out / ".done" / "train-text.done").exists()
    assert not (out / "work" / "train.en").exists() and not (out / "work" / "train.de").exists()
    assert_no_final_outputs(out)


# ---------------------------------------------------------------- Multi30k


def read_gz(path):
    with gzip.open(path, "rt", encoding="utf-8", newline="\n") as handle:
        return [line.rstrip("\n") for line in handle]


@pytest.mark.slow
def test_multi30k_real_data(tmp_path):
    if not (SHARED_MULTI30K / "train.de.gz").exists():
        print(f"SKIP reason: real Multi30k not found at {SHARED_MULTI30K}")
        pytest.skip(f"real Multi30k data not found at {SHARED_MULTI30K}")
    out = tmp_path / "out"
    # A smaller vocabulary than the recipe's 8000 only to save test time.
    proc = run_prep("prepare-multi30k.sh", "--local-dir", SHARED_MULTI30K, "--pair", "en-de",
                    "--vocab-size", "2000", "--workers", "2", out)
    print(proc.stdout)
    sizes = {"train": 29000, "valid": 1014, "test": 1000}
    for split, size in sizes.items():
        assert len(read(out / f"{split}.spm.en")) == size
        assert len(read(out / f"{split}.spm.de")) == size
    # test.raw.* is the published test set itself.
    assert read(out / "test.raw.de") == [s.strip() for s in read_gz(SHARED_MULTI30K / "test_2016_flickr.de.gz")]
    assert read(out / "test.raw.en") == [s.strip() for s in read_gz(SHARED_MULTI30K / "test_2016_flickr.en.gz")]
    # valid.raw.* too, whitespace aside (a no-break space in val.de becomes a space, as in every reference)
    assert read(out / "valid.raw.de") == [" ".join(s.split()) for s in read_gz(SHARED_MULTI30K / "val.de.gz")]
    # Alignment: line i of the processed data is line i of the published data.
    for split, name in (("train", "train"), ("test", "test_2016_flickr")):
        for lang in ("en", "de"):
            raw = [normalize_like_moses(s, lang) for s in read_gz(SHARED_MULTI30K / f"{name}.{lang}.gz")]
            decoded = decode(out, out / f"{split}.spm.{lang}")
            same = sum(a == b for a, b in zip(raw, decoded))
            assert same >= 0.99 * len(raw), f"{split}.{lang}: only {same}/{len(raw)} lines round-trip"
            assert raw[0] == decoded[0] and raw[-1] == decoded[-1]
    check_data_bin(out, "en", "de")


@pytest.mark.slow
def test_multi30k_en_fr_from_env_local_dir(tmp_path):
    local = tmp_path / "multi30k"
    rows = build_multi30k(local)
    out = tmp_path / "out"
    env = script_env(MULTI30K_DIR=str(local))
    run_prep("prepare-multi30k.sh", "--pair", "en-fr", "--no-checksum", "--vocab-size", FIXTURE_VOCAB, out, env=env)
    for split, name in (("train", "train"), ("valid", "val"), ("test", "test_2016_flickr")):
        en_text, fr_text = assert_aligned(out, split, "en", "fr")
        assert ids_of(en_text) == [row[0] for row in rows[name]]
        assert fr_text == [row[3] for row in rows[name]]
    assert read(out / "test.raw.fr") == [row[3] for row in rows["test_2016_flickr"]]
    assert read(out / "valid.raw.fr") == [row[3] for row in rows["val"]]
    check_data_bin(out, "en", "fr")
    # A directory prepared before valid.raw.* existed gets it alone: nothing it has is prepared again.
    for name in ("valid.raw.en", "valid.raw.fr", ".done/valid-raw.done"):
        (out / name).unlink()
    binarized = {p.name: p.stat().st_mtime_ns for p in (out / "data-bin").iterdir()}
    proc = run_prep("prepare-multi30k.sh", "--pair", "en-fr", "--no-checksum", "--vocab-size", FIXTURE_VOCAB, out, env=env)
    assert re.findall(r"step (\S+)", proc.stdout + proc.stderr) == ["valid-raw"]
    assert read(out / "valid.raw.fr") == [row[3] for row in rows["val"]]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data-bin").iterdir()} == binarized
    # The directory belongs to en-fr now; en-de must not reuse its step markers.
    proc = run_prep("prepare-multi30k.sh", "--pair", "en-de", "--no-checksum", out, env=env, expect_ok=False)
    assert f"{out} was prepared for 'multi30k-task1 en-fr', not 'multi30k-task1 en-de'" in proc.stderr


def test_multi30k_published_sizes_are_checked(tmp_path):
    local = tmp_path / "multi30k"
    build_multi30k(local)
    out = tmp_path / "out"
    proc = run_prep("prepare-multi30k.sh", "--local-dir", local, out, expect_ok=False)
    assert f"{out}/download/train.en.gz has 300 lines, expected 29000 (published size)" in proc.stderr
    assert_no_final_outputs(out)


def test_multi30k_corrupt_gzip_fails_cleanly(tmp_path):
    local = tmp_path / "multi30k"
    build_multi30k(local)
    data = (local / "val.de.gz").read_bytes()
    (local / "val.de.gz").write_bytes(data[:-20])  # truncated
    out = tmp_path / "out"
    proc = run_prep("prepare-multi30k.sh", "--local-dir", local, "--no-checksum", out, expect_ok=False)
    assert "val.de.gz is corrupt or truncated" in proc.stderr
    assert not (out / ".done" / "fetch-val.de.gz.done").exists()
    assert_no_final_outputs(out)


# ---------------------------------------------------------------- worker processes never waited for forever


def _chunk_times_ten(chunk):
    return chunk * 10


def _killed_on_chunk_three(chunk):
    if chunk == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    return chunk


def _hung_on_chunk_three(chunk):
    if chunk == 3:
        time.sleep(600)
    return chunk


def test_map_chunks_fails_clearly_on_a_dead_or_hung_worker():
    spec = importlib.util.spec_from_file_location("textprep_under_test", DATA_PREP / "textprep.py")
    textprep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(textprep)
    assert list(textprep.map_chunks(_chunk_times_ten, range(8), workers=2)) == [10 * i for i in range(8)]

    with pytest.raises(textprep.PrepError, match=r"a worker process died while it processed a chunk \(killed"):
        list(textprep.map_chunks(_killed_on_chunk_three, range(8), workers=2))
    with pytest.raises(textprep.PrepError) as error:
        list(textprep.map_chunks(_hung_on_chunk_three, range(8), workers=2, timeout_s=1))
    assert str(error.value) == (f"a worker process did not finish its chunk of up to {textprep.CHUNK_PAIRS} pairs "
                                "within 1 s")
    assert multiprocessing.active_children() == []  # the hung worker was stopped, not left (nor waited for)
