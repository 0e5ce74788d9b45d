"""kvstore.hf (README, transformers): layout_of, fingerprint, save/load of
transformers caches, and generate.

The headline test restarts: a child process rebuilds the model, restores the KV
from the store and must produce next-token logits bitwise equal to those of the
in-memory cache the parent saved, and the greedy continuation of recomputing
the whole prompt (float32 and bfloat16)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import run_child  # noqa: E402
from support.hf_models import greedy, prompt, tiny_llama, tiny_llava  # noqa: E402
from transformers import DynamicCache, LlamaConfig  # noqa: E402

import kvstore  # noqa: E402
from kvstore import hf  # noqa: E402

B = 16


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama("float32")


def prefill(model: Any, ids: torch.Tensor) -> DynamicCache:
    with torch.inference_mode():
        return model(ids, use_cache=True).past_key_values


def cropped(cache: DynamicCache, n: int) -> DynamicCache:
    """A copy of the first n tokens of `cache` (the in-memory reference)."""
    c = copy.deepcopy(cache)
    c.crop(n - c.get_seq_length())
    return c


def next_logits(model: Any, rest: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    with torch.inference_mode():
        return model(rest, past_key_values=cache, use_cache=True).logits


# ----------------------------------------------------------------------- layout, fingerprint


def test_layout_of_model_and_config(model: Any) -> None:
    assert hf.layout_of(model) == kvstore.Layout(4, 2, 64, "float32", 16)
    assert hf.layout_of(model.config, block_size=8).block_size == 8
    cfg = LlamaConfig(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=None, num_hidden_layers=3
    )
    cfg.dtype = torch.bfloat16
    assert hf.layout_of(cfg) == kvstore.Layout(3, 8, 64, "bfloat16", 16)
    cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=32, dtype="float16"
    )
    assert hf.layout_of(cfg) == kvstore.Layout(cfg.num_hidden_layers, 1, 32, "float16", 16)
    with pytest.raises(kvstore.InvalidInput, match="transformers decoder"):
        hf.layout_of(object())


def test_fingerprint_is_a_function_of_config_and_weights(model: Any) -> None:
    fp = hf.fingerprint(model)
    assert fp.startswith("llama@sha256:") and len(fp) == len("llama@sha256:") + 64
    assert hf.fingerprint(tiny_llama("float32")) == fp, "same seed, same weights"
    assert hf.fingerprint(model, name="org/tiny@rev") == "org/tiny@rev@sha256:" + fp[-64:]
    assert hf.fingerprint(tiny_llama("float32", seed=1)) != fp
    assert hf.fingerprint(tiny_llama("bfloat16")) != fp
    nudged = tiny_llama("float32")
    with torch.no_grad():
        w = nudged.model.layers[3].mlp.down_proj.weight
        w.view(torch.int32)[7, 7] += 1  # one ulp of one weight
    assert hf.fingerprint(nudged) != fp
    other = tiny_llama("float32")
    other.config.rope_parameters = {"rope_theta": 500000.0, "rope_type": "default"}
    assert hf.fingerprint(other) != fp, "the config is part of the model"
    with pytest.raises(kvstore.InvalidInput, match="transformers model"):
        hf.fingerprint(object())


def test_fingerprint_of_tied_weights_hashes_them_once() -> None:
    from transformers import LlamaForCausalLM

    cfg = tiny_llama().config
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg)
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()
    torch.manual_seed(0)
    assert hf.fingerprint(a) == hf.fingerprint(LlamaForCausalLM(cfg))


def test_open_binds_layout_and_fingerprint(tmp_path: Path, model: Any) -> None:
    with hf.open(tmp_path / "s", model, durability="none") as store:
        assert store.layout == hf.layout_of(model)
        assert store.model == hf.fingerprint(model)
    with pytest.raises(kvstore.LayoutMismatch):
        hf.open(tmp_path / "s", tiny_llama("float32", seed=5))
    with hf.open(tmp_path / "t", model, fingerprint="mine@1", block_size=8) as store:
        assert store.model == "mine@1" and store.layout.block_size == 8


# ----------------------------------------------------------------------------- save / load


def test_save_load_round_trip_is_bitwise(tmp_path: Path, model: Any) -> None:
    ids = prompt(70)
    cache = prefill(model, ids)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        assert hf.save(store, ids, cache) == 64  # full blocks only
        assert hf.save(store, ids[0].tolist(), cache) == 64  # a list works; nothing new
        assert store.stats()["blocks"] == 4
        restored, n = hf.load(store, ids, config=model.config)
        assert n == 64 and restored.get_seq_length() == 64
        for got, want in zip(restored.layers, cache.layers, strict=True):
            assert torch.equal(got.keys, want.keys[:, :, :64])
            assert torch.equal(got.values, want.values[:, :, :64])
            assert got.keys.shape == (1, 2, 64, 64)
        assert hf.load(store, ids[:, :40])[1] == 32
        assert hf.load(store, ids, max_tokens=50)[1] == 48
        empty, n = hf.load(store, prompt(70, seed=9), config=model.config)
        assert n == 0 and empty.get_seq_length() == 0
        # An empty cache is a valid starting point: the model prefills everything.
        want = next_logits(model, ids, DynamicCache())
        assert torch.equal(next_logits(model, ids, empty), want)


def test_load_into_a_reused_buffer(tmp_path: Path, model: Any) -> None:
    ids = prompt(70)
    cache = prefill(model, ids)
    want = next_logits(model, ids[:, 64:], cropped(cache, 64))
    buf = torch.empty(hf.layout_of(model).kv_shape(80))
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        hf.save(store, ids, cache)
        for _ in range(2):  # the forward replaces the views, so buf is free again after it
            restored, n = hf.load(store, ids, out=buf)
            assert n == 64 and restored.layers[0].keys.data_ptr() == buf.data_ptr()
            assert torch.equal(next_logits(model, ids[:, 64:], restored), want)
            assert restored.layers[0].keys.data_ptr() != buf.data_ptr()
        assert hf.load(store, ids, out=buf[:, :, :40].contiguous())[1] == 32  # at most T tokens
        with pytest.raises(kvstore.InvalidInput, match="dtype"):
            hf.load(store, ids, out=buf.half())
        with pytest.raises(kvstore.InvalidInput, match="out"):
            hf.load(store, ids, out=buf[0])


def _state(obj: Any) -> dict[str, Any]:
    """A cache's or a layer's attributes but its tensors."""
    return {k: v for k, v in vars(obj).items() if k not in ("keys", "values", "layers")}


def test_kv_to_cache_builds_what_transformers_builds_for_the_config(model: Any) -> None:
    ids = prompt(70)
    kv = hf.cache_to_kv(prefill(model, ids), 64)
    for _ in range(2):  # the second call takes the layer types remembered for the config
        # The reference: transformers' own cache for the config, filled by its update
        # (copies), as a model would (a forward extends both caches: new ones each time).
        want = DynamicCache(config=model.config)
        for i in range(kv.shape[0]):
            want.update(*(kv[i, j].transpose(0, 1)[None].contiguous() for j in (0, 1)), i)
        got = hf.kv_to_cache(kv, config=model.config)
        assert _state(got) == _state(want)
        for g, w in zip(got.layers, want.layers, strict=True):
            assert type(g) is type(w) and _state(g) == _state(w)
            assert torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
            # views of kv, not copies
            assert g.keys.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
        rest = ids[:, 64:]
        assert torch.equal(next_logits(model, rest, got), next_logits(model, rest, want))
    # No tokens (a miss): the config's cache, empty.
    empty, fresh = (
        hf.kv_to_cache(kv[:, :, :0], config=model.config),
        DynamicCache(config=model.config),
    )
    assert _state(empty) == _state(fresh)
    assert [(type(x), _state(x)) for x in empty.layers] == [
        (type(x), _state(x)) for x in fresh.layers
    ]


def test_kv_to_cache_follows_a_config_changed_in_place(model: Any) -> None:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    config = copy.deepcopy(model.config)
    kv = torch.randn(hf.layout_of(config).kv_shape(32))
    assert all(type(x) is DynamicLayer for x in hf.kv_to_cache(kv, config=config).layers)
    config.sliding_window = 8
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    assert all(type(x) is DynamicLayer for x in hf.kv_to_cache(kv, config=config).layers)
    config.layer_types[1] = "sliding_attention"  # the same list, changed in place
    got = hf.kv_to_cache(kv, config=config).layers
    want = DynamicCache(config=config).layers
    assert [type(x) for x in got] == [type(x) for x in want]
    assert type(got[1]) is DynamicSlidingWindowLayer and type(got[0]) is DynamicLayer
    assert torch.equal(got[0].keys[0].transpose(0, 1), kv[0, 0])


def test_save_covers_only_what_the_cache_holds(tmp_path: Path, model: Any) -> None:
    ids = prompt(100)
    cache = prefill(model, ids[:, :40])
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        assert hf.save(store, ids, cache) == 32
        assert hf.save(store, ids, DynamicCache()) == 0
        assert store.lookup(ids[0]) == 32


def test_static_cache_can_be_saved(tmp_path: Path, model: Any) -> None:
    from transformers import StaticCache

    ids = prompt(40)
    static = StaticCache(config=model.config, max_cache_len=64)
    with torch.inference_mode():
        model(ids, past_key_values=static, use_cache=True)
    dynamic = prefill(model, ids)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        assert hf.save(store, ids, static) == 32
        restored, n = hf.load(store, ids)
        assert n == 32
        assert torch.equal(restored.layers[2].values, dynamic.layers[2].values[:, :, :32])


def test_sliding_window_layers_are_refused(tmp_path: Path, model: Any) -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    ids = prompt(40)
    cache = prefill(model, ids)
    cache.layers[1] = DynamicSlidingWindowLayer(sliding_window=8)
    with (
        hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store,
        pytest.raises(kvstore.InvalidInput, match="layer 1 is a DynamicSlidingWindowLayer"),
    ):
        hf.save(store, ids, cache)


def test_caches_that_hold_no_plain_prefix_are_refused(tmp_path: Path, model: Any) -> None:
    """A legacy tuple of a sliding-window cache (its keys are the window's, the last
    tokens'), and any layer other than DynamicLayer / StaticLayer (an indexed layer
    adds keys of its own), are refused: before, the tuple stored the last tokens' KV
    under the first tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.cache_utils import DynamicIndexedLayer

    config = Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, use_sliding_window=True, sliding_window=40,
        max_window_layers=0, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    sliding = Qwen2ForCausalLM(config).eval()
    ids = prompt(100) % 1000
    legacy = tuple(prefill(sliding, ids))
    assert len(legacy[0]) == 3 and legacy[0][0].shape[-2] < 100  # (keys, values, window)
    cache = prefill(model, prompt(40))
    cache.layers[2] = DynamicIndexedLayer()
    with hf.open(tmp_path / "s", sliding, fingerprint="t", durability="none") as store:
        with pytest.raises(kvstore.InvalidInput, match="layer 0 of the tuple is a sliding"):
            hf.save(store, ids, legacy)
        assert store.stats()["blocks"] == 0
    with (
        hf.open(tmp_path / "m", model, fingerprint="t", durability="none") as store,
        pytest.raises(kvstore.InvalidInput, match="layer 2 is a DynamicIndexedLayer"),
    ):
        hf.save(store, prompt(40), cache)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rope_scaled_by_the_sequence_length_is_refused(
    tmp_path: Path, model: Any, rope_type: str
) -> None:
    """Dynamic NTK and LongRoPE rescale every position once the sequence passes the
    trained length, so a prefix's KV depends on what follows it: such a model is
    refused by layout_of, hf.open and generate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 10000.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 16, long_factor=[4.0] * 16,
                      original_max_position_embeddings=32)  # fmt: skip
    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=32,
        rope_parameters=params,
    )  # fmt: skip
    scaled = LlamaForCausalLM(config).eval()
    match = f"rope_type '{rope_type}'"
    with pytest.raises(kvstore.InvalidInput, match=match):
        hf.layout_of(config)
    with pytest.raises(kvstore.InvalidInput, match=match):
        hf.open(tmp_path / "s", scaled, fingerprint="t")
    with (
        hf.open(tmp_path / "m", model, fingerprint="t", durability="none") as store,
        pytest.raises(kvstore.InvalidInput, match=match),
    ):
        hf.generate(scaled, store, prompt(40) % 1000, max_new_tokens=2)


def test_generate_refuses_padding_positions_and_caches_before_generating(
    tmp_path: Path, model: Any
) -> None:
    """A padded mask or given positions would store KV of other positions under the
    plain tokens; a model whose cache has sliding layers cannot be saved: each is
    refused before anything is generated."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    ids = prompt(40)
    padded = torch.ones_like(ids)
    padded[0, :4] = 0

    class Counting:  # the model, counting generate calls
        def __init__(self, m: Any) -> None:
            self.m, self.calls = m, 0

        def __getattr__(self, k: str) -> Any:
            return getattr(self.m, k)

        def generate(self, *a: Any, **kw: Any) -> Any:
            self.calls += 1
            return self.m.generate(*a, **kw)

    config = Qwen2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, use_sliding_window=True, sliding_window=8,
        max_window_layers=0, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    sliding = Counting(Qwen2ForCausalLM(config).eval())
    m = Counting(model)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        for kw, match in (
            ({"attention_mask": padded}, "all ones"),
            ({"position_ids": torch.arange(40)[None]}, "position_ids"),
            ({"cache_position": torch.arange(40)}, "cache_position"),
            ({"cache": None}, "cache"),
            ({"past_key_values": None}, "past_key_values"),
        ):
            with pytest.raises(kvstore.InvalidInput, match=match):
                hf.generate(m, store, ids, max_new_tokens=2, **kw)
        # A store of another model's layout is refused too (its KV is no KV of this one).
        with pytest.raises(kvstore.InvalidInput, match="layout"):
            hf.generate(sliding, store, ids % 1000, max_new_tokens=2, save=False)
        with hf.open(tmp_path / "w", sliding.m, fingerprint="w", durability="none") as own:
            with pytest.raises(kvstore.InvalidInput, match="save=False"):
                hf.generate(sliding, own, ids % 1000, max_new_tokens=2)
            assert m.calls == 0 and sliding.calls == 0
            out = hf.generate(sliding, own, ids % 1000, max_new_tokens=2, save=False)
        assert out.shape == (1, 42) and sliding.calls == 1
        # An all-ones mask is what generate passes anyway.
        out = hf.generate(m, store, ids, max_new_tokens=2, attention_mask=torch.ones_like(ids))
        assert m.calls == 1 and store.stats()["blocks"] > 0


