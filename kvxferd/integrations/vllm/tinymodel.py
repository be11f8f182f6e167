"""A tiny deterministic Llama, made offline, that vLLM loads from a directory.

No model hub is reachable from the machines the tests run on, and no installable package
ships suitable weights, so the vLLM tests and the demo make their own: a Llama with random
weights from a fixed seed (vocabulary 512, hidden 128, intermediate 256, 2 layers, 4 attention
heads, 2 KV heads, head_dim 32), saved as float32 safetensors, and a WordLevel tokenizer of
512 words with a whitespace pre-tokenizer, saved through transformers' fast-tokenizer wrapper.
It says nothing sensible, but greedy decoding is deterministic and different prompts give
different continuations, which is all a KV-transfer test needs. The files are byte-identical
every time they are made with the same torch/transformers versions (about 1.7 MB).

The sizes fit vLLM's CPU attention backend: head_dim must be one of its kernel sizes (32 and
up) and the block size a multiple of 32.

    python -m kvxferd.integrations.vllm.tinymodel DIR

torch, transformers and tokenizers are imported inside the functions (through importlib, typed
Any, so that mypy passes without them): kvxferd's own virtual environment has none of them;
run this with the vLLM one (.venv-vllm/bin/python).
"""

from __future__ import annotations

import importlib
import itertools
import sys
from pathlib import Path
from typing import Any

SEED = 1234
VOCAB_SIZE = 512
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 32
MAX_POSITIONS = 2048
# The standard deviation of the random weights. Llama's usual 0.02 makes every logit almost
# equal on a model this small, so greedy decoding repeats one token whatever the prompt;
# with this the continuation depends on the prompt.
INIT_RANGE = 0.3

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

# Real words first, so that prompts in tests read like text; the rest of the vocabulary is
# made of syllables.
_WORDS_TEXT = """
the of and to in is it that was for on are as with his they at be this from have or by one
had not but what all were when we there can an your which their said if do will each about
how up out them then she many some so these would other into has more her two like him see
time could no make than first been its who now people my made over did down only way find use
may water long little very after words called just where most know get through back much go
good new write our me man too any day same right look think also around another came come
work three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found still
between name should home big give air line set own under read last never us left end along
while might next sound below saw something thought both few those always looked show large
often together asked house world going want school important until form food keep children
feet land side without boy once animals life enough took sometimes four head above kind began
almost live page got earth need far hand high year mother light parts country father let
night following picture being study second eyes soon times story boys since white days paper
hard near sentence better best across during today others however sure means knew its try
told young miles sun ways thing whole hear example heard several change answer room sea
against top turned learn point city play toward five using himself usually
"""


def vocabulary() -> list[str]:
    """The tokenizer's 512 tokens: the special tokens, then words, in a fixed order."""
    words: list[str] = []
    seen = set(SPECIAL_TOKENS)
    for w in _WORDS_TEXT.split():
        if w not in seen:
            seen.add(w)
            words.append(w)
    for a, b in itertools.product("bdfgklmnprstvz", "aeiou"):
        if len(words) + len(SPECIAL_TOKENS) >= VOCAB_SIZE:
            break
        for c in "nrstl":
            w = a + b + c
            if w not in seen and len(words) + len(SPECIAL_TOKENS) < VOCAB_SIZE:
                seen.add(w)
                words.append(w)
    vocab = [*SPECIAL_TOKENS, *words]
    assert len(vocab) == VOCAB_SIZE, len(vocab)
    return vocab


def _save_tokenizer(directory: Path) -> None:
    tokenizers: Any = importlib.import_module("tokenizers")
    models: Any = importlib.import_module("tokenizers.models")
    pre_tokenizers: Any = importlib.import_module("tokenizers.pre_tokenizers")
    transformers: Any = importlib.import_module("transformers")

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(directory))


def _save_model(directory: Path) -> None:
    torch: Any = importlib.import_module("torch")
    transformers: Any = importlib.import_module("transformers")

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    # Draw every weight again from a generator of our own, in name order: the result then does
    # not depend on how (or whether) transformers initialises weights in this version.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_RANGE)
    model.save_pretrained(str(directory), safe_serialization=True)


def make_tiny_model(directory: str | Path) -> Path:
    """Write the tiny model (config, float32 safetensors weights, tokenizer) into `directory`.

    Creates the directory if needed and returns it. Runs offline, in a few seconds on CPU.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(path)
    _save_model(path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m kvxferd.integrations.vllm.tinymodel DIR", file=sys.stderr)
        return 2
    print(make_tiny_model(args[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
