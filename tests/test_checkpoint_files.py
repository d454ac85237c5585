"""Checkpoint files as a killed or misused process leaves them: written atomically, checked against
their checksums when loaded, named in every error, and the checkpoint fairseq-train resumes from is
the newest intact one (rfa_fairseq/checkpoints.py, rfa_fairseq/resume.py). Small hand-made
checkpoints here; tests/test_kill_resume.py kills real training."""
import logging
import os
import re
import struct
import zipfile

import pytest
import torch

import rfa_fairseq  # noqa: F401  (installs the fairseq wrappers)
from fairseq import checkpoint_utils
from rfa_fairseq import checkpoints, resume
from rfa_fairseq.config import RFAOptionMismatchError
from rfa_fairseq.checkpoints import (DamagedCheckpointError, NotACheckpointError, copy_atomic, num_updates, safe_load,
                                     save_atomic, verify_checkpoint_file)


def fake_checkpoint(path, updates, size=64):
    """A fairseq-shaped checkpoint at `updates` updates, written as fairseq-train writes it (save_atomic)."""
    state = {"args": None, "cfg": None, "model": {"weight": torch.arange(size, dtype=torch.float32) + updates},
             "optimizer_history": [{"num_updates": updates, "optimizer_name": "Adam", "lr_scheduler_state": {}}],
             "extra_state": {"train_iterator": {"epoch": 1}}}
    save_atomic(state, str(path))
    return path


def truncate(path, fraction=0.5):
    with open(path, "r+b") as handle:
        handle.truncate(int(os.path.getsize(path) * fraction))


def overwrite_tensor_bytes(path):
    """Bytes 4-12 of the first tensor's data overwritten, the file's size and structure unchanged."""
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if re.search(r"/data/\d+$", info.filename))
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset + 26)  # the local header: name and extra-field lengths, then the data
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
        handle.seek(record.header_offset + 30 + name_length + extra_length + 4)
        handle.write(b"\xff" * 8)
    return record.filename


# ---------------------------------------------------------------- writing


def test_save_atomic_and_copy_atomic_replace_whole_files_and_leave_no_temporary(tmp_path):
    target = tmp_path / "checkpoint_last.pt"
    fake_checkpoint(target, 1)
    fake_checkpoint(tmp_path / "checkpoint_1_2.pt", 2)
    copy_atomic(str(tmp_path / "checkpoint_1_2.pt"), str(target))
    assert num_updates(safe_load(str(target))) == 2
    # an independent file, not a second name of the same one
    assert os.stat(target).st_ino != os.stat(tmp_path / "checkpoint_1_2.pt").st_ino
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_2.pt", "checkpoint_last.pt"]
    with pytest.raises(IsADirectoryError, match="is a directory; give the checkpoint a file name"):
        save_atomic({}, str(tmp_path))


def test_fairseq_copies_checkpoints_atomically_through_the_plugin(tmp_path):
    # fairseq's save_checkpoint copies checkpoint_E_U.pt to checkpoint_last.pt with PathManager.copy
    assert checkpoint_utils.PathManager.copy.__qualname__.startswith("AtomicCopyPathManager")
    fake_checkpoint(tmp_path / "checkpoint_1_4.pt", 4)
    assert checkpoint_utils.PathManager.copy(str(tmp_path / "checkpoint_1_4.pt"), str(tmp_path / "checkpoint_last.pt"),
                                             overwrite=True)
    assert num_updates(safe_load(str(tmp_path / "checkpoint_last.pt"))) == 4
    checkpoint_utils.torch_persistent_save({"optimizer_history": [{"num_updates": 5}]}, str(tmp_path / "x.pt"))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_4.pt", "checkpoint_last.pt", "x.pt"]  # no x.pt.tmp left


# ---------------------------------------------------------------- loading