def test_bad_input_raises_and_writes_nothing(tmp_path: Path, model: Any) -> None:
    ids = prompt(40)
    cache = prefill(model, ids)
    batch = torch.cat([ids, ids])
    cache2 = prefill(model, batch)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        for call in (
            lambda: hf.save(store, batch, cache),
            lambda: hf.save(store, ids, cache2),
            lambda: hf.load(store, batch),
            lambda: hf.generate(model, store, batch, max_new_tokens=2),
            lambda: hf.save_session(store, "x", batch, cache),
        ):
            with pytest.raises(kvstore.InvalidInput, match="batch size 1"):
                call()
        with pytest.raises(kvstore.InvalidInput, match="integer token ids"):
            hf.save(store, ids.float(), cache)
        with pytest.raises(kvstore.InvalidInput, match="transformers Cache"):
            hf.save(store, ids, "not a cache")
        with pytest.raises(kvstore.InvalidInput, match="dtype torch.float32, got torch.bfloat16"):
            hf.save(store, ids, prefill(tiny_llama("bfloat16"), ids))
        with pytest.raises(kvstore.InvalidInput, match="expected 4 layers"):
            hf.save(store, ids, prefill(tiny_llama("float32", layers=2), ids))
        assert store.stats()["blocks"] == 0 and store.sessions() == []


