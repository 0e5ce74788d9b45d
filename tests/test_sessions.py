"""Sessions (README, Quick start and transformers): a name bound to a
conversation's tokens. Conversations that share a system prompt store its blocks
once, however many sessions there are, and each restores its own KV
(hf.save_session / hf.load_session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from support.hf_models import greedy, prompt, tiny_llama  # noqa: E402

import kvstore  # noqa: E402
from kvstore import hf  # noqa: E402

B = 16
SYSTEM = 128  # tokens: 8 full blocks


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_llama("float32")


def conversation(turn_tokens: int, seed: int) -> torch.Tensor:
    return torch.cat([prompt(SYSTEM, seed=100), prompt(turn_tokens, seed=seed)], dim=1)


def prefill(model: Any, ids: torch.Tensor) -> Any:
    with torch.inference_mode():
        return model(ids, use_cache=True).past_key_values


def test_two_sessions_share_the_system_prompt_and_both_restore(tmp_path: Path, model: Any) -> None:
    a, b = conversation(40, seed=1), conversation(57, seed=2)
    cache_a, cache_b = prefill(model, a), prefill(model, b)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="batch") as store:
        assert hf.save_session(store, "alice", a, cache_a) == 160
        assert store.stats()["blocks"] == 10
        assert hf.save_session(store, "bob", b, cache_b) == 176
        # 8 system-prompt blocks once, then 2 of alice's and 3 of bob's.
        st = store.stats()
        assert st["blocks"] == 8 + 2 + 3, st
        assert sorted(store.sessions()) == ["alice", "bob"]
        assert store.session_sizes() == {"alice": 168, "bob": 185}

    with hf.open(tmp_path / "s", model, fingerprint="t", durability="batch") as store:
        for name, ids, cache in (("alice", a, cache_a), ("bob", b, cache_b)):
            got_ids, restored, n = hf.load_session(store, name, config=model.config)
            assert torch.equal(got_ids, ids), name
            assert n == ids.shape[1] // B * B == restored.get_seq_length()
            for got, want in zip(restored.layers, cache.layers, strict=True):
                assert torch.equal(got.keys, want.keys[:, :, :n]), name
                assert torch.equal(got.values, want.values[:, :, :n]), name
            # Resume: prefill the session's tail on the restored KV, then decode.
            with torch.inference_mode():
                out = model.generate(
                    got_ids,
                    attention_mask=torch.ones_like(got_ids),
                    past_key_values=restored,
                    max_new_tokens=16,
                    min_new_tokens=16,
                    do_sample=False,
                )
            assert torch.equal(out[0, ids.shape[1] :], greedy(model, ids, 16)), name

        # Forgetting a session forgets the name; the blocks stay (they are shared).
        assert store.delete_session("alice") is True
        assert store.delete_session("alice") is False
        assert store.sessions() == ["bob"]
        assert store.stats()["blocks"] == 13
        assert hf.load_session(store, "bob")[2] == 176
        with pytest.raises(kvstore.SessionNotFound):
            hf.load_session(store, "alice")
        with pytest.raises(KeyError):
            hf.load_session(store, "alice")


def test_many_sessions_store_the_system_prompt_once(tmp_path: Path, model: Any) -> None:
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        for i in range(6):
            ids = conversation(16, seed=10 + i)  # each adds exactly one block
            hf.save_session(store, f"agent-{i}", ids, prefill(model, ids))
        assert store.stats()["blocks"] == 8 + 6
        assert len(store.sessions()) == 6


def test_session_saved_again_moves_on(tmp_path: Path, model: Any) -> None:
    turn1 = conversation(20, seed=3)
    turn2 = torch.cat([turn1, prompt(30, seed=4)], dim=1)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        hf.save_session(store, "agent", turn1, prefill(model, turn1))
        hf.save_session(store, "agent", turn2, prefill(model, turn2))
        ids, cache, n = hf.load_session(store, "agent")
        assert torch.equal(ids, turn2) and n == 176 == cache.get_seq_length()
        assert store.sessions() == ["agent"]


def test_session_shorter_than_a_block(tmp_path: Path, model: Any) -> None:
    ids = prompt(10, seed=5)
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        assert hf.save_session(store, "short", ids, prefill(model, ids)) == 0
        got, cache, n = hf.load_session(store, "short")
        assert torch.equal(got, ids) and n == 0 and cache.get_seq_length() == 0
        assert store.stats()["blocks"] == 0


def test_session_needs_the_kv_of_every_full_block(tmp_path: Path, model: Any) -> None:
    """After generate() a cache lacks the last token; when that token completes a
    block, the session cannot be stored until the cache holds it."""
    ids = conversation(32, seed=7)  # 160 tokens: 10 full blocks
    cache = prefill(model, ids[:, :-1])
    with hf.open(tmp_path / "s", model, fingerprint="t", durability="none") as store:
        with pytest.raises(kvstore.InvalidInput, match="first 160 .* holds 159"):
            hf.save_session(store, "agent", ids, cache)
        assert store.sessions() == [] and store.stats()["blocks"] == 0
        with torch.inference_mode():
            model(ids[:, -1:], past_key_values=cache, use_cache=True)
        assert hf.save_session(store, "agent", ids, cache) == 160
