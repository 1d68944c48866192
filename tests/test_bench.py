"""bench/run.py rewrites only its own table in bench/results.md."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench_run():
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_table_replaces_the_old_and_keeps_every_other_section(tmp_path):
    bench = load_bench_run()
    results = tmp_path / "results.md"
    results.write_text("## Launch latency\n\nby hand\n")
    results.write_text(bench.replace_block(results, "# Benchmark results\n\n| a | 1 |\n"))
    first = results.read_text()
    assert first.startswith(bench.BEGIN) and first.endswith("\n## Launch latency\n\nby hand\n")
    results.write_text(first + "\n## GPU check, appended later\n")
    results.write_text(bench.replace_block(results, "# Benchmark results\n\n| a | 2 |\n"))
    second = results.read_text()
    assert "| a | 2 |" in second and "| a | 1 |" not in second
    assert second.count(bench.BEGIN) == 1 and second.count(bench.END) == 1
    assert second == first.replace("| a | 1 |", "| a | 2 |") + "\n## GPU check, appended later\n"