def test_files_that_are_not_checkpoints_are_named(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello world\n")
    with pytest.raises(NotACheckpointError) as error:
        safe_load(str(text))
    assert str(error.value) == (f"{text} is not a torch checkpoint (12 bytes, starting with 'hello world\\n'; a "
                                "checkpoint written by torch.save/fairseq-train is a zip archive): check the file name "
                                "you passed")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(NotACheckpointError, match=f"{empty} is empty"):
        safe_load(str(empty))
    with pytest.raises(NotACheckpointError, match=f"{tmp_path} is a directory, not a checkpoint file"):
        safe_load(str(tmp_path))
    # fairseq's own loader (fairseq-generate --path, fairseq-train --restore-file) says the same
    with pytest.raises(NotACheckpointError, match=f"{text} is not a torch checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(text))


def test_truncated_and_overwritten_checkpoints_are_refused_naming_file_and_record(tmp_path):
    truncated = fake_checkpoint(tmp_path / "truncated.pt", 3)
    truncate(truncated)
    with pytest.raises(DamagedCheckpointError, match=f"checkpoint {truncated} is truncated"):
        safe_load(str(truncated))

    overwritten = fake_checkpoint(tmp_path / "overwritten.pt", 3)
    torch.load(overwritten, weights_only=True)  # fine before
    record = overwrite_tensor_bytes(overwritten)
    # torch itself loads the changed weights without complaint
    assert not torch.equal(torch.load(overwritten, weights_only=True)["model"]["weight"], torch.arange(64.0) + 3)
    expected = re.escape(f"checkpoint {overwritten} is damaged: record {record} (tensor data, 256 bytes) fails its CRC-32 "
                         "check, its bytes changed after it was saved; pass an intact checkpoint")
    with pytest.raises(DamagedCheckpointError, match=expected):
        safe_load(str(overwritten))
    with pytest.raises(DamagedCheckpointError, match=expected):
        checkpoint_utils.load_checkpoint_to_cpu(str(overwritten))
    verify_checkpoint_file(str(overwritten), checksums=False)  # the cheap check sees a complete archive


def test_unknown_rfa_keys_in_model_overrides_are_warned_with_the_closest_option(tmp_path):
    path = str(fake_checkpoint(tmp_path / "checkpoint.pt", 1))
    with pytest.warns(UserWarning, match="--model-overrides key 'rfa_decode_kernal' is not an RFA option and changes "
                                         "nothing; did you mean 'rfa_decode_kernel'"):
        checkpoint_utils.load_checkpoint_to_cpu(path, arg_overrides={"rfa_decode_kernal": "torch", "beam": 2})
    assert checkpoints.warn_unknown_rfa_overrides({"rfa_decode_kernel": "torch", "data": "x"}) == []


@pytest.mark.parametrize("name,value", [("rfa_sigma_lr_multiplier", 1.0), ("rfa_sigma", "learned")])
def test_overrides_of_sigmas_parametrization_are_refused(name, value):
    """Under --rfa-sigma log the checkpoint stores theta of sigma = exp(m * theta): another m or mode would
    load and silently compute another sigma (or fail on the parameter's name)."""
    state = {"args": None, "cfg": {"model": {"_name": "rfa_transformer", "rfa_sigma": "log", "rfa_sigma_lr_multiplier": 10.0}}}
    with pytest.raises(RFAOptionMismatchError, match=f"--model-overrides sets {name}="):
        checkpoints.check_rfa_overrides("ckpt.pt", state, {name: value})
    checkpoints.check_rfa_overrides("ckpt.pt", state, {"rfa_chunk_size": 4, "rfa_temperature": 2.0})


def test_checkpoints_in_torchs_legacy_format_are_read_where_options_are_read_cheaply(tmp_path):
    """torch < 1.6 wrote checkpoints that are no zip archive and cannot be memory-mapped: the cheap reads
    (resume's update count, the --model-overrides check) read them whole instead of calling them damaged."""
    state = {"args": None, "cfg": {"model": {"_name": "rfa_transformer", "rfa_num_features": 8}},
             "model": {"weight": torch.zeros(4)}, "optimizer_history": [{"num_updates": 37}]}
    path = str(tmp_path / "checkpoint_last.pt")
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert resume.saved_updates(path) == 37
    assert safe_load(path, mmap=True)["cfg"] == state["cfg"]
    with pytest.raises(RFAOptionMismatchError, match="rfa_num_features=16"):
        checkpoints.check_checkpoint_against_overrides(path, {"rfa_num_features": 16})


def mapped_files():
    """The files this process maps (/proc/self/maps), or None where there is no /proc."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    except OSError:
        return None


def test_fairseq_loads_checkpoints_mapped_and_legacy_ones_whole(tmp_path):
    """load_checkpoint_to_cpu (fairseq's code under the plugin) maps a zip checkpoint instead of reading it whole (what
    generation never touches, the optimizer's state, is never read), with the same contents as torch.load's; torch <
    1.6's format, which cannot be mapped, is read whole."""
    if mapped_files() is None:
        pytest.skip("no /proc/self/maps here: the mapping cannot be observed")
    state = {"args": None, "cfg": None, "model": {"weight": torch.randn(256, 64)},
             "last_optimizer_state": {"state": {0: {"exp_avg": torch.randn(256, 64)}}},
             "optimizer_history": [{"num_updates": 3, "optimizer_name": "Adam", "lr_scheduler_state": {}}],
             "extra_state": {"train_iterator": {"epoch": 1}}}
    zipped, legacy = str(tmp_path / "zipped.pt"), str(tmp_path / "legacy.pt")
    save_atomic(state, zipped)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    for path, mapped in ((zipped, True), (legacy, False)):
        loaded = checkpoint_utils.load_checkpoint_to_cpu(path)
        assert (os.path.realpath(path) in mapped_files()) == mapped, path
        assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
        exp_avg = loaded["last_optimizer_state"]["state"][0]["exp_avg"]
        assert torch.equal(exp_avg, state["last_optimizer_state"]["state"][0]["exp_avg"])
        exp_avg.add_(1.0)  # a private mapping: written in memory (training's optimizer), never into the file
        del loaded, exp_avg
    assert torch.equal(torch.load(zipped, weights_only=True)["last_optimizer_state"]["state"][0]["exp_avg"],
                       state["last_optimizer_state"]["state"][0]["exp_avg"])
    assert os.path.realpath(zipped) not in mapped_files()  # unmapped with the last tensor of the state


# ---------------------------------------------------------------- which checkpoint training resumes from


@pytest.fixture
def resume_warnings(caplog):
    caplog.set_level(logging.WARNING, logger="rfa_fairseq.resume")
    return lambda: [record.getMessage() for record in caplog.records if record.name == "rfa_fairseq.resume"]


def test_resume_replaces_a_torn_checkpoint_last_with_the_newest_intact_one(tmp_path, resume_warnings):
    fake_checkpoint(tmp_path / "checkpoint_1_4.pt", 4)
    fake_checkpoint(tmp_path / "checkpoint_1_8.pt", 8)
    fake_checkpoint(tmp_path / "checkpoint_best.pt", 8)
    last = fake_checkpoint(tmp_path / "checkpoint_last.pt", 8)
    truncate(last)
    (tmp_path / "checkpoint_1_12.pt.tmp4242").write_bytes(b"PK\x03\x04 half")  # a killed write's temporary file

    assert resume.remove_stale_temporaries(str(tmp_path)) == [str(tmp_path / "checkpoint_1_12.pt.tmp4242")]
    assert resume.plan_resume("checkpoint_last.pt", str(tmp_path)) is None  # fairseq then loads checkpoint_last.pt
    assert num_updates(safe_load(str(last))) == 8
    [warning] = resume_warnings()
    assert warning.startswith(f"{last} cannot be loaded (checkpoint {last} is truncated")
    assert warning.endswith(f"kept as {last}.damaged); resuming from {tmp_path}/checkpoint_best.pt (8 updates), the "
                            f"newest intact checkpoint in {tmp_path}, now also {last}")
    assert (tmp_path / "checkpoint_last.pt.damaged").exists()
    assert resume.plan_resume("checkpoint_last.pt", str(tmp_path)) is None and len(resume_warnings()) == 1


def test_resume_takes_a_newer_checkpoint_than_checkpoint_last(tmp_path, resume_warnings):
    fake_checkpoint(tmp_path / "checkpoint_last.pt", 4)
    fake_checkpoint(tmp_path / "checkpoint_1_8.pt", 8)  # killed before the copy to checkpoint_last.pt
    overwrite_tensor_bytes(fake_checkpoint(tmp_path / "checkpoint_1_12.pt", 12))  # newest, but damaged
    resume.plan_resume("checkpoint_last.pt", str(tmp_path))
    assert num_updates(safe_load(str(tmp_path / "checkpoint_last.pt"))) == 8
    [warning] = resume_warnings()
    assert warning == (f"{tmp_path}/checkpoint_last.pt holds 4 updates (the run was stopped between writing the two); "
                       f"resuming from {tmp_path}/checkpoint_1_8.pt (8 updates), the newest intact checkpoint in "
                       f"{tmp_path}, now also {tmp_path}/checkpoint_last.pt")


def test_resume_never_starts_from_update_0_while_a_checkpoint_is_there(tmp_path, resume_warnings):
    # the first save wrote checkpoint_1_4.pt and was killed before checkpoint_last.pt existed
    fake_checkpoint(tmp_path / "checkpoint_1_4.pt", 4)
    resume.plan_resume("checkpoint_last.pt", str(tmp_path))
    assert num_updates(safe_load(str(tmp_path / "checkpoint_last.pt"))) == 4
    assert "checkpoint_last.pt is missing (the run was stopped before writing it)" in resume_warnings()[0]
    # an empty directory is a first launch
    assert resume.plan_resume("checkpoint_last.pt", str(tmp_path / "new")) is None


def test_resume_with_nothing_intact_lists_what_was_tried(tmp_path):
    for name, updates in (("checkpoint_last.pt", 8), ("checkpoint_1_8.pt", 8), ("checkpoint_1_4.pt", 4)):
        truncate(fake_checkpoint(tmp_path / name, updates))
    with pytest.raises(resume.ResumeError) as error:
        resume.plan_resume("checkpoint_last.pt", str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"no checkpoint in --save-dir {tmp_path} is intact, so training cannot resume; tried: ")
    for name in ("checkpoint_last.pt", "checkpoint_1_8.pt", "checkpoint_1_4.pt"):
        assert f"{tmp_path / name}: checkpoint {tmp_path / name} is truncated" in message
    assert message.endswith("Pass an intact checkpoint with --restore-file, or move these files away to train from "
                            "update 0")


def test_explicit_restore_file_that_does_not_load_falls_back_to_the_save_dir(tmp_path, resume_warnings):
    restore = tmp_path / "elsewhere.pt"
    restore.write_text("not a checkpoint")
    save_dir = tmp_path / "save"
    save_dir.mkdir()
    with pytest.raises(resume.ResumeError, match=f"--restore-file {restore} cannot be loaded and no checkpoint in "
                                                 f"--save-dir {save_dir} is intact; tried: {restore}: {restore} is not"):
        resume.plan_resume(str(restore), str(save_dir))
    fake_checkpoint(save_dir / "checkpoint_1_6.pt", 6)
    assert resume.plan_resume(str(restore), str(save_dir)) == str(save_dir / "checkpoint_1_6.pt")
    assert resume_warnings()[-1].startswith(f"--restore-file {restore} cannot be loaded ({restore} is not a torch "
                                            f"checkpoint")
    good = fake_checkpoint(tmp_path / "good.pt", 2)
    assert resume.plan_resume(str(good), str(save_dir)) is None  # an intact --restore-file is used as given
