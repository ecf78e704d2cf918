"""The README's promises about errors and untrusted input, one by one, each held by a test: the table below quotes
each promise as the README words it and names the tests that keep it. A promise reworded or dropped in the README,
or a test renamed or removed, fails here; promises no other file tests are tested here."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

import kimik3

ROOT = Path(__file__).resolve().parents[1]

# promise, as the README words it -> the tests (file::function) that hold it
PROMISES: dict[str, list[str]] = {
    "ids outside the vocabulary": ["test_errors.py::test_decoder_errors"],
    "wrong batch size": ["test_errors.py::test_decoder_errors"],
    "past `max_seq_len`": ["test_errors.py::test_decoder_errors"],
    "`step` before `prefill`": ["test_errors.py::test_decoder_errors"],
    "unknown stage or preset": ["test_errors.py::test_unknown_preset_and_stage"],
    "a cache that would not fit in memory (with the GiB it needs)":
        ["test_bad_inputs.py::test_huge_cache_says_how_much_memory"],
    "a rejected call changes nothing": ["test_decoder_calls.py::test_a_refused_call_changes_nothing",
                                        "test_bad_inputs.py::test_rejected_generate_changes_nothing",
                                        "test_decode_consistency.py::test_failed_call_loses_nothing"],
    "a call that fails part-way leaves the Decoder refusing every call but `reset`":
        ["test_decoder_calls.py::test_a_step_that_raises_part_way_leaves_the_decoder_refusing_until_reset"],
    "a call from a second thread is refused": ["test_decoder_calls.py::test_a_call_from_a_second_thread_is_refused"],
    "token ids of any integer dtype": ["test_decoder_calls.py::test_every_integer_dtype_is_a_token_id"],
    '`dtype` takes a `torch.dtype` or its usual names': ["test_bad_inputs.py::test_dtype_strings"],
    "non-float dtypes are refused": ["test_bad_inputs.py::test_non_float_dtypes_refused"],
    "Configs are checked field by field": ["test_bad_inputs.py::test_config_field_refused_naming_field_and_file",
                                           "test_fuzz_inputs.py::test_fuzz_config"],
    "sizes up to 2³¹−1, at most 512 layers": ["test_readme_promises.py::test_sizes_and_layers_are_bounded"],
    "`tie_word_embeddings` is honoured": ["test_bad_inputs.py::test_tie_word_embeddings_honoured",
                                          "test_loading_edges.py::test_top_level_tie_word_embeddings_alone_is_honoured"],
    "malformed headers, indexes or tensors, and missing or unreadable files, are `ValueError`s naming file and key":
        ["test_bad_inputs.py::test_malformed_safetensors_header", "test_bad_inputs.py::test_malformed_index",
         "test_loading_edges.py::test_a_missing_config_is_a_value_error_naming_it",
         "test_loading_edges.py::test_an_unreadable_file_is_a_value_error_naming_it",
         "test_fuzz_inputs.py::test_fuzz_safetensors_header", "test_fuzz_inputs.py::test_fuzz_checkpoint_folder"],
    "the shard names an index gives stay inside the checkpoint folder": ["test_fuzz_inputs.py::test_fuzz_index"],
    "files there may be symlinks, which are followed":
        ["test_loading_edges.py::test_symlinked_files_load_as_in_a_hugging_face_cache_snapshot"],
    "only regular files are opened": ["test_bad_inputs.py::test_fifo_is_refused_not_waited_on",
                                      "test_file_edges.py::test_a_fifo_is_never_opened_for_reading"],
    "a key in two shards, or in a shard other than the one the index names, is refused":
        ["test_bad_inputs.py::test_key_in_two_shards_refused",
         "test_loading_edges.py::test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused",
         "test_loading_edges.py::test_an_index_that_omits_or_invents_a_tensor_is_refused"],
    "Every file the package writes is written atomically":
        ["test_bad_inputs.py::test_atomic_write_replaces_a_symlink_not_its_target",
         "test_file_edges.py::test_output_paths_that_are_not_regular_files_are_refused"],
    "an export is staged and swapped in whole": ["test_bad_inputs.py::test_interrupted_export_keeps_the_earlier_one",
                                                 "test_bad_inputs.py::test_reexport_leaves_no_files_of_the_earlier_export"],
    "a non-empty `--out` that is not a kimik3 export is refused unless `--overwrite`":
        ["test_bad_inputs.py::test_export_refuses_a_foreign_folder_unless_overwrite",
         "test_bad_inputs.py::test_export_recognises_its_own_folders_by_content_not_names",
         "test_cli_args.py::test_a_folder_of_someone_elses_files_is_refused_as_out"],
    "an output path that is a device, a FIFO or a symlink to nothing is refused":
        ["test_file_edges.py::test_output_paths_that_are_not_regular_files_are_refused",
         "test_cli_args.py::test_a_dangling_symlink_as_out_is_refused"],
    "a model or state that would not fit refused with the GiB it needs":
        ["test_bad_inputs.py::test_a_full_size_model_off_the_meta_device_is_refused_with_the_gib_it_needs",
         "test_bad_inputs.py::test_an_export_that_would_not_fit_in_memory_is_refused_before_writing"],
    "Commands check their arguments (counts and sizes bounded":
        ["test_cli_args.py::test_nonsense_is_refused_before_any_work", "test_bad_inputs.py::test_bench_arguments",
         "test_bad_inputs.py::test_validate_arguments"],
    "exit non-zero when they measured or validated nothing": [
        "test_bad_inputs.py::test_bench_nothing_measured_exits_nonzero",
        "test_bad_inputs.py::test_validate_nothing_validated_is_not_a_pass"],
    "a failed or interrupted notebook run is kept as `<notebook>.FAILED.ipynb`":
        ["test_bad_inputs.py::test_interrupted_notebook_is_marked_failed"],
    "text from a file is escaped before it is shown":
        ["test_loading_edges.py::test_terminal_escapes_from_a_file_are_escaped_in_messages",
         "test_cli_args.py::test_a_refusal_quoting_a_file_escapes_its_terminal_sequences"],
    "safetensors only (no pickle": ["test_errors.py::test_pickle_checkpoints_refused"],
}


def _readme() -> str:
    return re.sub(r"\s+", " ", (ROOT / "README.md").read_text(encoding="utf-8"))


@pytest.mark.parametrize("promise", sorted(PROMISES))
def test_the_readme_makes_the_promise_and_a_test_holds_it(promise: str) -> None:
    assert re.sub(r"\s+", " ", promise) in _readme(), f"the README no longer says {promise!r}: update this table"
    for node in PROMISES[promise]:
        file, name = node.split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text(encoding="utf-8"))
        defined = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
        assert name in defined, f"{node}, named for {promise!r}, does not exist"


def test_sizes_and_layers_are_bounded(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    kimik3.save_pretrained(kimik3.from_preset("micro", seed=0), d)
    base = json.loads((d / "config.json").read_text())
    for field, value, says in [("vocab_size", 2**31, "at most 2147483647"),
                               ("num_hidden_layers", 513, "at most 512")]:
        cfg = json.loads(json.dumps(base))
        cfg["text_config"][field] = value
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=rf"{field}.*{says}"):
            kimik3.from_pretrained(d, dtype=torch.float32)
