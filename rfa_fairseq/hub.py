"""Python API: load a trained model and translate sentences, in batches.

    from rfa_fairseq import hub

    translator = hub.load("checkpoints/checkpoint_best.pt", "data-bin")
    translator.translate(["a sentence", "another sentence"], beam=4)      # -> a list of str

`load` returns a `Translator`: fairseq's `GeneratorHubInterface` (what `TransformerModel.from_pretrained` returns)
in eval mode, on the GPU when there is one: `translate(sentences, beam=...)` tokenizes each sentence (SentencePiece
when the data has a model), splits the list into batches of `batch_size` sentences (and at most
`max_tokens` tokens), runs the beam search and returns the detokenized best hypotheses in input order.
For an `rfa_transformer` the beam search is the plugin's static one, as in fairseq-generate. Other
generation options go to `translate` as keywords (`lenpen=0.6`, `max_len_b=100`, `nbest` via
`generate`, ...); `translator.generate(...)` returns the hypotheses with their scores and tokens.

fairseq's own call works too (the plugin is registered when `rfa_fairseq` is imported, or by `user_dir`):

    from fairseq.models.transformer import TransformerModel
    translator = TransformerModel.from_pretrained("checkpoints", checkpoint_file="checkpoint_best.pt",
                                                  data_name_or_path="/abs/path/data-bin", user_dir=USER_DIR)

`load` adds: one checkpoint path, the data's SentencePiece model found as the data-prep scripts write it,
the decoding defaults of scripts/generate.sh (max length = source + 50), batch sizes, the device, errors
that name the missing file before fairseq starts, and `translate` / `sample` checking that every sentence is a
string before any is encoded (`Translator`: a TypeError naming the first that is not, by index and type).
"""
import os
from typing import Optional, Union

from fairseq.hub_utils import GeneratorHubInterface

from . import __version__  # noqa: F401  (importing the package registers the plugin with fairseq)

AUTO = "auto"


class Translator(GeneratorHubInterface):
    """fairseq's GeneratorHubInterface (what `load` returns) whose `translate` and `sample` refuse a sentence that is
    not a string before any is encoded: fairseq's tokenizer fails on it with a TypeError that names neither the
    sentence nor its place in the list."""

    def sample(self, sentences, beam: int = 1, verbose: bool = False, **kwargs):
        if not isinstance(sentences, str):
            sentences = check_sentences(sentences)
        return super().sample(sentences, beam, verbose, **kwargs)


def check_sentences(sentences) -> list:
    """`sentences` as a list of str, or a TypeError naming the first element that is not a string (index and type)."""
    try:
        sentences = list(sentences)
    except TypeError:
        raise TypeError(f"translate takes a str or a list of str, got {type(sentences).__name__}") from None
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise TypeError(f"sentences[{i}] is {type(sentence).__name__} ({sentence!r:.40}), not str: translate "
                            f"takes a str or a list of str")
    return sentences


def _dictionaries(data: str):
    return sorted(name for name in os.listdir(data) if name.startswith("dict.") and name.endswith(".txt"))


def load(checkpoint: Union[str, os.PathLike], data: Union[str, os.PathLike], *,
         sentencepiece_model: Optional[Union[str, os.PathLike]] = AUTO,
         batch_size: Optional[int] = 64, max_tokens: Optional[int] = None,
         max_len_a: float = 1.0, max_len_b: int = 50,
         source_lang: Optional[str] = None, target_lang: Optional[str] = None,
         device: Optional[str] = None, fp16: bool = False, **overrides):
    """Load `checkpoint` (an rfa_transformer or a fairseq transformer checkpoint) with the dictionaries
    of `data` (the fairseq-preprocess --destdir it was trained on); returns a Translator (fairseq's
    GeneratorHubInterface).

    sentencepiece_model: the SentencePiece model of the data ("auto": DATA/../spm.model, where the data-prep
        scripts write it, when it exists; None: the sentences are already in the model's tokens).
    batch_size, max_tokens: the most sentences and tokens per batch of translate() (None: no limit).
    max_len_a, max_len_b: longest output, max_len_a * source length + max_len_b tokens.
    device: "cpu", "cuda", "cuda:1", ... (default: "cuda" when available, else "cpu").
    fp16: half-precision weights (GPU only).
    overrides: other fairseq options of the checkpoint's configuration, by name (e.g. rfa_decode_kernel="torch").
    """
    import torch
    from fairseq import hub_utils
    from fairseq.models.transformer import TransformerModel
    from omegaconf import open_dict

    checkpoint, data = os.fspath(checkpoint), os.fspath(data)
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"checkpoint not found: {checkpoint}")
    if not os.path.isdir(data):
        raise FileNotFoundError(f"data directory not found: {data} (the fairseq-preprocess --destdir of the model)")
    if not _dictionaries(data):
        raise ValueError(f"no dict.<lang>.txt in {data}: give the fairseq-preprocess --destdir the model was trained on")
    if sentencepiece_model == AUTO:
        candidate = os.path.join(os.path.dirname(os.path.abspath(data)), "spm.model")
        sentencepiece_model = candidate if os.path.isfile(candidate) else None
    elif sentencepiece_model is not None:
        sentencepiece_model = os.fspath(sentencepiece_model)
        if not os.path.isfile(sentencepiece_model):
            raise FileNotFoundError(f"SentencePiece model not found: {sentencepiece_model}")
    for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if batch_size is None and max_tokens is None:
        raise ValueError("give batch_size or max_tokens (or both): fairseq needs one of them to form batches")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if fp16 and not device.startswith("cuda"):
        raise ValueError(f"fp16=True needs a CUDA device, got device={device!r}")

    if sentencepiece_model is not None:
        overrides.update(bpe="sentencepiece", sentencepiece_model=sentencepiece_model)
    if source_lang is not None:
        overrides["source_lang"] = source_lang
    if target_lang is not None:
        overrides["target_lang"] = target_lang
    # TransformerModel.from_pretrained's loading, into a Translator (without its INFO line of the whole configuration)
    loaded = hub_utils.from_pretrained(
        os.path.dirname(os.path.abspath(checkpoint)), checkpoint_file=os.path.basename(checkpoint),
        data_name_or_path=os.path.abspath(data), archive_map=TransformerModel.hub_models(), **overrides)
    translator = Translator(loaded["args"], loaded["task"], loaded["models"])
    with open_dict(translator.cfg):
        translator.cfg.dataset.batch_size = batch_size
        translator.cfg.dataset.max_tokens = max_tokens
        translator.cfg.generation.max_len_a = max_len_a
        translator.cfg.generation.max_len_b = max_len_b
    translator.eval()
    if fp16:
        translator.half()
    return translator.to(device)
