"""The tiny deterministic model (kvxferd.integrations.vllm.tinymodel) that the vLLM tests use.

Runs with the vLLM virtual environment's interpreter (.venv-vllm, made by
scripts/install-vllm.sh), in subprocesses: the suite's own environment has no torch. Checks
that the model is byte-identical when made twice, and that vLLM loads it offline and decodes
it greedily the same way twice, with different continuations for different prompts (a model
that always says the same thing could not tell a transferred KV cache from a wrong one).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.is_file(),
    reason=f"no vLLM environment at {VLLM_PYTHON}: run scripts/install-vllm.sh to set it up",
)

# vLLM start-up on 2 busy cores takes 25-90 s; one generation of a few tokens is sub-second.
VLLM_DEADLINE_S = 170


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


# Run as a script (vLLM spawns processes: the __main__ guard is needed), prints one JSON line.
_GENERATE = textwrap.dedent(
    """
    import json, sys

    def main():
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=sys.argv[1],
            dtype="float32",
            max_model_len=256,
            block_size=32,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
        )
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        prompts = [
            "the old man went to the sea and saw a white light",
            "children often play together in the school house after the long day",
        ]
        runs = []
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
        print("RESULT " + json.dumps(runs), flush=True)

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(VLLM_DEADLINE_S + 60)
def test_vllm_loads_it_offline_and_decodes_deterministically(
    tiny_model: Path, tmp_path: Path
) -> None:
    script = tmp_path / "generate.py"
    script.write_text(_GENERATE)
    try:
        proc = subprocess.run(
            [str(VLLM_PYTHON), str(script), str(tiny_model)],
            env=_env(),
            cwd=tmp_path,
            timeout=VLLM_DEADLINE_S,
            capture_output=True,
            text=True,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-4000:]
        pytest.fail(f"vLLM did not finish within {VLLM_DEADLINE_S} s; stderr tail:\n{tail!r}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-6000:])
        pytest.fail(f"vLLM run failed (exit {proc.returncode}); stderr tail above")
    first, second = json.loads(lines[-1].removeprefix("RESULT "))
    assert first == second, "greedy float32 decoding differed between two identical batches"
    assert all(len(tokens) == 6 for tokens in first)
    assert first[0] != first[1], "two different prompts gave the same continuation"
