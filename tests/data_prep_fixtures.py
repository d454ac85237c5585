"""Tiny synthetic downloads in the exact layout of the real IWSLT14, WMT14 and
Multi30k archives, built at test time, for running data-prep/prepare-*.sh offline.

Every sentence pair starts with a shared id token ("id01234") on both sides, so
alignment can be verified after normalisation, cleaning, SentencePiece and
splitting. Each builder returns a manifest of what it wrote, in file order.
"""
import gzip
import io
import random
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

SYLLABLES = "ka lo mi ne ru sa te vi do pa ge hu bi fo zu ra le".split()


def id_token(number):
    return f"id{number:05d}"


class SentenceMaker:
    """Pseudo-words per language; both sides of a pair get the same number of
    words of similar length, so only deliberately skewed pairs are cleaned away."""

    def __init__(self, seed, languages=("de", "en", "fr")):
        self.rng = random.Random(seed)
        self.lexicon = {}
        for lang_index, lang in enumerate(languages):
            words = set()
            while len(words) < 60:
                n_syllables = self.rng.randint(1, 3)
                words.add("".join(self.rng.choice(SYLLABLES) for _ in range(n_syllables)))
            # Capitalised words exercise lowercasing; the language letter keeps lexicons apart.
            self.lexicon[lang] = sorted(w + "xyz"[lang_index] for w in words)

    def words(self, lang, n_words):
        picked = [self.rng.choice(self.lexicon[lang]) for _ in range(n_words)]
        return " ".join(w.capitalize() if i == 0 else w for i, w in enumerate(picked))

    def pair(self, number, src_lang, tgt_lang, n_src=None, n_tgt=None):
        n_words = self.rng.randint(3, 12)
        n_src = n_words if n_src is None else n_src
        n_tgt = n_words if n_tgt is None else n_tgt
        src = f"{id_token(number)} {self.words(src_lang, n_src)}".strip()
        tgt = f"{id_token(number)} {self.words(tgt_lang, n_tgt)}".strip()
        return number, src, tgt


def add_to_tar(tar, member, text):
    data = text.encode("utf-8") if isinstance(text, str) else text
    info = tarfile.TarInfo(member)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def lines_text(lines):
    return "".join(line + "\n" for line in lines)


# ---------------------------------------------------------------- IWSLT14

IWSLT_TEST_SETS = [
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
]


@dataclass
class IwsltManifest:
    archive: Path
    # (id, de, en) of every content line of train.tags, in file order (tags stripped)
    train_pairs: list = field(default_factory=list)
    # set name -> [(id, de seg text as written, en seg text as written)]
    test_sets: dict = field(default_factory=dict)
    # ids expected to be removed by cleaning, and why
    dropped: dict = field(default_factory=dict)


