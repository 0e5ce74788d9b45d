"""A tiny PEFT-format LoRA adapter for the test Llama (tests/support/hf_models.py),
written without peft: adapter_config.json and adapter_model.safetensors with the
tensor names and shapes peft saves and vLLM loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Every attention projection: k_proj and v_proj change the KV itself, so KV computed
# under one adapter is wrong for another and for the base model.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_adapter(path: Path, config: Any, seed: int, rank: int = 8) -> Path:
    """An adapter of rank `rank` on every layer's attention projections of a model with
    transformers config `config`, with seeded nonzero random weights (large enough to
    change greedy tokens); returns `path`."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    out = {
        "q_proj": config.num_attention_heads * head_dim,
        "k_proj": config.num_key_value_heads * head_dim,
        "v_proj": config.num_key_value_heads * head_dim,
        "o_proj": hidden,
    }
    inp = {**dict.fromkeys(("q_proj", "k_proj", "v_proj"), hidden), "o_proj": out["q_proj"]}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for m in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            # peft's shapes: A [rank, in], B [out, rank] (B is zero when peft creates
            # an adapter; here both are random so the adapter is not a no-op).
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp[m], generator=g) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(out[m], rank, generator=g) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=1))
    return path


def merged(model_dir: str, adapter: str, dtype: Any) -> Any:
    """The model at `model_dir` with the adapter at `adapter` merged into its weights
    (W + lora_alpha / r * B @ A, in float32), in `dtype`: what the adapter computes,
    without peft or vLLM."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = model.state_dict()
    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[target] += scale * b.float() @ a.float()
    model.load_state_dict(weights)
    return model.to(dtype)
