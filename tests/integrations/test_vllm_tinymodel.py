"""The tiny deterministic model (kvxferd.integrations.vllm.tinymodel) that the vLLM tests use.

Runs with the vLLM virtual environment's interpreter (.venv-vllm, made by
scripts/install-vllm.sh), in subprocesses: the suite's own environment has no torch. Checks
that the model is byte-identical when made twice.

What vLLM does with it is checked where vLLM runs anyway, in test_vllm_connector.py: its
servers load it offline (launch.py), decode it greedily the same way in two instances
(every transferred request must give the tokens of one instance), and give different
continuations for different prompts (the negative control: a model that always said the
same thing could not tell a transferred KV cache from a wrong one). A vLLM start of this
module's own for the same properties cost 30-50 s of the suite.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm.sh to set it up",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # KV cache space in GiB; without it vLLM's memory-fraction check fails on a small host.
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONPATH=str(ROOT),
    )
    return env


def _make(directory: Path) -> Path:
    subprocess.run(
        [str(VLLM_PYTHON), "-m", "kvxferd.integrations.vllm.tinymodel", str(directory)],
        check=True,
        env=_env(),
        cwd=ROOT,
        timeout=120,
        capture_output=True,
    )
    return directory


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_model_is_byte_identical_when_made_again(tiny_model: Path, tmp_path: Path) -> None:
    first = _digests(tiny_model)
    assert "model.safetensors" in first
    assert "config.json" in first
    assert "tokenizer.json" in first
    again = _digests(_make(tmp_path / "again"))
    assert again == first