def build_iwslt(dest_dir, n_talks=8, sentences_per_talk=40):
    """de-en.tgz with de-en/train.tags.de-en.{de,en} and the five test .xml pairs."""
    maker = SentenceMaker(seed=14)
    Path(dest_dir).mkdir(parents=True, exist_ok=True)
    manifest = IwsltManifest(archive=Path(dest_dir) / "de-en.tgz")
    de_lines, en_lines = [], []
    number = 0

    for talk in range(n_talks):
        # Metadata block of a TED talk as in the real train.tags files.
        for tag_de, tag_en in [
            (f"<url>http://www.ted.com/talks/talk{talk}.html</url>",) * 2,
            ("<keywords>talks, science, technology</keywords>", "<keywords>talks, science, technology</keywords>"),
            (f"<speaker>Speaker {talk}</speaker>",) * 2,
            (f"<talkid>{talk}</talkid>",) * 2,
        ]:
            de_lines.append(tag_de)
            en_lines.append(tag_en)
        _, de, en = maker.pair(number, "de", "en")
        de_lines.append(f"<title>{de}</title>")
        en_lines.append(f"<title>{en}</title>")
        manifest.train_pairs.append((number, de, en))
        number += 1
        _, de, en = maker.pair(number, "de", "en")
        de_lines.append(f"<description>{de}</description>")
        en_lines.append(f"<description>{en}</description>")
        manifest.train_pairs.append((number, de, en))
        number += 1
        de_lines.extend(["<reviewer></reviewer>", "<translator></translator>"])
        en_lines.extend(["<reviewer href=\"x\">Some One</reviewer>", "<translator></translator>"])
        for index in range(sentences_per_talk):
            special = (talk, index)
            if special == (1, 5):  # 3 vs 9 tokens: ratio 3 > 1.5
                pair = maker.pair(number, "de", "en", n_src=2, n_tgt=8)
                manifest.dropped[number] = "ratio"
            elif special == (2, 7):  # 2 vs 3 tokens: ratio exactly 1.5 is kept
                pair = maker.pair(number, "de", "en", n_src=1, n_tgt=2)
            elif special == (3, 3):  # 176 tokens > 175
                pair = maker.pair(number, "de", "en", n_src=175, n_tgt=175)
                manifest.dropped[number] = "too long"
            elif special == (3, 4):  # exactly 175 tokens is kept
                pair = maker.pair(number, "de", "en", n_src=174, n_tgt=174)
            elif special == (0, 0):  # characters the test sets use, so they are in the vocabulary
                num, de, en = maker.pair(number, "de", "en")
                pair = (num, de + " & kas's", en + " & kos's")
            else:
                pair = maker.pair(number, "de", "en")
            _, de, en = pair
            de_lines.append(de)
            en_lines.append(en)
            manifest.train_pairs.append(pair)
            number += 1
        # An empty pair (0 tokens) is removed by the minimum length of 1.
        de_lines.append("")
        en_lines.append("")
        manifest.train_pairs.append((None, "", ""))

    test_number = 90000
    with tarfile.open(manifest.archive, "w:gz") as tar:
        add_to_tar(tar, "de-en/train.tags.de-en.de", lines_text(de_lines))
        add_to_tar(tar, "de-en/train.tags.de-en.en", lines_text(en_lines))
        # Files the real archive also has but the recipe does not use.
        add_to_tar(tar, "de-en/README", "IWSLT 2014 de-en synthetic fixture\n")
        for set_name in IWSLT_TEST_SETS:
            segs = []
            for seg_index in range(6):
                _, de, en = maker.pair(test_number, "de", "en")
                if seg_index == 1:  # XML entity and typographic apostrophe
                    de, en = de + " &amp; kas\u2019s", en + " &amp; kos\u2019s"
                segs.append((test_number, de, en))
                test_number += 1
            manifest.test_sets[set_name] = segs
            for lang, column in (("de", 1), ("en", 2)):
                kind = "srcset" if lang == "de" else "refset"
                body = [
                    '<?xml version="1.0" encoding="UTF-8"?>',
                    "<mteval>",
                    f'<{kind} setid="{set_name}" srclang="german" trglang="english">',
                    '<doc docid="1" genre="lectures">',
                    "<url>http://www.ted.com/talks/test.html</url>",
                    "<description>TED Talk Subtitles and Transcript</description>",
                    "<talkid>1</talkid>",
                    "<title>A test talk</title>",
                ]
                body += [f'<seg id="{i + 1}"> {seg[column]} </seg>' for i, seg in enumerate(segs)]
                body += ["</doc>", f"</{kind}>", "</mteval>"]
                add_to_tar(tar, f"de-en/{set_name}.de-en.{lang}.xml", lines_text(body))
    return manifest


# ---------------------------------------------------------------- WMT14


@dataclass
class WmtManifest:
    mirror: Path
    # pair ("de" or "fr") -> [(id, en, xx)] in the recipe's corpus order
    train_pairs: dict = field(default_factory=dict)
    dropped: dict = field(default_factory=dict)  # pair -> {id: reason}
    # pair -> [(id, en seg, xx seg)] exactly as written into the .sgm files
    valid: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)


WMT_CORPORA = {
    # pair -> [(archive, member prefix, member suffix, n_pairs)] in the recipe's order
    "de": [
        ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en", "", 120),
        ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en", "", 90),
        ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en", "", 70),
    ],
    "fr": [
        ("training-parallel-europarl-v7.tgz", "training/europarl-v7.fr-en", "", 80),
        ("training-parallel-commoncrawl.tgz", "commoncrawl.fr-en", "", 60),
        ("training-parallel-un.tgz", "un/undoc.2000.fr-en", "", 50),
        ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.fr-en", "", 50),
        ("training-giga-fren.tar", "giga-fren.release2.fixed", ".gz", 60),
    ],
}


def sgm(set_id, kind, lang, segs):
    lines = [f'<{kind} setid="{set_id}" srclang="any" trglang="{lang}">']
    lines.append('<doc sysid="ref" docid="doc-1" genre="news" origlang="en">')
    lines.append("<p>")
    lines += [f'<seg id="{i + 1}">{text}</seg>' for i, text in enumerate(segs)]
    lines += ["</p>", "</doc>", f"</{kind}>"]
    return lines_text(lines)


