"""``benchmarks/run.py hfgen`` on the CPU: a smoke run (tiny configs) of both generate paths."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import common, run  # noqa: E402


def test_hfgen_cpu_smoke(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "OUT_DIR", str(tmp_path))
    assert run.main(["hfgen", "--model", "llama", "mimo_v2_flash", "--prompt", "40", "--new-tokens", "6",
                     "--page-size", "8", "--repeats", "1"]) == 0
    payload = json.loads((tmp_path / "hfgen-cpu-smoke.json").read_text())
    assert payload["smoke"] and [r["model"] for r in payload["rows"]] == ["llama", "mimo_v2_flash"]
    for row in payload["rows"]:
        assert row["tokens_agree"] == row["new_tokens"] == 6  # fp32: the same greedy tokens
        assert row["cpattn"]["cache_bytes"] > 0 and row["transformers"]["cache_bytes"] > 0
        assert row["cpattn"]["decode_tokens_per_s"] > 0
    assert "| llama |" in capsys.readouterr().out
