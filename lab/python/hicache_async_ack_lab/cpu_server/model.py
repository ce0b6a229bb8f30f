"""A tiny Llama with a real tokenizer, built offline, for servers on CPU.

Two layers, hidden 64, 4 heads (2 KV heads), vocab 512, float32. The weights are
seeded normal draws written as ``model.safetensors`` (served with
``--load-format safetensors``), so what the model answers depends on the whole
prompt, and so on the KV a cache restores. SGLang's ``--load-format dummy``
(uniform in +-1e-3) makes every logit ~0: every token's logprob is -ln(512) and
the greedy reply follows the last prompt token alone, whatever KV came back from
host or storage; cpu-server serves those only on request (``--cpu-weights dummy``).

The tokenizer is a byte-level BPE trained here on text that ships with Python,
so SGLang's own clients and ``bench_serving`` (which samples and decodes token
ids) work unchanged, with no download.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

# Bump when what is written changes: the directory name carries it (v1 had no weights).
MODEL_VERSION = 2
WEIGHTS_FILE = "model.safetensors"
SEED = 20260427
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


def weights(seed: int = SEED) -> dict:
    """HF Llama tensor names -> seeded float32 tensors (what SGLang's loader reads).

    Embeddings std 1; every projection std 1/sqrt(fan-in), so each layer keeps the
    residual stream's scale and the logits' spread is ~1: greedy choices are far
    from ties (float32 noise cannot flip them) and every output token's logprob
    depends on the attention over the whole prefix. Norm weights 1.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    c: dict = CONFIG
    hidden, inter, head_dim = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["head_dim"])
    q_out = int(c["num_attention_heads"]) * head_dim
    kv_out = int(c["num_key_value_heads"]) * head_dim

    def normal(rows: int, cols: int, std: float):
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32) * std

    fan = hidden**-0.5
    out = {"model.embed_tokens.weight": normal(VOCAB_SIZE, hidden, 1.0)}
    for i in range(int(c["num_hidden_layers"])):
        pre = f"model.layers.{i}."
        out |= {
            pre + "self_attn.q_proj.weight": normal(q_out, hidden, fan),
            pre + "self_attn.k_proj.weight": normal(kv_out, hidden, fan),
            pre + "self_attn.v_proj.weight": normal(kv_out, hidden, fan),
            pre + "self_attn.o_proj.weight": normal(hidden, q_out, q_out**-0.5),
            pre + "mlp.gate_proj.weight": normal(inter, hidden, fan),
            pre + "mlp.up_proj.weight": normal(inter, hidden, fan),
            pre + "mlp.down_proj.weight": normal(hidden, inter, inter**-0.5),
            pre + "input_layernorm.weight": torch.ones(hidden),
            pre + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    out["model.norm.weight"] = torch.ones(hidden)
    out["lm_head.weight"] = normal(VOCAB_SIZE, hidden, fan)
    return out


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
    from safetensors.torch import save_file

    save_file(weights(), str(out / WEIGHTS_FILE), metadata={"format": "pt", "seed": str(SEED)})


def _complete(path: Path) -> bool:
    return (path / "config.json").exists() and (path / WEIGHTS_FILE).exists()


def ensure_model(path: Path | None = None) -> Path:
    """Build the model directory once (atomically); return its path."""
    path = Path(path) if path else default_dir()
    if _complete(path):
        return path
    if path.exists() and any(path.iterdir()):
        # Not ours to replace (the default directory's name carries MODEL_VERSION, so
        # an older build is never found here).
        raise RuntimeError(
            f"{path} holds no complete tiny model (config.json and {WEIGHTS_FILE}): "
            "remove it, or pick another directory"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        _write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        if path.exists():
            path.rmdir()  # empty
        tmp.rename(path)
    except OSError:  # another process built it meanwhile
        if not _complete(path):
            raise
    return path
