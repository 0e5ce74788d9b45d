"""Model fingerprints from checkpoint files (kvstore.fingerprint, `kvstore fingerprint`,
`kvstore.hf.fingerprint`): a function of config.json and the weight files' bytes,
never of where they are; hub cache snapshots by their blob names, unread; the
memo of file hashes and when it is trusted; and a store of the first scheme
refused with what to do."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from support.hf_models import tiny_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import kvstore  # noqa: E402
from kvstore import _lib, cli, hf  # noqa: E402
from kvstore import fingerprint as kfp  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The memo's default place, in this test's directory rather than ~/.cache."""
    d = tmp_path / "user-cache"
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved by transformers: config.json + model.safetensors."""
    d = tmp_path_factory.mktemp("ckpt") / "tiny"
    tiny_llama("bfloat16", layers=2).save_pretrained(d)
    assert (d / "model.safetensors").is_file()
    return d


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The files `_lib.blake3_file` reads, in order."""
    calls: list[str] = []
    real = _lib.blake3_file

    def counting(path: str, threads: int | None = None) -> str:
        calls.append(os.fspath(path))
        return real(path, threads)

    monkeypatch.setattr(_lib, "blake3_file", counting)
    return calls


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def bump_one_element(path: Path, tensor: str | None = None) -> str:
    """Adds 1 to the low byte of one element of one tensor of a safetensors file;
    returns the tensor's name."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = tensor or sorted(k for k in header if k != "__metadata__")[0]
    start = 8 + n + header[name]["data_offsets"][0]
    data[start + 6] = (data[start + 6] + 1) % 256
    path.write_bytes(bytes(data))
    return name


def make_hub(hub: Path, src: Path, repo: str = "org/tiny", blob_names: bool = True) -> Path:
    """`src`'s files as huggingface_hub lays out a download of `repo` at COMMIT (the
    "main" ref): blobs named by their SHA-256 (or, with `blob_names` False, by a
    made-up hex that no content has), snapshot entries symlinked to them."""
    org, name = repo.split("/")
    root = hub / f"models--{org}--{name}"
    snap = root / "snapshots" / COMMIT
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for i, f in enumerate(sorted(src.iterdir())):
        digest = hashlib.sha256(f.read_bytes()).hexdigest() if blob_names else f"{i:064x}"
        shutil.copyfile(f, root / "blobs" / digest)
        (snap / f.name).symlink_to(f"../../blobs/{digest}")
    return snap


# ------------------------------------------------------------------- what it is a function of


def test_equal_checkpoints_in_two_directories_have_one_fingerprint(
    tmp_path: Path, checkpoint: Path
) -> None:
    fp = kfp.checkpoint_fingerprint(checkpoint)
    prefix, digest = fp.split("@ckpt-v1:")
    assert prefix == "llama" and len(digest) == 64 and int(digest, 16) >= 0
    assert kfp.checkpoint_fingerprint(copy(checkpoint, tmp_path / "elsewhere")) == fp
    assert kvstore.checkpoint_fingerprint(checkpoint, name="org/tiny@v1") == (
        "org/tiny@v1@ckpt-v1:" + digest
    )
    c = kfp.read_checkpoint(checkpoint)
    assert c.fingerprint == fp and c.root == checkpoint
    size = (checkpoint / "model.safetensors").stat().st_size
    expected = "blake3:" + _lib.blake3_file(checkpoint / "model.safetensors")
    assert c.weights == (kfp.WeightFile("model.safetensors", size, expected),)


def test_one_changed_element_of_one_tensor_changes_it(tmp_path: Path, checkpoint: Path) -> None:
    other = copy(checkpoint, tmp_path / "nudged")
    bump_one_element(other / "model.safetensors")
    assert kfp.checkpoint_fingerprint(other) != kfp.checkpoint_fingerprint(checkpoint)


def test_the_config_is_part_of_it_where_it_is_saved_is_not(
    tmp_path: Path, checkpoint: Path
) -> None:
    fp = kfp.checkpoint_fingerprint(checkpoint)
    other = copy(checkpoint, tmp_path / "other")
    config = json.loads((checkpoint / "config.json").read_text())
    # Saved by another transformers, from another path, keys in another order and
    # indented otherwise: the same config.
    resaved = {
        **dict(reversed(list(config.items()))),
        "transformers_version": "9.9.9",
        "_name_or_path": "/somewhere/else",
    }
    (other / "config.json").write_text(json.dumps(resaved))
    assert kfp.checkpoint_fingerprint(other) == fp
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert kfp.checkpoint_fingerprint(other) != fp


def test_sharded_is_another_checkpoint_and_its_index_names_its_files(
    tmp_path: Path, checkpoint: Path
) -> None:
    """The files are the identity: the same tensors saved in shards give another
    fingerprint (no block sharing with the single file, never wrong blocks). The
    shard index says which files count, so a stray safetensors file beside them
    changes nothing; a shard it names that is missing is an error."""
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="1MB")
    c = kfp.read_checkpoint(sharded)
    assert len(c.weights) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert c.fingerprint != kfp.checkpoint_fingerprint(checkpoint)
    shutil.copyfile(checkpoint / "model.safetensors", sharded / "consolidated.safetensors")
    assert kfp.checkpoint_fingerprint(sharded) == c.fingerprint
    (sharded / c.weights[-1].name).unlink()
    with pytest.raises(kvstore.InvalidInput, match=c.weights[-1].name):
        kfp.checkpoint_fingerprint(sharded)


def test_what_is_not_a_checkpoint_is_invalid_input(tmp_path: Path, checkpoint: Path) -> None:
    with pytest.raises(kvstore.InvalidInput, match="no config.json"):
        kfp.checkpoint_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(kvstore.InvalidInput, match="no weight files"):
        kfp.checkpoint_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(kvstore.InvalidInput, match="JSON object"):
        kfp.checkpoint_fingerprint(tmp_path)
    with pytest.raises(kvstore.InvalidInput, match="hub cache"):
        kfp.checkpoint_fingerprint("nobody/nothing", hub_cache=tmp_path / "hub")
    escaping = copy(checkpoint, tmp_path / "escaping")
    index = {"weight_map": {"lm_head.weight": "../tiny/model.safetensors"}}
    (escaping / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(kvstore.InvalidInput, match="not a file of"):
        kfp.checkpoint_fingerprint(escaping)


# --------------------------------------------------------------------------- hub cache


def test_a_hub_snapshot_is_fingerprinted_by_its_blob_names_unread(
    tmp_path: Path, checkpoint: Path, hashed: list[str]
) -> None:
    hub = tmp_path / "hub"
    snap = make_hub(hub, checkpoint)
    fp = kfp.checkpoint_fingerprint("org/tiny", hub_cache=hub)
    assert hashed == [], "a hub blob is known by its name"
    blob = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
    c = kfp.read_checkpoint("org/tiny", hub_cache=hub)
    assert c.root == snap and [w.digest for w in c.weights] == ["sha256:" + blob]
    # The snapshot's path, the ref and the commit name the same checkpoint.
    assert kfp.checkpoint_fingerprint(snap) == fp
    assert kfp.checkpoint_fingerprint("org/tiny", revision="main", hub_cache=hub) == fp
    assert kfp.checkpoint_fingerprint("org/tiny", revision=COMMIT, hub_cache=hub) == fp
    assert hashed == []
    # The same bytes as a plain directory are hashed, and so fingerprinted otherwise.
    assert kfp.checkpoint_fingerprint(checkpoint) != fp
    with pytest.raises(kvstore.InvalidInput, match="'v2'"):
        kfp.checkpoint_fingerprint("org/tiny", revision="v2", hub_cache=hub)


def test_only_the_blob_name_counts_in_a_hub_snapshot(tmp_path: Path, checkpoint: Path) -> None:
    """Blobs named by a hex no content has: the fingerprint follows the names (it
    never reads them), and a symlink that is not into the snapshot's blobs is read."""
    hub = tmp_path / "hub"
    snap = make_hub(hub, checkpoint, blob_names=False)
    blob = os.path.basename(os.readlink(snap / "model.safetensors"))
    assert [w.digest for w in kfp.read_checkpoint(snap).weights] == ["sha256:" + blob]
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    assert kfp.read_checkpoint(snap).weights[0].digest.startswith("blake3:")