# -------------------------------------------------------------------------------- generate


def test_generate_restores_prefills_the_rest_and_saves(tmp_path: Path, model: Any) -> None:
    ids = prompt(100)
    want = greedy(model, ids, 8)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        info: dict[str, int] = {}
        kw: dict[str, Any] = {"max_new_tokens": 8, "min_new_tokens": 8, "stats": info}
        out = hf.generate(model, store, ids, **kw)
        assert torch.equal(out[0, 100:], want)
        # cache: prompt + 7 generated tokens (the last one is never fed back)
        assert info == {"restored_tokens": 0, "prefilled_tokens": 100, "stored_tokens": 96}
        out2 = hf.generate(model, store, ids, **kw)
        assert torch.equal(out2, out)
        assert info == {"restored_tokens": 96, "prefilled_tokens": 4, "stored_tokens": 96}
        # A block-aligned prompt, all stored: the last block is prefilled again.
        out3 = hf.generate(model, store, ids[:, :96], **kw)
        assert info["restored_tokens"] == 80 and info["prefilled_tokens"] == 16
        assert torch.equal(out3[0, 96:], greedy(model, ids[:, :96], 8))
        # The next turn starts from the generated blocks of this one.
        turn = torch.cat([out, prompt(20, seed=4)], dim=1)
        out4 = hf.generate(model, store, turn, save=False, **kw)
        assert info["restored_tokens"] == 96
        assert torch.equal(out4[0, 128:], greedy(model, turn, 8))
        # Generated tokens that fill a block past the prompt's last one are stored too.
        short = prompt(90, seed=5)
        out5 = hf.generate(model, store, short, **kw)
        assert info["stored_tokens"] == 96 and store.lookup(out5[0]) == 96
        # Beam search expands the cache to several rows: the prompt's blocks are kept.
        fresh = prompt(50, seed=6)
        hf.generate(model, store, fresh, num_beams=2, **kw)
        assert store.lookup(fresh[0]) == 48 and info["stored_tokens"] == 48
        with pytest.raises(kvstore.InvalidInput, match="past_key_values"):
            hf.generate(model, store, ids, past_key_values=DynamicCache())


