"""The engine's options, declared once (workers.settings.EngineSettings): the CLI's flags come
from the fields, a flag given wins over FIRSTTOKEN_*, which wins over the default, and every
option reaches EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from firsttoken.cli import build_parser
from workers.engine import EngineConfig
from workers.settings import ENGINE_FIELDS, EngineSettings, WorkerSettings


def test_every_engine_option_is_a_flag_of_run_generate_and_worker_and_reaches_engine_config():
    assert set(ENGINE_FIELDS) <= {f.name for f in dataclasses.fields(EngineConfig)}
    for command in ("run", "generate", "worker"):
        extra = ["in.jsonl"] if command != "worker" else []
        args = build_parser(command).parse_args([command, *extra, "--quantization", "fp8", "--max-num-seqs", "7",
                                                 "--tpot-target-ms", "12.5", "--kv-cache-dtype", "fp8",
                                                 "--kv-reserve", "0.5"])
        cfg = EngineSettings.from_args(args).engine_config()
        assert (cfg.quantization, cfg.max_num_seqs, cfg.tpot_target_ms, cfg.kv_cache_dtype) == ("fp8", 7, 12.5, "fp8")
        assert cfg.kv_reserve == 0.5
    with pytest.raises(SystemExit):  # choices come from the field's type
        build_parser("run").parse_args(["run", "x", "--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_reserve"):  # and bounds from the field
        EngineSettings.from_args(build_parser("run").parse_args(["run", "x", "--kv-reserve", "1.5"]))


def test_kv_reserve_is_auto_unless_a_share_is_given(monkeypatch):
    """--kv-reserve takes a share in [0, 1] or "auto" (the default, workers.engine.scheduler.AdaptiveReserve);
    EngineConfig refuses anything else, and the scheduler learns the share only under auto."""
    from workers.engine.kv_cache_manager import KVCacheManager
    from workers.engine.scheduler import Scheduler

    parse = build_parser("run").parse_args
    assert EngineSettings.from_args(parse(["run", "x"])).engine_config().kv_reserve == "auto"
    assert EngineConfig().kv_reserve == "auto"
    assert EngineSettings.from_args(parse(["run", "x", "--kv-reserve", "auto"])).kv_reserve == "auto"
    monkeypatch.setenv("FIRSTTOKEN_KV_RESERVE", "0")
    assert EngineSettings.from_args(parse(["run", "x"])).engine_config().kv_reserve == 0.0
    for bad in ("x", -0.1, 2, True, float("nan")):
        with pytest.raises(ValueError, match="kv_reserve"):
            EngineConfig(kv_reserve=bad)
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert Scheduler(kv, 16, 4, 64, kv_reserve="auto").adaptive is not None
    fixed = Scheduler(kv, 16, 4, 64, kv_reserve=0.5)
    assert fixed.adaptive is None and fixed.kv_reserve == 0.5


def test_a_flag_wins_over_the_variable_which_wins_over_the_default(monkeypatch):
    parse = build_parser("worker").parse_args
    assert WorkerSettings.from_args(parse(["worker"])).max_num_seqs == 512
    monkeypatch.setenv("FIRSTTOKEN_MAX_NUM_SEQS", "64")
    monkeypatch.setenv("FIRSTTOKEN_MODEL", "tiny")
    ws = WorkerSettings.from_args(parse(["worker"]))
    assert (ws.max_num_seqs, ws.model) == (64, "tiny")
    ws = WorkerSettings.from_args(parse(["worker", "--max-num-seqs", "8", "--model", "llama3-8b"]))
    assert (ws.max_num_seqs, ws.model) == (8, "llama3-8b")
    assert ws.engine_config().max_num_seqs == 8


def test_other_commands_do_not_take_the_engine_flags():
    with pytest.raises(SystemExit):
        build_parser("status").parse_args(["status", "b1", "--quantization", "fp8"])


def test_a_removed_option_s_variable_is_an_error_not_ignored(monkeypatch):
    from workers.settings import EngineSettings, WorkerSettings

    EngineSettings()
    monkeypatch.setenv("FIRSTTOKEN_FP8_ACT_GROUP", "128")
    for cls in (EngineSettings, WorkerSettings):
        with pytest.raises(ValueError, match=r"FIRSTTOKEN_FP8_ACT_GROUP.*per channel only"):
            cls()
