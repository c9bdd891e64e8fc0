"""Resumable calibration: collect_stats(checkpoint_dir=...) checkpoints its running sums per chunk,
an interrupted run started again continues from the checkpoint and ends with the statistics of an
uninterrupted run, a checkpoint of another run is ignored with a warning, a finished run deletes it."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from devin_compile.quant.calibration import CHECKPOINT_FILE, collect_stats


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _chunks(n=5, length=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (length,), generator=gen) for _ in range(n)]


class Interrupt(Exception):
    pass


class Recorder:
    """A progress callable that records each ``done`` and raises after chunk ``stop``."""

    def __init__(self, stop=None):
        self.stop, self.done = stop, []

    def __call__(self, done, total, *info):
        self.done.append(done)
        if done == self.stop:
            raise Interrupt


def _assert_same(a, b):
    assert a.tokens == b.tokens and a.linear_input == b.linear_input and a.producer == b.producer
    for name in ("hessian", "absmean", "grad_hessian", "fisher"):
        da, db = getattr(a, name), getattr(b, name)
        assert set(da) == set(db) and da, name
        for k in da:
            torch.testing.assert_close(da[k], db[k], rtol=1e-6, atol=1e-7 * float(db[k].abs().max()))


@pytest.fixture(scope="module")
def model():
    return _tiny()


@pytest.fixture(scope="module")
def reference(model):
    return collect_stats(model, _chunks(), progress=False)


@pytest.mark.parametrize("fisher", [True, False])
def test_interrupted_run_resumes_to_the_uninterrupted_statistics(model, reference, tmp_path, fisher):
    chunks = _chunks()
    ref = reference if fisher else collect_stats(model, chunks, progress=False, fisher=False)
    with pytest.raises(Interrupt):
        collect_stats(model, chunks, progress=Recorder(stop=3), fisher=fisher, checkpoint_dir=tmp_path,
                      checkpoint_every=0)
    assert (tmp_path / CHECKPOINT_FILE).is_file()
    again = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = collect_stats(model, chunks, progress=again, fisher=fisher, checkpoint_dir=tmp_path,
                              checkpoint_every=0)
    assert again.done == [3, 4, 5]  # chunks 1-3 came from the checkpoint
    assert not (tmp_path / CHECKPOINT_FILE).exists()
    assert not list(tmp_path.iterdir())  # no temporary file left either
    if fisher:
        _assert_same(stats, ref)
    else:
        assert not stats.fisher and stats.tokens == ref.tokens
        for k in ref.hessian:
            torch.testing.assert_close(stats.hessian[k], ref.hessian[k])


def test_checkpoints_wait_for_the_interval(model, tmp_path):
    with pytest.raises(Interrupt):
        collect_stats(model, _chunks(), progress=Recorder(stop=4), checkpoint_dir=tmp_path, checkpoint_every=1e9)
    assert not (tmp_path / CHECKPOINT_FILE).exists()


@pytest.mark.parametrize("change", ["tokens", "chunk count", "model", "gradients"])
def test_a_checkpoint_of_another_run_is_ignored_with_one_warning(model, reference, tmp_path, change):
    with pytest.raises(Interrupt):
        collect_stats(model, _chunks(), progress=Recorder(stop=2), checkpoint_dir=tmp_path, checkpoint_every=0)
    chunks, other, fisher = _chunks(), model, True
    if change == "tokens":
        chunks = _chunks(seed=1)
    elif change == "chunk count":
        chunks = _chunks(n=4)
    elif change == "model":
        other = _tiny(seed=1)
    else:
        fisher = False
    progress = Recorder()
    with pytest.warns(UserWarning, match="ignoring calibration checkpoint") as caught:
        stats = collect_stats(other, chunks, progress=progress, fisher=fisher, checkpoint_dir=tmp_path,
                              checkpoint_every=0)
    assert len([w for w in caught if "calibration checkpoint" in str(w.message)]) == 1
    assert progress.done == list(range(1, len(chunks) + 1))  # from the start
    fresh = collect_stats(other, chunks, progress=False, fisher=fisher)
    for k in fresh.hessian:
        torch.testing.assert_close(stats.hessian[k], fresh.hessian[k])
    assert not (tmp_path / CHECKPOINT_FILE).exists()


def test_an_unreadable_checkpoint_is_ignored_with_a_warning(model, reference, tmp_path):
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="cannot be read"):
        stats = collect_stats(model, _chunks(), progress=False, checkpoint_dir=tmp_path)
    _assert_same(stats, reference)
