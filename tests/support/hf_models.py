"""Tiny transformers models with seeded random weights, shared by the hf tests
(test_hf.py, test_sessions.py) and the child processes they start. No download:
the weights are a pure function of the seed, so a child rebuilds the very same
model (the tests check that through hf.fingerprint)."""

from __future__ import annotations

from typing import Any

VOCAB = 1000


def tiny_llama(dtype: str = "float32", seed: int = 0, layers: int = 4) -> Any:
    """LlamaForCausalLM: hidden 256, `layers` layers, 4 heads, 2 KV heads (GQA),
    head_dim 64, in `dtype`; eval mode; never stops at an end-of-sequence token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        # Wider than the default 0.02, so greedy decoding has clear winners and
        # varied output rather than one token repeated.
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().to(getattr(torch, dtype))
    model.generation_config.do_sample = False
    return model


def prompt(n: int, seed: int = 1) -> Any:
    """[1, n] int64 token ids."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def greedy(model: Any, input_ids: Any, new_tokens: int = 32, **kwargs: Any) -> Any:
    """Greedy continuation by recomputing the whole prompt: `new_tokens` token ids."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **kwargs,
        )
    return out[0, input_ids.shape[1] :]


def tiny_llava(image_token: int = 999) -> Any:
    """LlavaForConditionalGeneration: a 2-layer Llama text model (2 KV heads, head_dim
    32) and a 1-layer CLIP vision tower on 32x32 images of 16 patches, so a prompt
    holds 16 `image_token` placeholders per image."""
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            initializer_range=0.1,
        ),
        image_token_id=image_token,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.do_sample = False
    return model


def tiny_deepseek(dtype: str = "float32", seed: int = 0, layers: int = 2) -> Any:
    """DeepseekV3ForCausalLM with MLA and no experts (every layer dense): hidden 256,
    `layers` layers, 4 heads, `kv_lora_rank` 512 + `qk_rope_head_dim` 64 (a 576-wide
    latent, a width vLLM's CPU MLA kernel takes), in `dtype`; eval mode."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = DeepseekV3Config(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=layers,
        first_k_dense_replace=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_scaling=None,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval().to(getattr(torch, dtype))
    model.generation_config.do_sample = False
    return model