def build_wmt(dest_dir):
    """A mirror directory with every WMT14 en-de and en-fr download, named like the URLs."""
    mirror = Path(dest_dir)
    mirror.mkdir(parents=True, exist_ok=True)
    maker = SentenceMaker(seed=2014)
    manifest = WmtManifest(mirror=mirror)
    members = {}  # archive -> {member: bytes/text}
    number = 10000
    for xx, corpora in WMT_CORPORA.items():
        pairs, dropped = [], {}
        for corpus_index, (archive, prefix, suffix, n_pairs) in enumerate(corpora):
            en_lines, xx_lines = [], []
            for index in range(n_pairs):
                if corpus_index == 1 and index == 3:  # 2 vs 61 words: length ratio far above 1.5
                    pair = maker.pair(number, "en", xx, n_src=1, n_tgt=60)
                    dropped[number] = "ratio"
                elif corpus_index == 1 and index == 4:  # >= 300 pieces per side: above 250
                    pair = maker.pair(number, "en", xx, n_src=299, n_tgt=299)
                    dropped[number] = "too long"
                elif corpus_index == 0 and index == 5:  # punctuation to normalise
                    num, en, tr = maker.pair(number, "en", xx)
                    pair = (num, en + " \u201cquoted\u201d \u2013 5 %", tr + " \u201equoted\u201c \u2013 5 %")
                elif corpus_index == 0 and index == 7:  # characters of the test sets
                    num, en, tr = maker.pair(number, "en", xx)
                    pair = (num, en + " AT&amp;T", tr + " AT&amp;T")
                elif corpus_index == 0 and index == 6:  # '\r' and tab inside a sentence
                    num, en, tr = maker.pair(number, "en", xx)
                    pair = (num, en + "\rkaxo\tlox", tr + "\rkaxo\tlox")
                else:
                    pair = maker.pair(number, "en", xx)
                en_lines.append(pair[1])
                xx_lines.append(pair[2])
                pairs.append(pair)
                number += 1
            if corpus_index == 2:  # an empty pair: removed by the minimum length
                en_lines.append("")
                xx_lines.append("")
                pairs.append((None, "", ""))
            for lang, lines in (("en", en_lines), (xx, xx_lines)):
                data = lines_text(lines).encode("utf-8")
                if suffix == ".gz":
                    data = gzip.compress(data)
                members.setdefault(archive, {})[f"{prefix}.{lang}{suffix}"] = data
        manifest.train_pairs[xx] = pairs
        manifest.dropped[xx] = dropped

    # newstest2013 is multi-parallel: one English source for de and fr.
    valid_rows = []
    for index in range(8):
        num, en, de = maker.pair(80000 + index, "en", "de")
        fr = f"{id_token(num)} {maker.words('fr', len(en.split()) - 1)}"
        valid_rows.append((num, en, de, fr))
    members["test.tgz"] = {
        "test/newstest2013-src.en.sgm": sgm("newstest2013", "srcset", "en", [r[1] for r in valid_rows]),
        "test/newstest2013-src.de.sgm": sgm("newstest2013", "srcset", "de", [r[2] for r in valid_rows]),
        "test/newstest2013-src.fr.sgm": sgm("newstest2013", "srcset", "fr", [r[3] for r in valid_rows]),
    }
    manifest.valid = {
        "de": [(r[0], r[1], r[2]) for r in valid_rows],
        "fr": [(r[0], r[1], r[3]) for r in valid_rows],
    }
    members["test-full.tgz"] = {}
    for xx, base in (("de", 81000), ("fr", 82000)):
        rows = []
        for index in range(8):
            num, en, tr = maker.pair(base + index, "en", xx)
            if index == 2:  # kept verbatim in test.raw.*: entity, quotes, double space
                en, tr = en + " AT&amp;T  \u201cx\u201d", tr + " AT&amp;T  \u201ex\u201c"
            rows.append((num, en, tr))
        manifest.test[xx] = rows
        pair_name = f"{xx}en"
        full = members["test-full.tgz"]
        full[f"test-full/newstest2014-{pair_name}-src.en.sgm"] = sgm("newstest2014", "srcset", "en", [r[1] for r in rows])
        full[f"test-full/newstest2014-{pair_name}-ref.{xx}.sgm"] = sgm("newstest2014", "refset", xx, [r[2] for r in rows])
        # The other direction's files exist in the real archive too; never used here.
        full[f"test-full/newstest2014-{pair_name}-src.{xx}.sgm"] = sgm("newstest2014", "srcset", xx, [r[2] for r in rows])

    for archive, files in members.items():
        mode = "w" if archive.endswith(".tar") else "w:gz"
        with tarfile.open(mirror / archive, mode) as tar:
            for member, data in files.items():
                add_to_tar(tar, member, data)
    return manifest


# ---------------------------------------------------------------- Multi30k

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")


def build_multi30k(dest_dir, sizes=(300, 20, 20)):
    """{train,val,test_2016_flickr}.{en,de,fr}.gz as in multi30k/dataset data/task1/raw."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    maker = SentenceMaker(seed=30)
    rows_by_split = {}
    number = 0
    for split, size in zip(MULTI30K_SPLITS, sizes):
        rows = []
        for _ in range(size):
            num, en, de = maker.pair(number, "en", "de")
            fr = f"{id_token(num)} {maker.words('fr', len(en.split()) - 1)}"
            rows.append((num, en, de, fr))
            number += 1
        rows_by_split[split] = rows
        for lang, column in (("en", 1), ("de", 2), ("fr", 3)):
            data = lines_text([row[column] for row in rows]).encode("utf-8")
            (dest / f"{split}.{lang}.gz").write_bytes(gzip.compress(data))
    return rows_by_split
