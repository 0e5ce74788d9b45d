"""transformers "kvstore" attention: a stock LlamaForCausalLM decoding over a BlockPool.

The prompt's KV is computed by the model (eager attention), put into a real
store, loaded into a BlockPool and decoded from there with paged attention; the
greedy tokens must equal eager attention's, and the logits agree to float32
rounding.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvstore  # noqa: E402
from kvstore import attention  # noqa: E402
from kvstore.torch import BlockPool  # noqa: E402

NEW_TOKENS = 32
LOGIT_TOL = 1e-4  # float32 model: paged vs eager attention differ by rounding only


def tiny_llama(seed: int = 0) -> Any:
    """2 layers, 8 query heads over 2 KV heads (GQA 4), head_dim 32, float32."""
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        # Wider than the default 0.02, so greedy decoding has clear winners and varied
        # output instead of one repeated token.
        initializer_range=0.1,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.do_sample = False
    return model


def layout_of(model: Any, block_size: int = 8) -> kvstore.Layout:
    c = model.config
    return kvstore.Layout(
        num_layers=c.num_hidden_layers,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        dtype="float32",
        block_size=block_size,
    )


def cache_kv(cache: DynamicCache) -> torch.Tensor:
    """A DynamicCache of one sequence as `[L, 2, T, H, D]` (the store's layout)."""
    return torch.stack(
        [torch.stack([layer.keys[0], layer.values[0]]).transpose(1, 2) for layer in cache.layers]
    )


@torch.inference_mode()
def eager_greedy(model: Any, prompt: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    ids, tokens, logits = prompt[None], [], []
    for _ in range(NEW_TOKENS):
        step = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


@torch.inference_mode()
def paged_greedy(
    model: Any, cache: attention.PagedCache, ids: torch.Tensor
) -> tuple[list[int], list[torch.Tensor]]:
    model.set_attn_implementation(attention.register())
    tokens, logits = [], []
    ids = ids[None]
    for _ in range(NEW_TOKENS):
        pos = cache.position_ids(ids.shape[1])
        step = model(ids, position_ids=pos, past_key_values=cache).logits[0, -1]
        logits.append(step)
        tokens.append(int(step.argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama()


@pytest.fixture
def prompt() -> torch.Tensor:
    return torch.randint(1, 1000, (45,), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def store_with_prompt(tmp_path, model, prompt):
    """A store holding the KV of the prompt's 5 full blocks, computed by the model."""
    with torch.inference_mode():
        model.set_attn_implementation("eager")
        out = model(prompt[None], use_cache=True)
    layout = layout_of(model)
    with kvstore.open(tmp_path / "kv", layout=layout, model="tiny-llama@0") as store:
        assert store.put(prompt, cache_kv(out.past_key_values)) == 40
        store.flush()
        yield store


def test_greedy_decode_over_a_pool_loaded_from_a_store_equals_eager(
    model, prompt, store_with_prompt
):
    want_tokens, want_logits = eager_greedy(model, prompt)
    assert len(set(want_tokens)) >= 8, "degenerate model output makes a weak test"

    pool = BlockPool(store_with_prompt.layout, num_blocks=32, device="cpu")
    # Load all but the last prompt token, so at least one token is fed to get logits.
    with pool.load(store_with_prompt, prompt[:-1]) as seq:
        assert seq.length == 40
        cache = attention.PagedCache(pool, [seq])
        got_tokens, got_logits = paged_greedy(model, cache, prompt[seq.length :])
        # The 5 remaining prompt tokens and 31 generated ones went into the pool.
        assert seq.length == 45 + NEW_TOKENS - 1 and cache.get_seq_length() == seq.length
    assert got_tokens == want_tokens
    for step, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        torch.testing.assert_close(g, w, atol=LOGIT_TOL, rtol=LOGIT_TOL, msg=f"step {step}")


def test_generate_with_a_paged_cache_equals_eager_generate(model, prompt, store_with_prompt):
    model.set_attn_implementation("eager")
    want = model.generate(prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False)
    pool = BlockPool(store_with_prompt.layout, num_blocks=32, device="cpu")
    with pool.load(store_with_prompt, prompt[:-1]) as seq:
        cache = attention.PagedCache(pool, [seq])
        model.set_attn_implementation(attention.register())
        got = model.generate(
            prompt[None], past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert got.tolist() == want.tolist()


def test_batch_decode_of_sequences_with_different_lengths(model, store_with_prompt):
    """Two rows share the pool and prefix blocks but not their lengths."""
    g = torch.Generator().manual_seed(2)
    base = torch.randint(1, 1000, (45,), generator=torch.Generator().manual_seed(1))
    prompts = [base, torch.cat([base[:24], torch.randint(1, 1000, (9,), generator=g)])]
    steps = 12
    want = []
    for p in prompts:
        tokens, _ = eager_greedy(model, p)
        want.append(tokens[:steps])

    pool = BlockPool(store_with_prompt.layout, num_blocks=32, device="cpu")
    seqs = [pool.load(store_with_prompt, p[:-1]) for p in prompts]
    assert [s.length for s in seqs] == [40, 24]
    assert seqs[1].blocks == seqs[0].blocks[:3], "the shared prefix blocks are reused"
    first = []
    for s, p in zip(seqs, prompts, strict=True):  # prefill each row's remainder on its own
        tokens, _ = paged_greedy_steps(model, attention.PagedCache(pool, [s]), p[s.length :], 1)
        first.append(tokens[0])
    both = attention.PagedCache(pool, seqs)
    ids = torch.tensor(first)[:, None]
    got = [[first[0]], [first[1]]]
    with torch.inference_mode():
        for _ in range(steps - 1):
            pos = both.position_ids(1)
            ids = model(ids, position_ids=pos, past_key_values=both).logits[:, -1].argmax(-1)
            ids = ids[:, None]
            for row in range(2):
                got[row].append(int(ids[row, 0]))
    assert got == want
    for s in seqs:
        s.release()
    assert pool.num_free == 32


def paged_greedy_steps(model: Any, cache: attention.PagedCache, ids: torch.Tensor, n: int):
    model.set_attn_implementation(attention.register())
    return attention.greedy(model, cache, ids, n)[0].tolist(), None


def test_kvstore_attention_needs_a_paged_cache(model, prompt):
    model.set_attn_implementation(attention.register())
    with torch.inference_mode(), pytest.raises(ValueError, match="PagedCache"):
        model(prompt[None], past_key_values=DynamicCache(config=model.config))


def test_a_paged_cache_refuses_another_attention(model, prompt, store_with_prompt):
    pool = BlockPool(store_with_prompt.layout, num_blocks=8, device="cpu")
    cache = attention.PagedCache(pool, [pool.new_sequence()])
    model.set_attn_implementation("sdpa")
    with (
        torch.inference_mode(),
        pytest.raises(RuntimeError, match='needs attn_implementation="kvstore"'),
    ):
        model(prompt[None, :1], past_key_values=cache)


def test_rows_of_different_lengths_need_their_positions(model, store_with_prompt):
    """Without position_ids transformers gives every row the first row's positions: a
    shorter row's K was rotated at the wrong position and saved (logits off by 7.5).
    Missing or wrong positions raise, count no token, and a right forward after that
    decodes as eager attention does."""
    base = torch.randint(1, 1000, (45,), generator=torch.Generator().manual_seed(1))
    prompts = [base[:41], base[:33]]  # one token each left to feed
    want = [eager_greedy(model, p)[0][:2] for p in prompts]
    pool = BlockPool(store_with_prompt.layout, num_blocks=32, device="cpu")
    seqs = [pool.load(store_with_prompt, p[:-1]) for p in prompts]
    assert [s.length for s in seqs] == [40, 32]
    cache = attention.PagedCache(pool, seqs)
    model.set_attn_implementation(attention.register())
    ids = torch.stack([p[-1:] for p in prompts])
    wrong = torch.tensor([[40], [40]])
    with torch.inference_mode():
        for kw in ({}, {"position_ids": wrong}):
            with pytest.raises(kvstore.InvalidInput, match="position_ids"):
                model(ids, past_key_values=cache, **kw)
            assert [s.length for s in seqs] == [40, 32] and cache.get_seq_length() == 40
        got = attention.greedy(model, cache, ids, 2)
    assert got.tolist() == want
    assert [s.length for s in seqs] == [42, 34]
    for s in seqs:
        s.release()


def test_a_forward_that_fails_part_way_counts_no_tokens(model, tmp_path):
    """A forward that stops after layer 0 wrote (here: another attention runs) left the
    sequence's length advanced, and save stored layer 1's blocks as they were: a
    released sequence's KV under these tokens. The length now counts what every layer
    holds, and the next forward writes the tokens again."""
    a, b = (
        torch.randint(1, 1000, (16,), generator=torch.Generator().manual_seed(s)) for s in (5, 6)
    )
    layout = layout_of(model)
    pool = BlockPool(layout, num_blocks=2, device="cpu")
    model.set_attn_implementation(attention.register())
    with torch.inference_mode():
        sa = pool.new_sequence()
        model(a[None], past_key_values=attention.PagedCache(pool, [sa]))
        sa.release()
        sb = pool.new_sequence()
        cache = attention.PagedCache(pool, [sb])
        model.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="needs attn_implementation"):
            model(b[None], past_key_values=cache)
        assert sb.length == 0 and cache.get_seq_length() == 0
        with kvstore.open(tmp_path / "s", layout=layout, model="tiny-llama@0") as store:
            assert pool.save(store, sb, b) == 0
            model.set_attn_implementation(attention.register())
            model(b[None], past_key_values=cache)
            assert sb.length == 16
            assert pool.save(store, sb, b) == 16
            model.set_attn_implementation("eager")
            want = cache_kv(model(b[None], use_cache=True).past_key_values)
            got = store.get(b, like=want)
    torch.testing.assert_close(got, want, atol=LOGIT_TOL, rtol=LOGIT_TOL)
    sb.release()


def test_kv_in_another_dtype_than_the_pool_raises(model):
    """The cache cast the model's K/V to the pool's dtype: float32 values past float16's
    range were stored as inf. Now as store.put: another dtype raises."""
    layout = kvstore.Layout(2, 2, 32, "float16", 8)
    pool = BlockPool(layout, num_blocks=2, device="cpu")
    seq = pool.new_sequence()
    cache = attention.PagedCache(pool, [seq])
    k = torch.full((1, 2, 1, 32), 70000.0)
    with pytest.raises(kvstore.InvalidInput, match="pool's dtype"):
        cache.write(0, k, k)
    assert seq.length == 0
    seq.release()