# ---------------------------------------------------------- restart (README, transformers)

RESTORE = """
import sys
import torch
from support.hf_models import tiny_llama
from kvstore import hf

root = sys.argv[1]
for dtype in ("float32", "bfloat16"):
    ref = torch.load(f"{root}/ref-{dtype}.pt")
    model = tiny_llama(dtype)
    assert hf.fingerprint(model) == ref["fingerprint"], "the child built another model"
    ids = ref["ids"]
    with hf.open(f"{root}/store-{dtype}", model, create=False) as store:
        cache, n = hf.load(store, ids, config=model.config)
        with torch.inference_mode():
            logits = model(ids[:, n:], past_key_values=cache, use_cache=True).logits
        out = hf.generate(
            model, store, ids, save=False, max_new_tokens=32, min_new_tokens=32, do_sample=False
        )
        sess_ids, sess_cache, sess_n = hf.load_session(store, "conv", config=model.config)
        with torch.inference_mode():
            sess_logits = model(
                sess_ids[:, sess_n:], past_key_values=sess_cache, use_cache=True
            ).logits
        st = store.stats()
    torch.save(
        {
            "n": n,
            "logits": logits,
            "greedy": out[0, ids.shape[1]:],
            "session_ids": sess_ids,
            "session_logits": sess_logits,
            "hit_blocks": st["hit_blocks"],
        },
        f"{root}/got-{dtype}.pt",
    )
"""


