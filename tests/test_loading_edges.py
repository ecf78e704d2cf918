"""Checkpoint loading at the edges a second hostile probe found: a finite weight that overflows the requested dtype,
an index that contradicts its shards, a top-level ``tie_word_embeddings`` that contradicts ``text_config``, a
missing file: each refused with a ``ValueError`` naming it; an index naming thousands of missing shards gets a
short message; symlinked files (a Hugging Face cache snapshot) load."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3


def _export(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d)
    return d


def test_a_weight_that_overflows_the_requested_dtype_is_refused(tmp_path: Path) -> None:
    d = _export(tmp_path)
    f = d / "model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if k.endswith("o_proj.weight"))
    tensors[key] = tensors[key].float()
    tensors[key][0, 0] = 1e6  # finite in fp32, inf in fp16 (max 65504)
    save_file(tensors, f, metadata={"format": "pt"})
    model = kimik3.from_pretrained(d, dtype=torch.float32)
    assert model.state_dict()[key.removeprefix("language_model.")][0, 0].item() == 1e6
    with pytest.raises(ValueError, match=rf"{key}.*1e\+06, beyond what torch.float16 represents"):
        kimik3.from_pretrained(d, dtype=torch.float16)


def _sharded(tmp_path: Path) -> Path:
    d = tmp_path / "sharded"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d, max_shard_bytes=200_000)
    return d


def _edit_index(d: Path, edit) -> dict:
    f = d / "model.safetensors.index.json"
    index = json.loads(f.read_text())
    edit(index["weight_map"])
    f.write_text(json.dumps(index))
    return index["weight_map"]


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused(tmp_path: Path) -> None:
    d = _sharded(tmp_path)
    shards = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) >= 2
    moved = {}

    def swap(wm: dict) -> None:
        key = next(k for k, v in wm.items() if v == shards[0])
        wm[key] = shards[1]
        moved["key"] = key

    _edit_index(d, swap)
    with pytest.raises(ValueError, match=rf"{moved['key']}.*is in {shards[0]}, but the checkpoint index puts it "
                                         rf"in {shards[1]}"):
        kimik3.from_pretrained(d)


def test_an_index_that_omits_or_invents_a_tensor_is_refused(tmp_path: Path) -> None:
    d = _sharded(tmp_path)
    wm = _edit_index(d, lambda wm: wm.update({"model.layers.0.ghost.weight": next(iter(wm.values()))}))
    with pytest.raises(ValueError, match=r"lists 1 tensor\(s\) its shards do not hold: 'model.layers.0.ghost"):
        kimik3.from_pretrained(d)
    dropped = next(k for k in wm if k != "model.layers.0.ghost.weight")
    _edit_index(d, lambda wm: (wm.pop("model.layers.0.ghost.weight"), wm.pop(dropped)))
    with pytest.raises(ValueError, match=rf"{dropped}.*the checkpoint index puts it nowhere"):
        kimik3.from_pretrained(d)


def test_thousands_of_missing_shards_give_a_short_message(tmp_path: Path) -> None:
    d = _sharded(tmp_path)
    _edit_index(d, lambda wm: wm.update({f"t{i}": f"gone-{i:05d}.safetensors" for i in range(20_000)}))
    with pytest.raises(ValueError, match=r"lists 20000 shard\(s\) that do not exist: 'gone-00000.*and 19995 more") \
            as err:
        kimik3.from_pretrained(d)
    assert len(str(err.value)) < 500


@pytest.mark.parametrize("top, inner", [(True, False), (False, True)])
def test_top_level_tie_word_embeddings_must_agree_with_text_config(tmp_path: Path, top: bool, inner: bool) -> None:
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3"
    cfg["tie_word_embeddings"], cfg["text_config"]["tie_word_embeddings"] = top, inner
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json.*tie_word_embeddings=.* at the top level but .* in "
                                         r"text_config: the two must agree"):
        kimik3.from_pretrained(d)


def test_top_level_tie_word_embeddings_alone_is_honoured(tmp_path: Path) -> None:
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    del cfg["text_config"]["tie_word_embeddings"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert kimik3.model.config.load_config(d).tie_word_embeddings is True


def test_a_missing_config_is_a_value_error_naming_it(tmp_path: Path) -> None:
    d = _export(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config .*config.json does not exist"):
        kimik3.from_pretrained(d)
    with pytest.raises(ValueError, match=r"config .*config.json does not exist"):
        kimik3.model.config.load_config(d)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_an_unreadable_file_is_a_value_error_naming_it(tmp_path: Path, monkeypatch, name: str) -> None:
    d = _export(tmp_path)
    victim = d / name
    if os.geteuid() != 0:
        victim.chmod(0)
    else:  # root reads whatever the mode: the operating system's answer to anyone else, given here by hand
        real_open = open

        def refusing_open(file, *args, **kwargs):
            if Path(file) == victim:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr("builtins.open", refusing_open)
    with pytest.raises(ValueError, match=rf"{name} cannot be read: Permission denied"):
        kimik3.from_pretrained(d)


def test_symlinked_files_load_as_in_a_hugging_face_cache_snapshot(tmp_path: Path) -> None:
    """The cache keeps each file once under blobs/ and links it from snapshots/<rev>/: links are followed, while
    the names an index gives stay inside the folder."""
    src = _sharded(tmp_path)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in src.iterdir():
        f.rename(blobs / f.name)
        (snap / f.name).symlink_to(os.path.relpath(blobs / f.name, snap))  # relative, as the cache writes them
    want = kimik3.from_pretrained(blobs).state_dict()
    got = kimik3.from_pretrained(snap).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_terminal_escapes_from_a_file_are_escaped_in_messages(tmp_path: Path) -> None:
    d = _export(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "\x1b[2J\x1b]0;owned\x07llama\u202e"
    (d / "config.json").write_text(json.dumps(cfg))
    for load in (kimik3.from_pretrained, kimik3.model.config.load_config):
        with pytest.raises(ValueError, match="unknown model_type") as err:
            load(d)
        msg = str(err.value)
        assert "\x1b" not in msg and "\x07" not in msg and "\u202e" not in msg
        assert "\\x1b[2J" in msg and "\\u202e" in msg
    evil = tmp_path / "ckpt\x1b[31m"
    d.rename(evil)
    (evil / "config.json").unlink()
    with pytest.raises(ValueError, match=r"ckpt\\x1b\[31m/config.json does not exist") as err:
        kimik3.from_pretrained(evil)
    assert "\x1b" not in str(err.value)


def test_a_subset_of_more_ids_than_there_are_is_refused_without_reading_them_all(tmp_path: Path) -> None:
    import itertools

    d = _export(tmp_path)
    for experts in (range(10**12), itertools.count(), {layer: range(10**12) for layer in range(1, 8)}):
        with pytest.raises(ValueError, match=r"holds more than the 16 ids there are \(0\.\.15\)"):
            kimik3.from_pretrained(d, experts=experts)
    with pytest.raises(ValueError, match=r"layers holds more than the \d+ ids there are"):
        kimik3.from_pretrained(d, layers=itertools.count())
