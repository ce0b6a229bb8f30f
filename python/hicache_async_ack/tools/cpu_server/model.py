"""A tiny Llama with a real tokenizer, built offline, for servers on CPU.

Two layers, hidden 64, 4 heads (2 KV heads), vocab 512, float32; weights come
from SGLang's ``--load-format dummy`` (seeded), so only the config and a
tokenizer are written. The tokenizer is a byte-level BPE trained here on text
that ships with Python, so SGLang's own clients and ``bench_serving`` (which
samples and decodes token ids) work unchanged, with no download.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# Bump when what is written changes: the directory name carries it.
MODEL_VERSION = 1
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def default_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "hicache-async-ack" / f"tiny-llama-v{MODEL_VERSION}"


def _corpus() -> list[str]:
    # Deterministic English-ish text every Python install has.
    import argparse
    import inspect
    import textwrap

    return [inspect.getsource(m) for m in (argparse, textwrap, inspect)]


def _write(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,
            },
            indent=2,
        )
    )
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
    )


def ensure_model(path: Path | None = None) -> Path:
    """Build the model directory once (atomically); return its path."""
    path = Path(path) if path else default_dir()
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    _write(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process built it meanwhile
        if not (path / "config.json").exists():
            raise
    return path