def test_restart_gives_bitwise_logits_and_the_recomputed_greedy_continuation(
    tmp_path: Path,
) -> None:
    n_prompt = 200  # 12 full blocks + 8 tokens to prefill
    n_stored = n_prompt // B * B
    for dtype in ("float32", "bfloat16"):
        model = tiny_llama(dtype)
        ids = prompt(n_prompt, seed=2)
        cache = prefill(model, ids)
        with hf.open(tmp_path / f"store-{dtype}", model, durability="batch") as store:
            assert hf.save(store, ids, cache) == n_stored
            assert hf.save_session(store, "conv", ids, cache) == n_stored
            store.flush()
        ref = {
            "fingerprint": hf.fingerprint(model),
            "ids": ids,
            # The in-memory cache the store was fed, cut to what it holds, then the rest.
            "logits": next_logits(model, ids[:, n_stored:], cropped(cache, n_stored)),
            "greedy": greedy(model, ids, 32),
        }
        torch.save(ref, tmp_path / f"ref-{dtype}.pt")

    run_child(RESTORE, tmp_path, timeout=300)

    for dtype in ("float32", "bfloat16"):
        ref = torch.load(tmp_path / f"ref-{dtype}.pt")
        got = torch.load(tmp_path / f"got-{dtype}.pt")
        assert got["n"] == n_stored and got["hit_blocks"] > 0
        assert got["logits"].dtype == getattr(torch, dtype)
        assert torch.equal(got["logits"], ref["logits"]), f"{dtype}: logits differ bitwise"
        assert torch.equal(got["session_ids"], ref["ids"])
        assert torch.equal(got["session_logits"], ref["logits"]), f"{dtype}: session logits"
        # Restored prefix + prefill of the rest vs recomputing the whole prompt: the
        # same tokens. (On this CPU build the logits are even bitwise equal; only
        # the tokens are promised, since other kernels may sum in another order.)
        assert torch.equal(got["greedy"], ref["greedy"]), (
            f"{dtype}: greedy continuation differs: {got['greedy'].tolist()} "
            f"!= {ref['greedy'].tolist()}"
        )
        assert len(set(ref["greedy"].tolist())) > 4, "a degenerate continuation proves little"


