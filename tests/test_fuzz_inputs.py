"""Property-based fuzzing of what a checkpoint folder can hold: safetensors headers and bytes, index files,
config.json, quantization patterns, an index that contradicts its shards, links and permission modes. The property:
every input either loads correctly or raises ``ValueError`` — never another exception, never a hang (each example
runs under an alarm). CI runs a fixed-seed budget (``derandomize``); the ``slow``
marker runs the same properties with many more examples."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import stat
import struct
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

import kimik3
from kimik3.model.checkpoint import _iter_tensors, _shard_files
from kimik3.model.config import load_config
from kimik3.model.random_init import build_model
from kimik3.model.safetensors_reader import DTYPE_BYTES

EXAMPLE_SECONDS = 10  # far above any single load here; only a hang reaches it


def budget(n: int) -> settings:
    return settings(max_examples=n, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def long_run(n: int) -> settings:
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@contextlib.contextmanager
def bounded(seconds: int = EXAMPLE_SECONDS):
    def alarm(signum, frame):
        raise TimeoutError(f"no result after {seconds} s: a hang")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def only_value_error(fn):
    """Run fn; ValueError is a correct refusal; anything else (or a hang) fails the property."""
    with bounded():
        try:
            return fn()
        except ValueError:
            return None


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="kimik3-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ====================================================================== safetensors files

VALID = save({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16),
              "c": torch.zeros(0, dtype=torch.uint8)}, metadata={"format": "pt"})

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                      st.text(max_size=6))
json_any = st.recursive(json_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=6), kids, max_size=4)),
                        max_leaves=12)
small_int = st.one_of(st.integers(-3, 40), st.integers(-2**64, 2**64))
entry = st.one_of(
    st.fixed_dictionaries({"dtype": st.sampled_from(sorted(DTYPE_BYTES) + ["F4", "x", ""]),
                           "shape": st.one_of(st.lists(small_int, max_size=3), json_any),
                           "data_offsets": st.one_of(st.lists(small_int, min_size=0, max_size=3), json_any)}),
    json_any)
header_strategy = st.one_of(st.dictionaries(st.text(max_size=4), entry, max_size=4), json_any)


def check_shard_file(f: Path) -> None:
    header = None
    with contextlib.suppress(Exception):
        n = struct.unpack("<Q", f.read_bytes()[:8])[0]
        header = json.loads(f.read_bytes()[8:8 + n])
    got = only_value_error(lambda: list(_iter_tensors([f])))
    if got is not None:  # accepted: then it must be what the header says
        assert isinstance(header, dict)
        for _, key, t in got:
            assert list(t.shape) == header[key]["shape"], key


@budget(250)
@given(header=header_strategy, data=st.binary(max_size=48), lie=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_safetensors_header(workdir, header, data, lie):
    h = json.dumps(header).encode()
    f = workdir / "h.safetensors"
    f.write_bytes(struct.pack("<Q", len(h) if lie is None else lie) + h + data)
    check_shard_file(f)


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(0, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID)), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
)


@budget(250)
@given(muts=st.lists(mutation, min_size=1, max_size=6))
def test_fuzz_safetensors_bytes(workdir, muts):
    b = bytearray(VALID)
    for kind, pos, val in muts:
        pos = min(pos, len(b))
        if kind == "flip" and pos < len(b):
            b[pos] = val
        elif kind == "cut":
            del b[pos:]
        elif kind == "insert":
            b[pos:pos] = bytes([val])
    f = workdir / "b.safetensors"
    f.write_bytes(bytes(b))
    check_shard_file(f)


# ====================================================================== index files

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "dup.safetensors")
names = st.one_of(st.sampled_from(SHARDS + ("../outside.safetensors", "/etc/passwd", "", ".", "..", "sub/x",
                                            "~/x", "a\x00b", "model.safetensors", "missing.safetensors")),
                  json_leaf)
index_strategy = st.one_of(
    st.fixed_dictionaries({"weight_map": st.dictionaries(st.sampled_from(["a", "b", "c", "zz"]) | st.text(max_size=3),
                                                         names, max_size=4)},
                          optional={"metadata": json_any}),
    st.fixed_dictionaries({"weight_map": json_any}),
    json_any)


@pytest.fixture(scope="module")
def index_dir(workdir):
    d = workdir / "idx" / "ckpt"
    d.mkdir(parents=True)
    (d / SHARDS[0]).write_bytes(save({"a": torch.ones(2), "b": torch.zeros(3)}))
    (d / SHARDS[1]).write_bytes(save({"c": torch.ones(1)}))
    (d / SHARDS[2]).write_bytes(save({"a": torch.ones(2)}))  # named with the first: "a" in two shards
    (d.parent / "outside.safetensors").write_bytes(save({"zz": torch.ones(1)}))
    return d


@budget(200)
@given(index=index_strategy, raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_index(index_dir, index, raw):
    (index_dir / "model.safetensors.index.json").write_bytes(json.dumps(index).encode() if raw is None else raw)
    found = only_value_error(lambda: _shard_files(index_dir))
    if found is not None:
        files, where = found
        for f in files:  # reads never leave the checkpoint folder
            assert f.resolve().parent == index_dir.resolve()
        got = only_value_error(lambda: list(_iter_tensors(files, index=where)))
        if got is not None:  # loaded: the index and the shards agree, key by key
            keys = [k for _, k, _ in got]
            assert len(keys) == len(set(keys)), "a key loaded twice"
            assert {k: f for f, k, _ in got} == where


# ====================================================================== config.json

@pytest.fixture(scope="module")
def micro_hf() -> dict:
    from kimik3.model.config import get_preset, to_hf_dict

    return to_hf_dict(get_preset("micro"))


config_value = st.one_of(st.integers(-4, 300), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.sampled_from([0, 1, 2, 0.5, 2.5, 1e-5, -1e-5, math.nan, math.inf]), st.booleans(),
                         st.none(), st.text(max_size=4), st.lists(st.integers(-2, 12), max_size=9),
                         st.dictionaries(st.text(max_size=3), st.integers(-2, 5), max_size=2))


@budget(300)
@given(data=st.data())
def test_fuzz_config(workdir, micro_hf, data):
    cfg = json.loads(json.dumps(micro_hf))
    text = cfg["text_config"]
    lac = text["linear_attn_config"]
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.sampled_from(["text", "text", "text", "lac", "top"]))
        d = {"text": text, "lac": lac, "top": cfg}[where]
        key = data.draw(st.sampled_from(sorted(d) or ["x"]) | st.text(max_size=4))
        if data.draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = data.draw(config_value)
    d = workdir / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))  # (the mutation may replace text_config itself)
    loaded = only_value_error(lambda: load_config(d))
    if loaded is not None:  # a config that validates must describe a model that can be built
        with bounded():
            try:
                model = build_model(loaded, "meta")
            except ValueError:
                return
        assert model.config == loaded


# ====================================================================== end to end: from_pretrained


@pytest.fixture(scope="module")
def e2e_ckpt(workdir) -> Path:
    d = workdir / "e2e"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d)
    return d


@budget(12)
@given(data=st.data())
def test_fuzz_from_pretrained(e2e_ckpt, workdir, data):
    """Corrupt one file of a real checkpoint; from_pretrained loads the original weights or refuses."""
    d = workdir / "e2e-case"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(e2e_ckpt, d)
    which = data.draw(st.sampled_from(["config.json", "model.safetensors"]))
    b = bytearray((d / which).read_bytes())
    n_header = struct.unpack("<Q", b[:8])[0] if which == "model.safetensors" else len(b)
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, min(len(b), n_header + 8) - 1))  # the header, where the structure is
        b[pos] = data.draw(st.integers(0, 255))
    (d / which).write_bytes(bytes(b))
    model = only_value_error(lambda: kimik3.from_pretrained(d))
    if model is not None:
        ref = kimik3.from_preset("micro", seed=0)
        for (n, a), (_, w) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a, w) or which == "config.json", n


# ====================================================================== index / shard contradictions, links, modes

@pytest.fixture(scope="module")
def sharded_ckpt(workdir) -> Path:
    d = workdir / "sharded"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d, max_shard_bytes=300_000)
    return d


INDEX = "model.safetensors.index.json"
folder_edit = st.tuples(st.sampled_from(["move", "ghost", "drop", "missing", "chmod", "link", "dangling"]),
                        st.integers(0, 10**6), st.integers(0, 0o777))


@contextlib.contextmanager
def unreadable_as_its_owner_sees_it():
    """Root reads a file whatever its mode: there, opening a file whose owner-read bit is clear fails the way it
    would for anyone else."""
    if os.geteuid() != 0:
        yield
        return
    real_open = open

    def owner_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and os.path.isfile(file) and not os.stat(file).st_mode & stat.S_IRUSR:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    with mock.patch("builtins.open", owner_open):
        yield


@budget(25)
@given(edits=st.lists(folder_edit, min_size=1, max_size=3))
def test_fuzz_checkpoint_folder(sharded_ckpt, workdir, edits):
    """An index that contradicts its shards, files made unreadable or replaced by links: the load refuses with a
    ValueError exactly when something is wrong, and otherwise gives the original weights."""
    d = workdir / "folder-case"
    outside = workdir / "folder-outside"
    for x in (d, outside):
        shutil.rmtree(x, ignore_errors=True)
    shutil.copytree(sharded_ckpt, d)
    outside.mkdir()
    index = json.loads((d / INDEX).read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    files = ["config.json", INDEX, *shards]
    broken = False
    for op, i, mode in edits:
        keys = sorted(wm)
        if op in ("move", "drop") and keys:
            key = keys[i % len(keys)]
            if op == "move":
                wm[key] = shards[(shards.index(wm[key]) + 1) % len(shards)] if wm[key] in shards else shards[0]
            else:
                del wm[key]
            broken = True
        elif op == "ghost":
            wm[f"model.layers.0.ghost{i}.weight"] = shards[i % len(shards)]
            broken = True
        elif op == "missing" and keys:
            wm[keys[i % len(keys)]] = f"model-gone-{i}.safetensors"
            broken = True
        elif op == "chmod":
            f = d / files[i % len(files)]
            if f.exists():
                f.chmod(mode)
                broken |= not mode & stat.S_IRUSR
        elif op in ("link", "dangling"):
            f = d / files[i % len(files)]
            if f.exists() and not f.is_symlink():
                target = outside / f"{f.name}.{i}"
                if op == "link":
                    shutil.copy2(f, target)  # (with f's mode: an unreadable file stays unreadable)
                f.unlink()
                f.symlink_to(target)
                broken |= op == "dangling"
    if (d / INDEX).exists() and not (d / INDEX).is_symlink() and os.access(d / INDEX, os.W_OK):
        (d / INDEX).write_text(json.dumps(index))
    elif wm != json.loads((sharded_ckpt / INDEX).read_text())["weight_map"]:
        return  # the index was made read-only or linked away before its edits could be written: not this case
    with unreadable_as_its_owner_sees_it():
        model = only_value_error(lambda: kimik3.from_pretrained(d))
    assert (model is None) == broken, f"{edits}: {'refused' if model is None else 'loaded'}"
    if model is not None:
        ref = kimik3.from_preset("micro", seed=0)
        for (n, a), (_, w) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a, w), n


# ====================================================================== quantization_config patterns

@pytest.fixture(scope="module")
def quant_ckpt(workdir) -> Path:
    d = workdir / "quant"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d, expert_format="mxfp4")
    return d


HOSTILE = ["(.*.*)*Z", "(a|aa)*b", "((x+)+)+y$", "(.*)*(.*)*(.*)*q", "([^.]*)*\\.Z", "(?=a)", "a{1,9}",
           "(", "[", "\\", "x" * 5000]
pattern_text = st.one_of(st.sampled_from(HOSTILE), st.text(alphabet="ab.*+?()|[]^$\\:-", max_size=24))


@budget(40)
@given(patterns=st.lists(pattern_text, min_size=1, max_size=3), key=st.sampled_from(["ignore", "targets"]))
def test_fuzz_quantization_patterns(quant_ckpt, workdir, patterns, key):
    """``re:`` patterns in a checkpoint's quantization_config (ignore, config_groups targets): the load finishes
    (within the alarm: a backtracking regex would not) with a model or a ValueError."""
    d = workdir / "quant-case"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(quant_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    entries = ["re:" + p for p in patterns]
    if key == "ignore":
        qc["ignore"] = list(qc.get("ignore") or ()) + entries
    else:
        for g in qc["config_groups"].values():
            g["targets"] = list(g.get("targets") or ()) + entries
    (d / "config.json").write_text(json.dumps(cfg))
    only_value_error(lambda: kimik3.from_pretrained(d))


# ====================================================================== the long run


@pytest.mark.slow
@long_run(3000)
@given(header=header_strategy, data=st.binary(max_size=48), lie=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzz_safetensors_header_long(workdir, header, data, lie):
    test_fuzz_safetensors_header.hypothesis.inner_test(workdir, header, data, lie)


@pytest.mark.slow
@long_run(3000)
@given(muts=st.lists(mutation, min_size=1, max_size=10))
def test_fuzz_safetensors_bytes_long(workdir, muts):
    test_fuzz_safetensors_bytes.hypothesis.inner_test(workdir, muts)


@pytest.mark.slow
@long_run(2000)
@given(index=index_strategy, raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_fuzz_index_long(index_dir, index, raw):
    test_fuzz_index.hypothesis.inner_test(index_dir, index, raw)


@pytest.mark.slow
@long_run(3000)
@given(data=st.data())
def test_fuzz_config_long(workdir, micro_hf, data):
    test_fuzz_config.hypothesis.inner_test(workdir, micro_hf, data)
