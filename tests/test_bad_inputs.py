"""The bad-input probe, committed: each case is an input a careful user or a hostile file could give, and the
promise it must keep — a clear ``ValueError`` (or a non-zero exit with the reason) naming what is wrong, nothing
half-written, nothing silently different. Every case here failed before its fix."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kimik3
from kimik3.__main__ import main as cli
from kimik3.model.config import get_preset

REPO = Path(__file__).resolve().parents[1]
K3_PREFIX = "language_model."


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli(argv)
    except SystemExit as e:  # argparse refusals
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad-inputs") / "micro"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), path)
    return path


@pytest.fixture
def ckpt(micro_ckpt, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(micro_ckpt, dst)
    return dst


def embedding(path: Path) -> torch.Tensor:
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
    return tensors[K3_PREFIX + "model.embed_tokens.weight"].float()


def with_timeout(fn, seconds: float = 20.0):
    """Run fn in a thread; a hang (a FIFO read) fails the test instead of blocking the suite."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller)
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for more than {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ====================================================================== export: atomic, nothing mixed


def test_reexport_leaves_no_files_of_the_earlier_export(tmp_path, capsys):
    out = tmp_path / "D"
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out), "--max-shard-mb", "1"], capsys)
    assert code == 0, msg
    assert (out / "model.safetensors.index.json").exists()
    code, msg = run_cli(["export", "--preset", "micro", "--seed", "1", "--out", str(out)], capsys)
    assert code == 0, msg
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "kimik3-export.json", "model.safetensors"]
    seed1 = kimik3.from_preset("micro", seed=1, dtype=torch.bfloat16)
    loaded = kimik3.from_pretrained(out, dtype=torch.bfloat16)
    for (n, a), (_, b) in zip(seed1.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), n
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging folders left behind"


def test_interrupted_export_keeps_the_earlier_one(tmp_path, monkeypatch):
    out = tmp_path / "D"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), out, max_shard_bytes=2**20)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    import kimik3.model.checkpoint as ck

    calls = {"n": 0}
    real = ck.save_file

    def dying_save_file(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the user's Ctrl-C in the middle of the shards
        return real(*args, **kwargs)

    monkeypatch.setattr(ck, "save_file", dying_save_file)
    with pytest.raises(KeyboardInterrupt):
        kimik3.save_pretrained(kimik3.from_preset("micro", seed=1), out, max_shard_bytes=2**20)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert torch.equal(embedding(out), kimik3.from_preset("micro", seed=0).model.embed_tokens.weight)


def test_export_does_not_write_through_a_symlink(tmp_path, capsys):
    out = tmp_path / "D"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), out)
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(outside)
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out)], capsys)
    assert code == 2 and "not empty" in msg and "--overwrite" in msg
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out), "--overwrite"], capsys)
    assert code == 0, msg
    assert outside.read_text() == "precious"
    assert not (out / "config.json").is_symlink()
    kimik3.from_pretrained(out)


def test_export_refuses_a_foreign_folder_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out)], capsys)
    assert code == 2 and "not empty" in msg
    assert (out / "thesis.tex").read_text() == "years of work"
    with pytest.raises(ValueError, match="not empty"):
        kimik3.save_pretrained(kimik3.from_preset("micro"), out)
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out), "--overwrite"], capsys)
    assert code == 0 and not (out / "thesis.tex").exists()


@pytest.mark.parametrize("files", [
    {"config.json": '{"model_type": "llama", "hidden_size": 4096}', "model.safetensors": "weights of a llama"},
    {"config.json": '{"hand": "written"}'},
    {"config.json": "{}", "model.safetensors.index.json": "{}", "model-00001-of-00002.safetensors": "x"},
])
def test_export_recognises_its_own_folders_by_content_not_names(tmp_path, capsys, files):
    """Someone else's checkpoint uses the same file names: without the export's manifest (files and sizes) it is
    not replaced unless --overwrite."""
    out = tmp_path / "theirs"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out)], capsys)
    assert code == 2 and "not empty" in msg and "--overwrite" in msg, msg
    assert {p.name: p.read_text() for p in out.iterdir()} == files
    with pytest.raises(ValueError, match="not empty"):
        kimik3.save_pretrained(kimik3.from_preset("micro"), out)


