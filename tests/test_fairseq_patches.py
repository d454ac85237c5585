"""The table of fairseq patches (rfa_fairseq/fairseq_compat.py PATCHES): each applies to the installed
fairseq (ve-fairseq 0.12.3), none applies to a source it was not checked against, and docs/design.md
lists exactly the table. Likewise the fairseq functions the native encoder repeats (NATIVE_ENCODER_MIRRORS): each is
the installed source, one that is not is named, and docs/design.md lists exactly them."""
import functools
import importlib
import threading
import warnings
from pathlib import Path

import pytest
from fairseq import options
from fairseq.data import iterators
from fairseq.distributed import utils as distributed_utils
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
from fairseq_cli import interactive as interactive_cli

from rfa_fairseq import fairseq_compat, fairseq_mirrors, fairseq_sources
from rfa_fairseq.fairseq_compat import APPLIED, PATCHES, PATCHES_BY_NAME, FairseqPatchSkipped
from rfa_fairseq.fairseq_mirrors import NATIVE_ENCODER_MIRRORS

DESIGN_DOC = Path(__file__).resolve().parents[1] / "docs" / "design.md"
TABLE_SECTION = "### fairseq patches"
MIRROR_TABLE_SECTION = "### fairseq functions the native encoder repeats"


@pytest.fixture
def atexit_registrations(monkeypatch):
    """What applying stoppable-data-thread registers for interpreter exit (recorded, not registered)."""
    registered = []
    monkeypatch.setattr(threading, "_register_atexit", registered.append)
    return registered


@pytest.mark.parametrize("patch", PATCHES, ids=lambda patch: patch.name)
def test_patch_applies_to_the_installed_fairseq(patch, monkeypatch, atexit_registrations):
    owner, attribute = fairseq_sources.owner_of(patch)
    installed = getattr(owner, attribute)
    if patch.at_import:
        assert patch.name in APPLIED, f"{patch.name} was not applied when rfa_fairseq was imported"
        assert getattr(installed, "rfa_fairseq_wrapper", False)
        original = APPLIED[patch.name]
    else:
        assert not getattr(installed, "rfa_fairseq_wrapper", False), f"{patch.name} is for its own command only"
        original = installed
    assert fairseq_sources.source_fingerprint(original) == patch.fingerprint

    # applied afresh onto fairseq's own attribute: no warning, replaced, and a second application changes nothing
    monkeypatch.setattr(owner, attribute, original)
    monkeypatch.delitem(APPLIED, patch.name, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FairseqPatchSkipped)
        assert fairseq_compat.apply_patch(patch.name)
    replaced = getattr(owner, attribute)
    assert replaced is not original and replaced.rfa_fairseq_wrapper
    assert APPLIED[patch.name] is original
    assert fairseq_compat.apply_patch(patch.name) and getattr(owner, attribute) is replaced
    expected_registrations = [fairseq_compat.stop_data_threads] if patch.name == "stoppable-data-thread" else []
    assert atexit_registrations == expected_registrations


def test_bf16_on_gpu_trains_bf16_without_a_tpu(monkeypatch):
    monkeypatch.setattr("sys.argv", ["rfa-train"])
    monkeypatch.setattr(options, "parse_args_and_arch", options.parse_args_and_arch)  # fairseq's, back afterwards

    def parse():
        return options.parse_args_and_arch(options.get_training_parser(),
                                           input_args=["data", "--arch", "transformer", "--bf16"])

    assert parse().tpu, "fairseq no longer reads --bf16 as a TPU run: bf16-on-gpu may be unneeded"
    assert fairseq_compat.apply_patch("bf16-on-gpu")
    args = parse()
    assert args.bf16 and not args.tpu


def _skipped(name):
    """apply_patch(name), which must refuse: the warning's text."""
    with pytest.warns(FairseqPatchSkipped) as caught:
        assert not fairseq_compat.apply_patch(name)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"patch {name!r} not applied" in message and PATCHES_BY_NAME[name].target in message
    assert PATCHES_BY_NAME[name].without in message, "the warning must say what the user loses"
    return message


