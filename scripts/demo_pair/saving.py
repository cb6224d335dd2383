"""Write a trained demo model as a shippable Hugging Face directory.

Weights go through `infer.models.loading.checkpoint.save_checkpoint` in bf16, always sharded
(model-0000i-of-0000n.safetensors + model.safetensors.index.json): shards of at most
`MAX_SHARD_BYTES`, or half the model when it is smaller than that, so even a model that
fits one file gets two shards and the index layout is exercised by every load. The tokenizer
files and `training_summary.json` (read by the model card) go next to them.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from demo_pair.bpe import PAD_ID, save_tokenizer_files
from infer.models.llama import LlamaForCausalLM
from infer.models.loading.checkpoint import save_checkpoint

MAX_SHARD_BYTES = 15 * 2**20
SAVE_DTYPE = torch.bfloat16
SUMMARY_FILE = "training_summary.json"


def shard_limit(model: LlamaForCausalLM, dtype: torch.dtype = SAVE_DTYPE) -> int:
    """Tensor bytes per shard: files of at most MAX_SHARD_BYTES (the safetensors header
    gets a 64 KiB margin), and at least two shards even for a model that fits one."""
    total = sum(t.numel() for _, t in model.hf_state_dict()) * dtype.itemsize
    cap = MAX_SHARD_BYTES - 2**16
    return cap if total > cap else -(-total // 2)


def save_model(model: LlamaForCausalLM, directory: Path, tok: Tokenizer,
               summary: dict[str, Any]) -> Path:
    """Weights (bf16, sharded), config, generation config, tokenizer files, summary."""
    directory = Path(directory)
    save_checkpoint(model, directory, dtype=SAVE_DTYPE, max_shard_bytes=shard_limit(model),
                    generation_config={"pad_token_id": PAD_ID})
    save_tokenizer_files(tok, directory, model.config.max_position_embeddings)
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    for path in directory.iterdir():  # safetensors writes 0600; package data must be readable
        if path.is_file():
            path.chmod(0o644)
    return directory


def training_environment(device: torch.device) -> dict[str, str]:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def read_summary(directory: Path) -> dict[str, Any]:
    path = Path(directory) / SUMMARY_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))
