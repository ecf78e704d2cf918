"""The profiling harness: operator counts, timings, and the kernel-metrics fallback chain (CPU side)."""
# ruff: noqa: E501 - the ncu CSV fixture is verbatim

from __future__ import annotations

import torch

import kimik3
from kimik3.perf.profiling import choose_backend, count_ops, kernel_metrics, ncu_command, parse_ncu_csv, time_per_call

NCU_CSV = '''==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","gemv_kernel","1","7","(128, 1, 1)","(1792, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","102.76"
"0","1","python","h","gemv_kernel","1","7","(128, 1, 1)","(1792, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","7.17"
"0","1","python","h","gemv_kernel","1","7","(128, 1, 1)","(1792, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","25.60"
'''


def test_parse_ncu_csv_units_and_bandwidth():
    df = parse_ncu_csv(NCU_CSV)
    assert len(df) == 1
    row = df.iloc[0]
    assert row["dram_bytes"] == 102.76e6 + 7.17e3
    assert abs(row["seconds"] - 25.6e-6) < 1e-12
    assert abs(row["gb_per_s"] - (102.76e6 + 7.17e3) / 25.6e-6 / 1e9) < 1e-9


def test_backend_chain_on_cpu_says_why():
    backend, why = choose_backend("cpu")
    assert backend == "torch-cpu" and "no GPU" in why
    df, used, why = kernel_metrics("micro", "absorbed", out_dir="/tmp/kimik3-ncu-test")
    assert used == "torch-cpu" and df.empty and why


def test_ncu_command_profiles_the_child_entry():
    cmd = ncu_command(["--preset", "k3-shard"], "/tmp/x.csv", nvtx_include="decode_step/")
    assert cmd[0] == "ncu" and "dram__bytes_read.sum" in cmd[cmd.index("--metrics") + 1]
    assert cmd[-4:-2] == ["kimik3.perf.profiling", "child"] and "--nvtx-include" in cmd


def test_count_ops_and_timing_on_a_decode_step(tmp_path):
    model = kimik3.from_preset("micro", seed=0)
    dec = kimik3.Decoder(model, "naive", batch_size=1, max_seq_len=32)
    nxt = dec.prefill(torch.randint(0, 512, (1, 4))).argmax(-1)
    ops = count_ops(lambda: dec.step(nxt), calls=2, trace_path=tmp_path / "t.json")
    assert ops.backend == "torch-cpu" and ops.operators_per_call > 50 and (tmp_path / "t.json").exists()
    t = time_per_call(lambda: dec.step(nxt), repeats=3, warmup=1)
    assert t.clock == "wall-clock" and len(t.samples) == 3 and t.spread[0] <= t.median <= t.spread[1]
