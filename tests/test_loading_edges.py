"""Checkpoint loading at the edges a second hostile probe found: a finite weight that overflows the requested dtype
is refused naming the tensor (it used to become ``inf`` silently)."""

from __future__ import annotations

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
