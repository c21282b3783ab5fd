"""``from_hf_config`` takes a path to a model's ``config.json`` (str or os.PathLike; the file or the folder that holds
it), as ``ropekit plot --config`` does, and gives exactly what the parsed dict gives."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest
import torch

from helpers import MODEL_CONFIGS
from ropekit.frequencies import from_hf_config

NAMES = ["phi-3.5-mini-instruct", "qwen2.5-7b-instruct-yarn", "gpt-neox-20b"]


class _PathLike:
    """An os.PathLike that is not a pathlib.Path."""

    def __init__(self, path):
        self._path = str(path)

    def __fspath__(self):
        return self._path


def _same(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize("name", NAMES)
def test_a_path_reads_like_the_parsed_dict(tmp_path, name):
    cfg = MODEL_CONFIGS[name]
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "other-name.json").write_text(json.dumps(cfg))
    want = from_hf_config(cfg)
    for path in (folder / "config.json", folder, tmp_path / "other-name.json"):
        for spelled in (path, str(path), _PathLike(path)):
            _same(from_hf_config(spelled), want)
    _same(from_hf_config(folder, style="interleaved"), from_hf_config(cfg, style="interleaved"))


def test_a_relative_path_and_the_current_folder(tmp_path, monkeypatch):
    cfg = MODEL_CONFIGS["phi-3.5-mini-instruct"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)
    want = from_hf_config(cfg)
    _same(from_hf_config("config.json"), want)
    _same(from_hf_config("."), want)
    _same(from_hf_config(pathlib.Path(os.curdir)), want)


def test_bad_paths_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        from_hf_config(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf_config(str(tmp_path))  # a folder without config.json
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*JSON"):
        from_hf_config(tmp_path / "broken.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*JSON object"):
        from_hf_config(str(tmp_path / "list.json"))
    with pytest.raises(TypeError, match="config"):
        from_hf_config(3)
    with pytest.raises(TypeError, match="config"):
        from_hf_config(b"config.json")