def test_an_export_changed_by_hand_is_no_longer_replaced_silently(tmp_path, capsys):
    out = tmp_path / "D"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), out)
    assert run_cli(["export", "--preset", "micro", "--seed", "1", "--out", str(out)], capsys)[0] == 0
    (out / "config.json").write_text((out / "config.json").read_text() + " ")  # edited after the export
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out)], capsys)
    assert code == 2 and "not empty" in msg, msg
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text((out / "config.json").read_text()[:-1])
    code, msg = run_cli(["export", "--preset", "micro", "--out", str(out)], capsys)
    assert code == 2 and (out / "notes.txt").read_text() == "mine"


def test_export_files_follow_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        out = kimik3.save_pretrained(kimik3.from_preset("micro"), tmp_path / "D", max_shard_bytes=2**20)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.parametrize("argv,reason", [
    (["--max-shard-mb", "-1"], "positive"),
    (["--max-shard-mb", "0"], "positive"),
    (["--out", "{file}/sub"], "a-file exists and is not a directory"),
    (["--out", "{file}"], "not a directory"),
])
def test_export_arguments_checked_first(tmp_path, capsys, argv, reason):
    f = tmp_path / "a-file"
    f.write_text("x")
    argv = [a.format(file=f) for a in argv]
    base = ["export", "--preset", "micro"] + ([] if "--out" in argv else ["--out", str(tmp_path / "D")])
    code, msg = run_cli(base + argv, capsys)
    assert code == 2 and reason in msg, msg
    assert f.read_text() == "x"


@pytest.mark.parametrize("bad", [-1, 0, 1.5, True])
def test_save_pretrained_max_shard_bytes(tmp_path, bad):
    with pytest.raises(ValueError, match="max_shard_bytes"):
        kimik3.save_pretrained(kimik3.from_preset("micro"), tmp_path / "x", max_shard_bytes=bad)


def test_atomic_write_replaces_a_symlink_not_its_target(tmp_path):
    from kimik3.util.files import atomic_write_text

    target = tmp_path / "target.txt"
    target.write_text("keep")
    link = tmp_path / "out.json"
    link.symlink_to(target)
    atomic_write_text(link, "{}")
    assert target.read_text() == "keep" and link.read_text() == "{}" and not link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "target.txt"]


# ====================================================================== Decoder


def decoder(max_seq_len: int = 8) -> kimik3.Decoder:
    return kimik3.Decoder(kimik3.from_preset("micro"), "naive", batch_size=1, max_seq_len=max_seq_len)


def test_rejected_generate_changes_nothing():
    dec = decoder()
    dec.prefill(torch.tensor([[5, 6, 7, 8, 9]]))
    dec.step(torch.tensor([3]))
    state = [t.clone() for s in dec.stage.state.layers for t in vars(s).values() if isinstance(t, torch.Tensor)] \
        if hasattr(dec.stage, "state") else None
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        dec.generate(torch.tensor([[1, 2, 3, 4, 5]]), 20)
    assert dec.lengths.tolist() == [6]
    if state is not None:
        after = [t for s in dec.stage.state.layers for t in vars(s).values() if isinstance(t, torch.Tensor)]
        assert all(torch.equal(a, b) for a, b in zip(state, after))


@pytest.mark.parametrize("lengths", [[4.5], torch.tensor([4.0]), [True]])
def test_float_lengths_refused(lengths):
    dec = decoder()
    with pytest.raises(ValueError, match="lengths must be integers"):
        dec.prefill(torch.tensor([[5, 6, 7, 8, 9]]), lengths=lengths)


