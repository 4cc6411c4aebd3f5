"""Split GGUFs: the writer names shards as llama.cpp's gguf-split does, and split_files finds them
all from the first file, or says which shard is missing."""
from __future__ import annotations

import pytest

from pybmoe import models

SHAPE = dict(n_layer=2, n_expert=8, n_expert_used=2, n_embd=128, n_ff_exp=128)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("split") / "m.gguf"
    return models.writer.write_model(models.ModelSpec(arch="qwen3moe", **SHAPE), out, split_max_tensors=10)


def test_the_shards_are_named_and_found_from_the_first(split):
    files = models.split_files(split)
    assert split.name == f"m-00001-of-{len(files):05d}.gguf" and len(files) > 2
    assert [f.name for f in files] == sorted(p.name for p in split.parent.glob("m-*-of-*.gguf"))
    names = [t.name for f in files for t in models.read_metadata(f).tensors]
    one = models.cached_model_path(models.ModelSpec(arch="qwen3moe", **SHAPE))
    assert sorted(names) == sorted(t.name for t in models.read_metadata(one).tensors)
    assert models.split_files(one) == [one]


def test_a_missing_shard_is_named(split, tmp_path):
    import shutil
    files = models.split_files(split)
    for f in files:
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / files[-1].name).unlink()
    with pytest.raises(FileNotFoundError, match=files[-1].name):
        models.split_files(tmp_path / files[0].name)


def test_a_later_shard_is_refused_with_the_way_out(split):
    second = models.split_files(split)[1]
    with pytest.raises(ValueError, match="is shard 2 of a .*pass the first file"):
        models.split_files(second)


def test_a_negative_split_is_refused(tmp_path):
    with pytest.raises(ValueError, match="split_max_tensors"):
        models.writer.write_model(models.ModelSpec(arch="qwen3moe", **SHAPE), tmp_path / "x.gguf", split_max_tensors=-1)