def test_another_fairseq_version_is_not_patched(monkeypatch):
    def buffered_read(input, buffer_size):  # same name and signature, another body
        yield [input]

    monkeypatch.setattr(interactive_cli, "buffered_read", buffered_read)
    message = _skipped("utf8-interactive-input")
    assert interactive_cli.buffered_read is buffered_read
    assert f"{__file__}:{buffered_read.__code__.co_firstlineno}" in message, "the warning must say where it comes from"


def test_another_packages_wrapper_is_not_patched(monkeypatch):
    fairseqs = APPLIED["broadcast-checkpoint-classes"]

    @functools.wraps(fairseqs)  # inspect.getsource alone would read fairseq's source through it
    def _broadcast_object_slow(*args, **kwargs):
        return fairseqs(*args, **kwargs)

    monkeypatch.setattr(distributed_utils, "_broadcast_object_slow", _broadcast_object_slow)
    assert "under 1 functools.wraps wrapper(s)" in _skipped("broadcast-checkpoint-classes")
    assert distributed_utils._broadcast_object_slow is _broadcast_object_slow


def test_another_class_is_not_replaced(monkeypatch, atexit_registrations):
    class BackgroundConsumer(threading.Thread):
        pass

    monkeypatch.setattr(iterators, "BackgroundConsumer", BackgroundConsumer)
    _skipped("stoppable-data-thread")
    assert iterators.BackgroundConsumer is BackgroundConsumer
    assert atexit_registrations == [], "a patch not applied must register nothing for exit"


def test_a_missing_attribute_is_not_patched(monkeypatch):
    monkeypatch.delattr(distributed_utils, "_broadcast_object_slow")
    assert "does not exist" in _skipped("broadcast-checkpoint-classes")
    assert not hasattr(distributed_utils, "_broadcast_object_slow")


def _design_table(section):
    lines = DESIGN_DOC.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(section))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[first:end]


def test_design_doc_lists_exactly_the_patches():
    table = _design_table(TABLE_SECTION)
    names = [row.split("|")[1].strip().strip("`") for row in table[2:]]
    assert names == [patch.name for patch in PATCHES], \
        f"docs/design.md ({TABLE_SECTION}) lists {names}; fairseq_compat.PATCHES has {[p.name for p in PATCHES]}"
    assert "\n".join(table) + "\n" == fairseq_compat.patch_table_markdown(), \
        f"docs/design.md's table differs from PATCHES; replace it by:\n{fairseq_compat.patch_table_markdown()}"


@pytest.mark.parametrize("mirror", NATIVE_ENCODER_MIRRORS, ids=lambda mirror: mirror.attribute)
def test_the_native_encoder_repeats_the_installed_fairseqs_functions(mirror):
    owner, attribute = fairseq_sources.owner_of(mirror)
    assert fairseq_sources.source_fingerprint(getattr(owner, attribute)) == mirror.fingerprint
    assert fairseq_mirrors.mirror_differences([mirror]) == []


def test_a_repeated_function_that_is_another_source_is_named(monkeypatch):
    fairseqs = TransformerEncoderLayerBase.residual_connection

    @functools.wraps(fairseqs)  # inspect.getsource alone would read fairseq's source through it
    def residual_connection(self, x, residual):
        return fairseqs(self, x, residual)

    monkeypatch.setattr(TransformerEncoderLayerBase, "residual_connection", residual_connection)
    monkeypatch.delattr(importlib.import_module("fairseq.modules.gelu"), "gelu")  # fairseq.modules.gelu: the function
    wrapped, missing = fairseq_mirrors.mirror_differences()
    target = "fairseq.modules.transformer_layer.TransformerEncoderLayerBase.residual_connection"
    found = fairseq_sources.source_fingerprint(residual_connection)
    assert wrapped.startswith(f"{target} has source fingerprint {found}")
    assert "under 1 functools.wraps wrapper(s)" in wrapped and wrapped.endswith(", not 1c6230dbfed67760")
    assert missing == "fairseq.modules.gelu.gelu does not exist, not 0de24078000675a6"


def test_design_doc_lists_exactly_the_native_encoders_mirrors():
    table = _design_table(MIRROR_TABLE_SECTION)
    assert "\n".join(table) + "\n" == fairseq_mirrors.mirror_table_markdown(), \
        f"docs/design.md's table differs from NATIVE_ENCODER_MIRRORS; replace it by:\n" \
        f"{fairseq_mirrors.mirror_table_markdown()}"
