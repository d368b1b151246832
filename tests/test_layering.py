"""Which way imports go (ARCHITECTURE.md, and the entry points above everything): schemas
imports nothing of ours; kernels only torch and triton; workers.engine only kernels and schemas;
pipeline never imports workers or the entry points; workers never imports the entry points."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"schemas", "pipeline", "workers", "kernels", "firsttoken"}

# package (path prefix) -> our top-level packages it may import
ALLOWED = {
    "schemas": {"schemas"},
    "kernels": {"kernels"},
    "workers/engine": {"workers", "kernels", "schemas"},  # workers: its own modules only (checked below)
    "pipeline": {"pipeline", "schemas"},
    "workers": {"workers", "pipeline", "schemas", "kernels"},
    "firsttoken": OURS,
}


def imports_of(path: Path) -> set[str]:
    """Every module name `path` imports, at any depth (inside functions too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _package_of(rel: str) -> str:
    return next(p for p in sorted(ALLOWED, key=len, reverse=True) if rel.startswith(p + "/"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if _package_of(rel) != package:
            continue
        for mod in imports_of(path):
            top = mod.split(".")[0]
            if top not in OURS:
                continue
            if top not in ALLOWED[package] or (package == "workers/engine" and top == "workers" and not mod.startswith("workers.engine")):
                bad.append(f"{rel} imports {mod}")
    assert bad == []


def test_the_store_parts_import_downwards_only():
    """pipeline/store: the row helpers (rows, records, tables, engine) import no part of the store
    above them, the parts (bulk, jobs, batches, files, latency) never ResultStore's module or the
    package: no circle."""
    store = ROOT / "pipeline" / "store"
    leaves = {"rows", "records", "tables", "engine", "migrate"}
    parts = {"bulk", "jobs", "batches", "files", "latency"}
    assert {p.stem for p in store.glob("*.py")} == leaves | parts | {"repository", "__init__"}
    for path in store.glob("*.py"):
        ours = {m for m in imports_of(path) if m.startswith("pipeline.store")}
        if path.stem in leaves:
            assert ours <= {f"pipeline.store.{m}" for m in leaves}, (path.name, ours)
        elif path.stem in parts:
            assert "pipeline.store" not in ours and "pipeline.store.repository" not in ours, (path.name, ours)


def test_the_model_runner_sits_above_its_parts():
    """workers/engine: the runner imports its parts (step inputs, CUDA graphs, KV sizing, sampled
    tokens, sampler); none of them imports the runner, at any depth, type checking included. The
    graphs get the model's forward from a GraphContext, not from the runner."""
    engine = ROOT / "workers" / "engine"
    for part in ("cuda_graphs", "step_inputs", "kv_sizing", "sampled", "sampler", "attention"):
        assert "workers.engine.model_runner" not in imports_of(engine / f"{part}.py"), part
    runner = imports_of(engine / "model_runner.py")
    for part in ("cuda_graphs", "step_inputs", "kv_sizing", "sampled", "sampler"):
        assert f"workers.engine.{part}" in runner, part


def test_the_tests_mirror_the_code_tree():
    """A unit test file sits under tests/ where its subject sits in the code (tests/pipeline/store/
    for pipeline/store/, tests/workers/engine/ for workers/engine/, ...); tests/integration holds the
    cross-cutting ones, and the files at tests/ the repository-wide checks."""
    code = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("*/**") if p.is_dir() and "__pycache__" not in p.parts}
    for test_dir in (ROOT / "tests").glob("**/"):
        rel = test_dir.relative_to(ROOT / "tests").as_posix()
        if rel in (".", "integration") or "__pycache__" in rel or not any(test_dir.glob("test_*.py")):
            continue
        assert rel in code, f"tests/{rel} mirrors no code directory"