def test_huge_cache_says_how_much_memory():
    with pytest.raises(ValueError, match=r"decode state.*max_seq_len=1073741824 needs [\d.]+ GiB"):
        kimik3.Decoder(kimik3.from_preset("micro"), "naive", batch_size=4096, max_seq_len=2**30)


@pytest.mark.parametrize("kw", [dict(batch_size=True), dict(max_seq_len=True), dict(batch_size=2.0)])
def test_decoder_bool_or_float_sizes(kw):
    with pytest.raises(ValueError, match="must be a positive int"):
        kimik3.Decoder(kimik3.from_preset("micro"), "naive", **kw)


# ====================================================================== dtype arguments


@pytest.mark.parametrize("name,want", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                       ("float32", torch.float32), ("fp32", torch.float32),
                                       ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_dtype_strings(name, want):
    m = kimik3.from_preset("micro", dtype=name)
    assert m.dtype == want and m.model.layers[0].self_attn.A_log.dtype == torch.float32


@pytest.mark.parametrize("bad", [torch.int8, torch.bool, torch.complex64, "int8", "bfloat", 16])
def test_non_float_dtypes_refused(bad, micro_ckpt):
    with pytest.raises(ValueError, match="dtype"):
        kimik3.from_preset("micro", dtype=bad)
    with pytest.raises(ValueError, match="dtype"):
        kimik3.from_pretrained(micro_ckpt, dtype=bad)


def test_from_pretrained_dtype_string(micro_ckpt):
    assert kimik3.from_pretrained(micro_ckpt, dtype="bf16").dtype == torch.bfloat16


# ====================================================================== config values


def edit_config(path: Path, **fields) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"].update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", 0), ("rms_norm_eps", -1e-5), ("rms_norm_eps", math.nan), ("rms_norm_eps", "1e-5"),
    ("attn_res_block_size", 2.5), ("attn_res_block_size", 0), ("routed_scaling_factor", -1.0),
    ("activation_situ_linear_beta", 0), ("activation_situ_beta", -4.0), ("kv_lora_rank", -4),
    ("q_lora_rank", -1), ("hidden_size", "64"), ("hidden_size", 64.5), ("num_hidden_layers", None),
    ("tie_word_embeddings", "yes"), ("mla_use_nope", 1), ("vocab_size", True), ("num_experts", 16.5),
    ("rope_theta", math.inf), ("linear_attn_config", [1, 2]),
])
def test_config_field_refused_naming_field_and_file(ckpt, field, value):
    edit_config(ckpt, **{field: value})
    with pytest.raises(ValueError) as e:
        kimik3.from_pretrained(ckpt)
    assert field in str(e.value) and "config.json" in str(e.value), str(e.value)


@pytest.mark.parametrize("gate", [0.0, 1.0, "x"])
def test_kda_gate_lower_bound(ckpt, gate):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["linear_attn_config"]["gate_lower_bound"] = gate
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gate_lower_bound"):
        kimik3.from_pretrained(ckpt)


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 0.0), ("rms_norm_eps", float("nan")),
                                         ("attn_res_block_size", 2.5), ("routed_scaling_factor", -0.5),
                                         ("situ_linear_beta", 0.0), ("kv_lora_rank", -1), ("hidden_size", 64.0),
                                         ("tie_word_embeddings", "no"), ("pad_token_id", -1)])
def test_model_config_ranges(field, value):
    with pytest.raises(ValueError, match=field):
        get_preset("micro").replace(**{field: value})


def test_integral_float_accepted(ckpt):
    edit_config(ckpt, hidden_size=64.0)  # some JSON writers emit integers as floats; the value is exact
    assert kimik3.from_pretrained(ckpt).config.hidden_size == 64