def test_import_kvstore_hf_stays_light() -> None:
    code = (
        "import sys, kvstore, kvstore.hf; "
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_allocates_for_what_is_stored_not_what_is_asked(tmp_path: Path, model: Any) -> None:
    """A long request with a short stored prefix keeps (and faults in) only the
    prefix's KV: 64K tokens asked of this model would be 256 MiB."""
    ids = prompt(64)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        hf.save(store, ids, prefill(model, ids))
        asked = torch.cat([ids[0], torch.randint(3, 999, (65536,))])
        cache, n = hf.load(store, asked)
        assert n == 64
        assert cache.layers[0].keys.untyped_storage().nbytes() <= 4 << 20
        _, n = hf.load(store, torch.randint(3, 999, (65536,)))
        assert n == 0


def test_a_store_of_another_layout_is_refused(tmp_path: Path, model: Any) -> None:
    ids = prompt(40)
    other = tiny_llama(layers=2)
    with hf.open(tmp_path / "s", other, fingerprint="o", durability="none") as store:
        hf.save(store, ids, prefill(other, ids))
        with pytest.raises(kvstore.InvalidInput, match="layers"):
            hf.load(store, ids, config=model.config)
        with pytest.raises(kvstore.InvalidInput, match="layout"):
            hf.generate(model, store, ids, max_new_tokens=2)
    # The same shape in another dtype: generate knows the model's dtype.
    with hf.open(tmp_path / "b", model.to(torch.bfloat16), fingerprint="b") as store:
        model.to(torch.float32)
        with pytest.raises(kvstore.InvalidInput, match="layout"):
            hf.generate(model, store, ids, max_new_tokens=2)


def test_bad_caches_and_arguments_raise_invalid_input(tmp_path: Path, model: Any) -> None:
    ids = prompt(40)
    cache = prefill(model, ids)
    k, v = cache.layers[0].keys, cache.layers[0].values
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        for bad in (((k.numpy(), v.numpy()),) * 4, [[1, 2], [3, 4]]):
            with pytest.raises(kvstore.InvalidInput, match="torch tensors"):
                hf.save(store, ids, bad)
        with pytest.raises(kvstore.InvalidInput, match="max_tokens"):
            hf.load(store, ids, max_tokens=20.0)  # type: ignore[arg-type]
        with pytest.raises(kvstore.InvalidInput, match="config"):
            hf.load(store, ids, config=object())
        # V shorter than K: only what both hold is stored.
        short = DynamicCache()
        for i, layer in enumerate(cache.layers):
            short.update(layer.keys, layer.values[:, :, :30] if i == 0 else layer.values, i)
        assert hf.save(store, ids, short) == 16
        # A model passed as the config is read as its config.
        _, n = hf.load(store, ids, config=model)
        assert n == 16


def test_generate_with_a_generation_config_that_asks_for_its_own_cache(
    tmp_path: Path, model: Any
) -> None:
    ids = prompt(40)
    m = copy.deepcopy(model)
    m.generation_config.cache_implementation = "static"
    want = greedy(model, ids, 4)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        for _ in range(2):
            st: dict[str, int] = {}
            with torch.inference_mode():
                out = hf.generate(m, store, ids, max_new_tokens=4, stats=st)
            assert torch.equal(out[0, 40:], want)
        assert st["restored_tokens"] == 32
        with pytest.raises(kvstore.InvalidInput, match="cache_implementation"):
            hf.generate(m, store, ids, max_new_tokens=4, cache_implementation="static")


def test_kv_beside_an_image_is_never_served_for_another_image(tmp_path: Path) -> None:
    """Block ids name token ids only, and an image's placeholder tokens are the same
    for every image: nothing from the first placeholder on is restored, nor stored
    without an `extra` naming the image. Outputs equal plain generate's."""
    model = tiny_llava(image_token=999)
    text = torch.arange(10, 30)
    ids = torch.cat([text, torch.full((16,), 999), torch.arange(40, 64)])[None]
    img_a, img_b = torch.randn(1, 3, 32, 32), 3 * torch.randn(1, 3, 32, 32)

    def plain(img: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                ids, attention_mask=torch.ones_like(ids), pixel_values=img, max_new_tokens=6
            )

    with hf.open(tmp_path / "s", model, fingerprint="llava", durability="none") as store:
        for img, restored in ((img_a, 0), (img_b, 16), (img_a, 16)):
            st: dict[str, int] = {}
            with torch.inference_mode():
                out = hf.generate(model, store, ids, pixel_values=img, max_new_tokens=6, stats=st)
            assert torch.equal(out, plain(img))
            assert st["restored_tokens"] == restored and st["stored_tokens"] == 16
        # Saved by hand past the image: load with the model's config stops before it.
        with torch.inference_mode():
            cache = model(input_ids=ids, pixel_values=img_a).past_key_values
        assert hf.save(store, ids, cache) == 48
        _, n = hf.load(store, ids, config=model.config)
        assert n == 16
        # With an extra naming the image, its blocks are stored under it.
        st = {}
        with torch.inference_mode():
            out = hf.generate(
                model, store, ids, pixel_values=img_b, max_new_tokens=6, stats=st, extra="b"
            )
        assert torch.equal(out, plain(img_b)) and st["stored_tokens"] == 64
        assert store.lookup(out[0], extra="b") == 64
        _, n = hf.load(store, ids, config=model.config, extra="b")
        assert n == 48
        # A composite config that keeps the placeholder in a sub-config (Phi-4-multimodal's
        # vision_config.image_token_id), and one of a model that takes images without
        # naming a placeholder (BLIP-2 without image_token_index): nothing past, or nothing.
        nested = copy.deepcopy(model.config)
        nested.image_token_id = None
        nested.vision_config.image_token_id = 999
        _, n = hf.load(store, ids, config=nested)
        assert n == 16
        from transformers import Blip2Config

        _, n = hf.load(store, ids, config=Blip2Config())
        assert n == 0


def test_layout_of_falcon_and_gpt_bigcode_multi_query() -> None:
    from transformers import FalconConfig, FalconForCausalLM, GPTBigCodeConfig

    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    assert hf.layout_of(FalconConfig(**small)).num_kv_heads == 1
    grouped = FalconConfig(**small, new_decoder_architecture=True, num_kv_heads=2)
    assert hf.layout_of(grouped).num_kv_heads == 2
    assert hf.layout_of(GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4)).num_kv_heads == 1
    # What the model's cache holds.
    falcon = FalconForCausalLM(FalconConfig(**small, vocab_size=100)).eval()
    with torch.inference_mode():
        cache = falcon(torch.arange(20)[None], use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[1] == hf.layout_of(falcon).num_kv_heads
