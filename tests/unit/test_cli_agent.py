"""`gpuledger agent KIND`: the options of the `gpuledger` command line reach the agent, whose
settings come from the environment (load_settings)."""

from __future__ import annotations

import pytest

from gpuledger import cli


@pytest.mark.parametrize("kind,module", [("gpu", "gpu_agent"), ("dcgm", "dcgm_agent")])
def test_agent_gets_data_dir_and_bootstrap(kind, module, tmp_path, monkeypatch):
    import importlib

    from gpuledger.config import load_settings

    # set first, so monkeypatch puts back what was there when the test ends
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("GPULEDGER_KAFKA_BOOTSTRAP", "env:9092")
    seen = {}

    def fake_main(argv):
        settings = load_settings()
        seen.update(argv=argv, data_dir=settings.data_dir, bootstrap=settings.kafka_bootstrap)
        return 0

    monkeypatch.setattr(importlib.import_module(f"gpuledger.agents.{module}"), "main", fake_main)
    wanted = tmp_path / "agent-data"
    assert cli.main(["agent", "--data-dir", str(wanted), "--bootstrap", "b:9092", kind, "--once"]) == 0
    assert seen == {"argv": ["--once"], "data_dir": wanted, "bootstrap": "b:9092"}