def test_tie_word_embeddings_honoured(tmp_path):
    cfg = get_preset("micro").replace(tie_word_embeddings=True)
    m = kimik3.from_preset(cfg, seed=0)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    kimik3.save_pretrained(m, tmp_path / "tied")
    saved = load_file(tmp_path / "tied" / "model.safetensors")
    assert K3_PREFIX + "lm_head.weight" not in saved
    back = kimik3.from_pretrained(tmp_path / "tied")
    assert back.lm_head.weight is back.model.embed_tokens.weight
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(back(ids), m(ids), rtol=0, atol=0)
    # a checkpoint that also stores lm_head (transformers may) loads, and lm_head stays the embedding
    saved[K3_PREFIX + "lm_head.weight"] = torch.zeros_like(saved[K3_PREFIX + "model.embed_tokens.weight"])
    save_file(saved, tmp_path / "tied" / "model.safetensors")
    again = kimik3.from_pretrained(tmp_path / "tied")
    assert again.lm_head.weight is again.model.embed_tokens.weight and again.lm_head.weight.abs().sum() > 0


# ====================================================================== hostile checkpoint files


def write_raw_safetensors(path: Path, header: object, data: bytes = b"") -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("header,data,match", [
    ([1, 2, 3], b"", "expected a JSON object"),
    ({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "no 'data_offsets'"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}, b"\0" * 8, "truncated safetensors file"),
    ({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unsupported dtype"),
    ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
    ({"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, b"\0" * 8, "shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps"),
    ({"w": "x"}, b"", "must be an object"),
    ({"__metadata__": [1]}, b"", "__metadata__"),
])
def test_malformed_safetensors_header(ckpt, header, data, match):
    write_raw_safetensors(ckpt / "model.safetensors", header, data)
    with pytest.raises(ValueError, match=match) as e:
        kimik3.from_pretrained(ckpt)
    assert "model.safetensors" in str(e.value)


def test_duplicate_key_in_one_header(ckpt):
    h = b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, ' \
        b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 4)
    with pytest.raises(ValueError, match="'w' appears twice"):
        kimik3.from_pretrained(ckpt)


def sharded(ckpt: Path) -> Path:
    """Split the micro checkpoint into two shards with an index."""
    tensors = load_file(ckpt / "model.safetensors")
    keys = sorted(tensors)
    a, b = keys[: len(keys) // 2], keys[len(keys) // 2:]
    save_file({k: tensors[k] for k in a}, ckpt / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in b}, ckpt / "model-00002-of-00002.safetensors")
    (ckpt / "model.safetensors").unlink()
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return ckpt


@pytest.mark.parametrize("index,match", [
    ({"weight_map": ["model-00001-of-00002.safetensors"]}, "'weight_map' must be an object"),
    ([], "expected a JSON object"),
    ({"metadata": {}}, "no 'weight_map'"),
    ({"weight_map": {"x": "../outside.safetensors"}}, "outside the checkpoint folder"),
    ({"weight_map": {"x": "/etc/passwd"}}, "outside the checkpoint folder"),
    ({"weight_map": {"x": 7}}, "not a plain relative file name"),
    ({"weight_map": {}}, "empty"),
])
def test_malformed_index(ckpt, index, match):
    sharded(ckpt)
    (ckpt.parent / "outside.safetensors").write_bytes((ckpt / "model-00001-of-00002.safetensors").read_bytes())
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=match) as e:
        kimik3.from_pretrained(ckpt)
    assert "model.safetensors.index.json" in str(e.value)


def test_key_in_two_shards_refused(ckpt):
    sharded(ckpt)
    f1, f2 = ckpt / "model-00001-of-00002.safetensors", ckpt / "model-00002-of-00002.safetensors"
    t2 = load_file(f2)
    key = sorted(load_file(f1))[0]
    t2[key] = load_file(f1)[key] + 1
    save_file(t2, f2)
    with pytest.raises(ValueError, match=rf"{key}.*appears in both"):
        kimik3.from_pretrained(ckpt)


@pytest.mark.parametrize("which", ["model.safetensors", "config.json"])
def test_fifo_is_refused_not_waited_on(ckpt, which):
    (ckpt / which).unlink()
    os.mkfifo(ckpt / which)
    with pytest.raises(ValueError, match="not a regular file"):
        with_timeout(lambda: kimik3.from_pretrained(ckpt))


@pytest.mark.parametrize("shape", [(8, 4), (2, 4), (4, 4, 1)])
def test_a_log_of_the_wrong_shape(ckpt, shape):
    t = load_file(ckpt / "model.safetensors")
    key = K3_PREFIX + "model.layers.0.self_attn.A_log"
    t[key] = torch.ones(shape)
    save_file(t, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="A_log"):
        kimik3.from_pretrained(ckpt)


def test_a_log_padded_with_zeros_loads(ckpt):
    t = load_file(ckpt / "model.safetensors")
    key = K3_PREFIX + "model.layers.0.self_attn.A_log"
    t[key] = torch.cat([t[key], torch.zeros(4)])  # the K3 release layout: 128 stored, first nh used
    save_file(t, ckpt / "model.safetensors")
    kimik3.from_pretrained(ckpt)
    t[key][-1] = 1.0  # a non-zero tail is not padding
    save_file(t, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match="A_log"):
        kimik3.from_pretrained(ckpt)


# ====================================================================== CLIs: checked first, never "ok" on nothing


@pytest.mark.parametrize("args,reason", [
    (["--batch", "0"], "--batch: must be positive integers"),
    (["--batch", "x"], "comma-separated list of integers"),
    (["--context", "0"], "--context: must be a positive integer"),
    (["--steps", "0"], "--steps: must be in 1..100000"),
    (["--repeats", "0"], "--repeats: must be in 1..1000"),
    (["--stages", "warp-drive"], "unknown stage"),
    (["--stages", ","], "no stages"),
    (["--out", "{file}/x.json"], "cannot write"),
    (["--checkpoint", "{missing}"], "not a directory"),
])
def test_bench_arguments(tmp_path, capsys, args, reason):
    f = tmp_path / "a-file"
    f.write_text("x")
    args = [a.format(file=f, missing=tmp_path / "nope") for a in args]
    code, msg = run_cli(["bench", "--preset", "micro", "--out", str(tmp_path / "b.json"), *args], capsys)
    assert code == 2 and reason in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a GPU-only stage is a CPU-machine case")
def test_bench_nothing_measured_exits_nonzero(tmp_path, capsys):
    out = tmp_path / "b.json"
    code, msg = run_cli(["bench", "--preset", "micro", "--stages", "fused", "--device", "cpu", "--batch", "1",
                         "--context", "4", "--steps", "1", "--repeats", "1", "--out", str(out)], capsys)
    assert code == 1 and "nothing was measured" in msg and "fused" in msg, msg
    assert json.loads(out.read_text())["not_run"], "the reason is kept in the JSON"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_validate_cuda_without_a_gpu(tmp_path, capsys):
    code, msg = run_cli(["validate", "--quick", "--device", "cuda", "--out", str(tmp_path / "v")], capsys)
    assert code == 2 and "no CUDA device" in msg


@pytest.mark.parametrize("args,reason", [
    (["--stages", ","], "--stages: must name at least one"),
    (["--stages", "nope"], "unknown stage"),
    (["--presets", "nope"], "unknown preset"),
    (["--steps", "-1"], "--steps: must be in 0..100000"),
    (["--steps", "1000000000"], "--steps: must be in 0..100000"),
    (["--threads", "0"], "--threads: must be in 1..1024"),
    (["--device", "tpu"], "--device must be"),
    (["--out", "{file}/v"], "cannot write"),
])
def test_validate_arguments(tmp_path, capsys, args, reason):
    f = tmp_path / "a-file"
    f.write_text("x")
    args = [a.format(file=f) for a in args]
    code, msg = run_cli(["validate", "--quick", "--out", str(tmp_path / "v"), *args], capsys)
    assert code == 2 and reason in msg, msg


def test_validate_nothing_validated_is_not_a_pass(tmp_path, capsys):
    code, msg = run_cli(["validate", "--quick", "--presets", "kimi-k3", "--no-hazards", "--no-ep",
                         "--no-determinism", "--drift-tokens", "0", "--no-progress", "--device", "cpu",
                         "--out", str(tmp_path / "v")], capsys)
    assert code == 1 and "nothing was validated" in msg, msg
    assert json.loads((tmp_path / "v" / "summary.json").read_text())["validated"] is False


def test_run_notebooks_unknown_only(tmp_path, capsys):
    code, msg = run_cli(["run-notebooks", "--only", "99", "--out", str(tmp_path)], capsys)
    assert code == 2 and "matches no notebook" in msg
    assert not list(tmp_path.iterdir())


class FakePapermill:
    """Stands in for papermill: records the parameters and writes the output notebook (or dies halfway)."""

    def __init__(self, die: BaseException | None = None) -> None:
        self.die, self.calls = die, []

    def execute_notebook(self, src, dst, parameters, **kw):
        self.calls.append(dict(parameters, cwd=kw.get("cwd")))
        Path(dst).write_text('{"cells": "partial"}')
        if self.die is not None:
            raise self.die
        Path(dst).write_text('{"cells": "complete"}')


def test_run_notebooks_relative_out_is_the_folder_asked_for(tmp_path, monkeypatch):
    from kimik3.notebook import runner as notebooks

    fake = FakePapermill()
    monkeypatch.setitem(sys.modules, "papermill", fake)
    monkeypatch.chdir(tmp_path)
    nb = notebooks.list_notebooks()[0]
    out_nb = notebooks.run_notebook(nb, Path("myruns"))
    want = (tmp_path / "myruns" / nb.stem).resolve()
    assert out_nb.parent.resolve() == want
    assert Path(fake.calls[0]["out_dir"]).is_absolute() and Path(fake.calls[0]["out_dir"]).resolve() == want
    assert not (REPO / "myruns").exists()


def test_interrupted_notebook_is_marked_failed(tmp_path, monkeypatch):
    from kimik3.notebook import runner as notebooks

    nb = notebooks.list_notebooks()[0]
    monkeypatch.setitem(sys.modules, "papermill", FakePapermill())
    notebooks.run_notebook(nb, tmp_path)  # a complete earlier run
    monkeypatch.setitem(sys.modules, "papermill", FakePapermill(die=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        notebooks.run_notebook(nb, tmp_path)
    folder = tmp_path / nb.stem
    assert not (folder / nb.name).exists(), "an interrupted run must not leave a notebook that looks finished"
    assert (folder / f"{nb.stem}.FAILED.ipynb").read_text() == '{"cells": "partial"}'


@pytest.mark.parametrize("params,match", [
    ({"batch_size": -3}, "batch_size must be a positive integer"),
    ({"batch_size": "abc"}, "batch_size must be a positive integer"),
    ({"new_tokens": -2}, "new_tokens must be a positive integer"),
    ({"new_tokens": 2.5}, "new_tokens"),
    ({"preset": "huge"}, "not a preset"),
    ({"presets": []}, "presets"),
    ({"batch_sizes": [1, 0]}, "batch_sizes"),
    ({"context_lens": [-1]}, "context_lens"),
    ({"device": "gpu"}, "device"),
    ({"stages": ["naive", "warp"]}, "unknown stage"),
    ({"stages": "naive"}, "stages"),
])
def test_notebook_parameters(params, match):
    from kimik3.notebook.runner import check_params

    with pytest.raises(ValueError, match=match):
        check_params(params, "01_naive_decode")


def test_notebook_defaults_pass_their_own_check():
    from kimik3.notebook.runner import CI, check_params

    for name, params in CI.items():
        check_params(params, name)


def test_kernels_build_without_the_dsl_gives_a_hint(tmp_path):
    code = ("import sys; sys.modules['cutlass'] = None\n"
            "from kimik3.__main__ import main\n"
            f"sys.exit(main(['kernels', 'build', '--arch', 'sm_90a', '--out', {str(tmp_path / 'k')!r}]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "CuTe DSL compiler is not installed" in p.stderr and "pip install" in p.stderr


def test_a_full_size_model_off_the_meta_device_is_refused_with_the_gib_it_needs() -> None:
    with pytest.raises(ValueError, match=r"the model 'kimi-k3' needs [0-9.]+ GiB, more than .* on cpu; build it on "
                                         r"the meta device"):
        kimik3.build_model("kimi-k3")
    assert kimik3.build_model("kimi-k3", "meta").lm_head.weight.is_meta


@pytest.mark.parametrize("seed", [2**70, -1, "x", 1.5, True])
def test_a_seed_torch_cannot_take_is_refused_naming_it(seed) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in 0\.\.9223372036854775807, got"):
        kimik3.from_preset("micro", seed=seed)


@pytest.mark.parametrize("call, says", [
    (lambda: kimik3.from_preset("micro", device="tpu9"), "device 'tpu9' is not a device torch knows"),
    (lambda: kimik3.build_model("micro", "tpu9"), "device 'tpu9' is not a device torch knows"),
    (lambda: kimik3.build_model(123), "preset must be a preset name or a ModelConfig, got 123"),
    (lambda: kimik3.get_preset(["micro"]), "preset must be a preset name or a ModelConfig"),
    (lambda: kimik3.Decoder(kimik3.from_preset("micro"), stage=["naive"]), "stage must be a stage name"),
    (lambda: kimik3.save_pretrained(kimik3.from_preset("micro"), "unused", expert_format="nf4"),
     "expert_format must be one of"),
])
def test_wrong_kinds_of_argument_are_refused_naming_the_argument(call, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_a_cuda_device_without_one_is_refused() -> None:
    with pytest.raises(ValueError, match="no CUDA device is available"):
        kimik3.from_preset("micro", device="cuda")


def test_save_pretrained_of_something_else_is_a_type_error(tmp_path) -> None:
    with pytest.raises(TypeError, match="writes a kimik3 model .*got str"):
        kimik3.save_pretrained("notamodel", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_ids_and_lengths_without_values_are_refused() -> None:
    dec = kimik3.Decoder(kimik3.from_preset("micro"), batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match="input_ids is a meta tensor"):
        dec.prefill(torch.tensor([[1, 2, 3]], device="meta"))
    with pytest.raises(ValueError, match=r"lengths must be integers, one per sequence, got \['3'\]"):
        dec.prefill(torch.tensor([[1, 2, 3]]), lengths=["3"])
    assert dec.prefill(torch.tensor([[1, 2, 3]])).isfinite().all()


def test_a_token_id_outside_the_vocabulary_is_refused_in_a_config(ckpt) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["pad_token_id"] = 10**6
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"pad_token_id.*a token id in the vocabulary \[0, "):
        kimik3.from_pretrained(ckpt)


def test_an_export_that_would_not_fit_in_memory_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    model = kimik3.from_preset("micro")
    monkeypatch.setattr("kimik3.model.checks.device_memory", lambda device: (1000, "available memory"))
    with pytest.raises(ValueError, match=r"writing a 1-shard export .* needs .* GiB.*max_shard_bytes"):
        kimik3.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_max_seq_len_past_what_positions_index_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_seq_len must be a positive int of at most 2147483647, got 10+"):
        kimik3.Decoder(kimik3.from_preset("micro"), batch_size=1, max_seq_len=10**18)
