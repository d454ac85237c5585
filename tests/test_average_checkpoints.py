"""Tests of rfa_fairseq.cli.average_checkpoints on tiny saved state dicts."""
import argparse
import collections

import pytest
import torch

from rfa_fairseq.cli import average_checkpoints as avg


def save_checkpoint(path, seed, extra=None):
    generator = torch.Generator().manual_seed(seed)
    model = collections.OrderedDict(
        weight=torch.randn(3, 4, generator=generator),
        half=torch.randn(2, generator=generator).half(),
        steps=torch.tensor([seed * 3 + 1], dtype=torch.long),
    )
    # Like a fairseq checkpoint: legacy args as an argparse.Namespace next to the weights.
    state = {"args": argparse.Namespace(arch="transformer", seed=seed), "cfg": {"model": None},
             "model": model, "optimizer_history": [{"num_updates": seed}]}
    state.update(extra or {})
    torch.save(state, path)
    return state


def load(path):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu")  # weights_only (torch's default)


def test_average_of_two_checkpoints_is_the_mean(tmp_path):
    first = save_checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    second = save_checkpoint(tmp_path / "checkpoint2.pt", seed=2)
    output = tmp_path / "out" / "averaged.pt"
    assert avg.main(["--inputs", str(tmp_path), "--num-epoch-checkpoints", "2", "--output", str(output)]) == 0
    result = load(output)
    model = result["model"]
    torch.testing.assert_close(model["weight"], (first["model"]["weight"] + second["model"]["weight"]) / 2)
    expected_half = (first["model"]["half"].float() + second["model"]["half"].float()) / 2
    torch.testing.assert_close(model["half"], expected_half)  # summed and kept in fp32
    assert model["steps"].dtype == torch.long
    assert model["steps"].item() == (4 + 7) // 2  # integer buffers: floor of the mean
    # Everything but the model comes from the newest checkpoint (checkpoint2).
    assert result["args"].seed == 2 and result["optimizer_history"] == [{"num_updates": 2}]
    assert not list(output.parent.glob("*.tmp*"))


def test_last_n_selection_is_numeric_and_respects_upper_bound(tmp_path):
    for epoch in (1, 2, 9, 10):
        save_checkpoint(tmp_path / f"checkpoint{epoch}.pt", seed=epoch)
    for epoch, update in ((3, 500), (4, 1000), (5, 1500)):
        save_checkpoint(tmp_path / f"checkpoint_{epoch}_{update}.pt", seed=update)
    (tmp_path / "checkpoint_best.pt").write_bytes(b"")
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")
    names = lambda paths: [p.rsplit("/", 1)[1] for p in paths]  # noqa: E731
    assert names(avg.last_n_checkpoints(str(tmp_path), 2, update_based=False)) == ["checkpoint10.pt", "checkpoint9.pt"]
    assert names(avg.last_n_checkpoints(str(tmp_path), 2, update_based=False, upper_bound=9)) == [
        "checkpoint9.pt", "checkpoint2.pt"]
    assert names(avg.last_n_checkpoints(str(tmp_path), 2, update_based=True)) == [
        "checkpoint_5_1500.pt", "checkpoint_4_1000.pt"]
    with pytest.raises(avg.AveragingError, match="found 3 update checkpoints .* but need 4"):
        avg.last_n_checkpoints(str(tmp_path), 4, update_based=True)


def test_mismatched_parameters_are_reported(tmp_path, capsys):
    save_checkpoint(tmp_path / "a.pt", seed=1)
    save_checkpoint(tmp_path / "b.pt", seed=2, extra={"model": {"other": torch.zeros(1)}})
    output = tmp_path / "avg.pt"
    assert avg.main(["--inputs", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'b.pt'} has different parameters" in err
    assert not output.exists()


class NotAllowlisted:
    pass


def test_checkpoint_with_unknown_class_is_refused_not_unpickled(tmp_path, capsys):
    save_checkpoint(tmp_path / "checkpoint1.pt", seed=1, extra={"trainer_object": NotAllowlisted()})
    output = tmp_path / "avg.pt"
    assert avg.main(["--inputs", str(tmp_path / "checkpoint1.pt"), "--output", str(output)]) == 1
    err = capsys.readouterr().err
    assert "weights_only" in err and "NotAllowlisted" in err and str(tmp_path / "checkpoint1.pt") in err
    assert not output.exists()


def test_missing_checkpoint_is_named(tmp_path, capsys):
    missing = tmp_path / "checkpoint7.pt"
    assert avg.main(["--inputs", str(missing), "--output", str(tmp_path / "o.pt")]) == 1
    assert f"checkpoint not found: {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--num-epoch-checkpoints", "--num-update-checkpoints"])
def test_zero_checkpoints_to_average_is_refused_naming_the_count(tmp_path, capsys, flag):
    save_checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    assert avg.main(["--inputs", str(tmp_path), flag, "0", "--output", str(tmp_path / "o.pt")]) == 1
    assert "the number of checkpoints to average must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "o.pt").exists()