# ------------------------------------------------------------------------------- the memo


def test_a_second_call_reads_no_file_until_one_changes(
    tmp_path: Path, checkpoint: Path, hashed: list[str], user_cache: Path
) -> None:
    ckpt = copy(checkpoint, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    fp = kfp.checkpoint_fingerprint(ckpt)
    assert hashed == [str(weights)]
    memo = user_cache / kfp.MEMO_FILE
    assert stat.S_IMODE(memo.stat().st_mode) == 0o600
    assert str(weights) in json.loads(memo.read_text())["files"]
    assert kfp.checkpoint_fingerprint(ckpt) == fp
    assert hashed == [str(weights)], "the memo answered"
    # Touched (same bytes, other mtime): read again, same fingerprint.
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert kfp.checkpoint_fingerprint(ckpt) == fp
    assert len(hashed) == 2
    # Another size: read again, another fingerprint.
    with open(weights, "ab") as f:
        f.write(b"\0")
    assert kfp.checkpoint_fingerprint(ckpt) != fp
    assert len(hashed) == 3
    assert kfp.checkpoint_fingerprint(ckpt, remember=False) != fp
    assert len(hashed) == 4, "remember=False reads"


def test_the_memo_is_not_trusted_when_it_may_not_be_ours(
    tmp_path: Path, checkpoint: Path, hashed: list[str], user_cache: Path
) -> None:
    fp = kfp.checkpoint_fingerprint(checkpoint)
    memo = user_cache / kfp.MEMO_FILE
    memo.chmod(0o620)  # writable by the group: anyone in it could pose any hash
    assert kfp.checkpoint_fingerprint(checkpoint) == fp
    assert len(hashed) == 2
    memo.write_bytes(b"{ not json")
    memo.chmod(0o600)
    assert kfp.checkpoint_fingerprint(checkpoint) == fp
    assert len(hashed) == 3
    assert kfp.checkpoint_fingerprint(checkpoint) == fp
    assert len(hashed) == 3, "rewritten whole"
    # Forged: a memo that says another hash is believed (it is the user's own file),
    # which is why it must be the user's and private.
    data = json.loads(memo.read_text())
    (entry,) = data["files"].values()
    entry["digest"] = "blake3:" + "0" * 64
    memo.write_text(json.dumps(data))
    assert kfp.checkpoint_fingerprint(checkpoint) != fp


def test_the_memo_keeps_the_newest_files(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch, user_cache: Path
) -> None:
    monkeypatch.setattr(kfp, "_MEMO_ENTRIES", 2)
    copies = [copy(checkpoint, tmp_path / f"c{i}") for i in range(3)]
    for c in copies:
        kfp.checkpoint_fingerprint(c)
    files = json.loads((user_cache / kfp.MEMO_FILE).read_text())["files"]
    assert sorted(files) == sorted(str(c / "model.safetensors") for c in copies[1:])


def test_beside_the_store_the_memo_leaves_the_store_usable(
    tmp_path: Path, checkpoint: Path, hashed: list[str], user_cache: Path
) -> None:
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    store = tmp_path / "store"
    with hf.open(store, model, durability="sync") as s:
        assert s.model == kfp.checkpoint_fingerprint(checkpoint, memo_dir=store)
        ids = list(range(40))
        with torch.inference_mode():
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        hf.save(s, ids, cache)
    assert len(hashed) == 1 and not (user_cache / kfp.MEMO_FILE).exists()
    assert stat.S_IMODE((store / kfp.MEMO_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
    with hf.open(store, model) as s:
        assert s.lookup(ids) == 32
    assert len(hashed) == 1, "a restart reads no weight file"
    assert cli.main(["verify", str(store)]) == 0


def test_blake3_file_is_blake3_and_releases_the_gil(tmp_path: Path) -> None:
    """The empty input's BLAKE3 (the specification's test vector); a 64 MiB hash on
    one thread while a pure-Python thread keeps sampling the clock: samples land
    inside the call, which they cannot if it holds the GIL (as tests/test_gil.py)."""
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert _lib.blake3_file(empty) == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )
    big = tmp_path / "big"
    big.write_bytes(os.urandom(64 << 20))
    assert _lib.blake3_file(big, 1) == _lib.blake3_file(big, 4)
    span: list[float] = []
    done = threading.Event()

    def run() -> None:
        span.append(time.perf_counter())
        _lib.blake3_file(big, 1)
        span.append(time.perf_counter())
        done.set()

    t = threading.Thread(target=run)
    samples = []
    t.start()
    while not done.is_set():
        samples.append(time.perf_counter())
        time.sleep(0.0005)
    t.join()
    assert any(span[0] < x < span[1] for x in samples[1:])
    with pytest.raises(kvstore.StoreIOError, match="nonexistent"):
        _lib.blake3_file(tmp_path / "nonexistent")


# ------------------------------------------------------------------------- kvstore.hf


def test_hf_fingerprint_of_a_loaded_model_is_its_checkpoints(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp = kfp.checkpoint_fingerprint(checkpoint)
    assert hf.fingerprint(LlamaForCausalLM.from_pretrained(checkpoint)) == fp
    # Loaded in another dtype: the same files (the store's layout binds the dtype).
    half = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float16)
    assert hf.fingerprint(half) == fp
    assert hf.layout_of(half).dtype == "float16"
    # By hub id from the hub cache, at the commit transformers records.
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    make_hub(hub, checkpoint)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    from_hub = LlamaForCausalLM.from_pretrained("org/tiny", cache_dir=hub, local_files_only=True)
    assert from_hub.name_or_path == "org/tiny"
    assert hf.fingerprint(from_hub) == kfp.checkpoint_fingerprint("org/tiny", hub_cache=hub) != fp


def test_hf_fingerprint_falls_back_to_the_weights_and_can_be_told(checkpoint: Path) -> None:
    loaded = LlamaForCausalLM.from_pretrained(checkpoint)
    old = hf.fingerprint(loaded, source="weights")
    assert old.startswith("llama@sha256:"), "the first scheme, unchanged"
    built = tiny_llama("bfloat16", layers=2)  # never saved
    assert hf.fingerprint(built) == hf.fingerprint(built, source="weights")
    assert hf.fingerprint(built).startswith("llama@sha256:")
    with pytest.raises(kvstore.InvalidInput, match="built in memory"):
        hf.fingerprint(built, source="files")
    # Loaded with a config override: not what the files say, so its weights.
    eps = LlamaForCausalLM.from_pretrained(checkpoint, rms_norm_eps=1e-3)
    assert hf.fingerprint(eps).startswith("llama@sha256:")
    assert hf.fingerprint(eps, source="files") == kfp.checkpoint_fingerprint(checkpoint)
    with pytest.raises(kvstore.InvalidInput, match="source"):
        hf.fingerprint(loaded, source="tensors")


def test_a_store_of_the_first_scheme_is_refused_with_what_to_do(
    tmp_path: Path, checkpoint: Path
) -> None:
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    old = hf.fingerprint(model, source="weights")
    store = tmp_path / "store"
    with hf.open(store, model, fingerprint=old):
        pass
    with pytest.raises(kvstore.LayoutMismatch, match="earlier scheme") as e:
        hf.open(store, model)
    message = str(e.value)
    assert old in message and hf.fingerprint(model) in message
    assert 'source="weights"' in message and "new store" in message
    with hf.open(store, model, fingerprint=hf.fingerprint(model, source="weights")) as s:
        assert s.model == old
    # Another mismatch says nothing of schemes.
    with pytest.raises(kvstore.LayoutMismatch) as e:
        hf.open(store, model, fingerprint="org/tiny@v1")
    assert "scheme" not in str(e.value)


# -------------------------------------------------------------------------------- CLI


def test_cli_prints_the_fingerprint(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fp = kfp.checkpoint_fingerprint(checkpoint)
    assert cli.main(["fingerprint", str(checkpoint)]) == 0
    assert capsys.readouterr().out == fp + "\n"
    assert cli.main(["fingerprint", "--json", "--no-memo", str(checkpoint)]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert out["fingerprint"] == fp and out["root"] == str(checkpoint)
    assert [w["name"] for w in out["weights"]] == ["model.safetensors"]
    hub = tmp_path / "hub"
    make_hub(hub, checkpoint)
    argv = ["fingerprint", "org/tiny", "--hub-cache", str(hub), "--revision", "main"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip() == kfp.checkpoint_fingerprint("org/tiny", hub_cache=hub)
    assert cli.main(["fingerprint", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvstore: error:") and err.count("\n") == 1
