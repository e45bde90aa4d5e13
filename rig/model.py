"""Generate the rig's tiny MoE model offline and deterministically.

The model is a Qwen3-MoE with real random weights (fixed seed), not vLLM's
dummy weights: dummy weights make greedy decoding repeat two tokens, which
would hide a duplicated or lost token in continuity tests. Every shape here
was chosen to pass vLLM's CPU checks (head_dim 64; external DP needs MoE).

Run: ``python -m rig.model OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SEED = 0
VOCAB_SIZE = 320
# float32, not bfloat16: vLLM is not batch-invariant, and in bfloat16 the tiny
# model's near-tied logits flip when the batch changes (~1e-2 differences), so
# a fault-free reference run would differ from itself under load. In float32
# the differences are ~1e-7 and greedy answers repeat token for token.
DTYPE = "float32"
# Written into the completion marker: a folder made with other weights or
# another dtype is regenerated instead of silently reused.
VERSION = f"seed={SEED};dtype={DTYPE};vocab={VOCAB_SIZE}"
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = """\
The proxy sits in front of every rank and sends new work only where it can be
served. When a rank faults, its peers time out, the group turns unhealthy, and
a retry brings every engine back. Streams pause and then continue to their end
with no token duplicated and none lost. Data parallel ranks share one model;
each rank serves its own requests and joins the others in every step of the
mixture of experts. Tokens flow from the engine to the client event by event.
0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-'"()
"""

MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "torch_dtype": DTYPE,
}


def _train_tokenizer(out: Path) -> int:
    """Train a byte-level BPE offline; returns the EOS token id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    eos_id = tok.token_to_id(EOS)
    assert eos_id is not None
    return int(eos_id)


def _write_weights(out: Path, eos_id: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg: dict[str, Any] = dict(MODEL_CONFIG, eos_token_id=eos_id, pad_token_id=eos_id)
    cfg.pop("architectures")
    cfg.pop("model_type")
    config = Qwen3MoeConfig(**cfg)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE))
    model.save_pretrained(str(out))


def generate(out: Path) -> Path:
    """Write config, tokenizer and weights into ``out``; skip if complete."""
    marker = out / ".complete"
    if marker.exists() and marker.read_text().strip() == VERSION:
        return out
    out.mkdir(parents=True, exist_ok=True)
    eos_id = _train_tokenizer(out)
    _write_weights(out, eos_id)
    marker.write_text(VERSION + "\n")
    return out


if __name__ == "__main__":
    print(generate(Path(sys.argv[1] if len(sys.argv) > 1 else ".rig/tiny-moe")))
