"""`kvstore demo`: the main job end to end, on the CPU, with a small Llama model.

1. An agent (this process) with a long system prompt runs several turns through
   `hf.generate`: each turn restores the conversation so far from the store and
   prefills only the new tokens; the conversation is then saved as a session and
   the agent's handle and in-memory cache are dropped ("restart").
2. A fresh process (`python -m kvstore.demo --resume`) loads the session and
   answers the next user turn. It measures time to first token restored vs
   recomputing the whole conversation, and checks that the restored KV and the
   next-token logits are bitwise those the agent computed (each block's KV as the
   turn that first filled it computed it, kept in memory, never read back from
   the store), and that the greedy continuation equals the recomputed one.
3. Two worker processes (`--worker`) run at the same time with the same system
   prompt and their own questions: both restore the system prompt's blocks that
   the agent stored, and the store holds those blocks once.

The model is a Llama-architecture model with seeded random weights (no download;
every process builds the same one, checked by `hf.fingerprint`), or the local
transformers checkpoint named by `KVSTORE_DEMO_MODEL` (token ids stay synthetic).
Child processes start early, so that importing torch overlaps the agent's work;
each opens the store only when told to go, after the agent has closed it.
Exit status 0 only if every equality check passes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

MODEL_ENV = "KVSTORE_DEMO_MODEL"
SESSION = "agent"
REPEAT = 3  # timings: best of 3, on a machine that may be busy with other work


@dataclass(frozen=True)
class Plan:
    """Sizes of one demo run, in tokens."""

    system: int
    user: int
    turns: int
    answer: int  # tokens the agent generates per turn
    next_turn: int  # the user turn answered after the restart
    continuation: int  # greedy tokens compared, restored vs recomputed
    question: int  # each worker's question after the system prompt


QUICK = Plan(system=512, user=48, turns=3, answer=12, next_turn=40, continuation=16, question=40)
FULL = Plan(system=2048, user=64, turns=4, answer=24, next_turn=64, continuation=32, question=64)


def _plan(quick: bool) -> Plan:
    return QUICK if quick else FULL


# -- model and tokens ---------------------------------------------------------------------------


def load_model(quick: bool, path: str | None = None) -> tuple[Any, str]:
    """(model, description): the checkpoint at `path` (or $KVSTORE_DEMO_MODEL), else a
    small Llama with seeded random weights, in float32 on the CPU."""
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = path or os.environ.get(MODEL_ENV) or None
    model: Any
    if path:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, local_files_only=True
        )
        what = f"{path} (local checkpoint)"
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden = 256 if quick else 512
        config = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=512 if quick else 1408,
            num_hidden_layers=4 if quick else 8,
            num_attention_heads=hidden // 64,
            num_key_value_heads=hidden // 128,
            vocab_size=2000 if quick else 32000,
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
            initializer_range=0.1,  # clear argmax winners: greedy text is not one token repeated
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        what = "Llama, seeded random weights"
    model = model.eval()
    # Synthetic token ids: never stop early at an end-of-sequence token.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    params = sum(p.numel() for p in model.parameters())
    return model, f"{what}, {params / 1e6:.1f}M parameters"


def tokens(n: int, seed: int, vocab: int) -> Any:
    """[1, n] synthetic token ids (a system prompt, a user turn, a question)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, n), generator=g)


def system_prompt(plan: Plan, vocab: int) -> Any:
    return tokens(plan.system, 1, vocab)


def user_turn(plan: Plan, i: int, vocab: int) -> Any:
    return tokens(plan.user if i >= 0 else plan.next_turn, 100 + i, vocab)


def question(plan: Plan, worker: int, vocab: int) -> Any:
    return tokens(plan.question, 200 + worker, vocab)


class FirstToken:
    """A generate() streamer that notes when the first new token comes out."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._calls = 0

    def put(self, value: Any) -> None:
        self._calls += 1
        if self._calls == 2 and self.first is None:  # call 1 is the prompt itself
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def greedy_kwargs(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}


def recompute(model: Any, ids: Any, n: int) -> list[int]:
    """The greedy continuation computed from scratch (no store, no cache)."""
    import torch

    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy_kwargs(n))
    return [int(t) for t in out[0, ids.shape[1] :]]


def warm_up(model: Any) -> None:
    """Takes first-call costs (allocations, kernel selection, mask helpers) off the
    clock: a short prefill, then a step on its cache, as the timed calls do."""
    import torch

    from . import hf

    ids = tokens(48, 9, model.config.vocab_size)
    with torch.inference_mode():
        cache = model(ids[:, :32], use_cache=True).past_key_values
        model(ids[:, 32:], **hf.cache_kwarg(cache), use_cache=True)
    recompute(model, ids[:, :16], 2)


def kv_digest(kv: Any) -> str:
    import torch

    return hashlib.sha256(kv.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


# -- child processes ----------------------------------------------------------------------------


def _result(data: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(data), flush=True)


def _wait_for_go() -> None:
    print("READY", flush=True)
    sys.stdin.readline()


def _restored_first_token(
    model: Any, store: Any, plan: Plan, all_logits: bool = False
) -> tuple[float, float, Any, int, Any]:
    """Restores the session, prefills the next user turn, picks the first token.
    Returns (seconds to first token, seconds of the restore, the prompt, tokens
    restored, logits: of every prefilled token or only of the last one)."""
    from . import hf

    t0 = time.perf_counter()
    ids, cache, n = hf.load_session(store, SESSION, config=model.config)
    t_load = time.perf_counter() - t0
    nxt = _cat(ids, user_turn(plan, -1, model.config.vocab_size))
    keep = 0 if all_logits else 1  # 0: all
    logits = model(nxt[:, n:], **hf.cache_kwarg(cache), use_cache=True, logits_to_keep=keep).logits
    int(logits[0, -1].argmax())
    return time.perf_counter() - t0, t_load, nxt, n, logits


def _cat(a: Any, b: Any) -> Any:
    import torch

    return torch.cat([a, b], dim=1)


def _resume(path: str, work: str, quick: bool) -> int:
    """The restarted process: load the session, answer the next turn, compare."""
    import torch

    from . import hf

    plan = _plan(quick)
    model, _ = load_model(quick)
    warm_up(model)
    _wait_for_go()
    ref = torch.load(os.path.join(work, "ref.pt"))
    same_model = hf.fingerprint(model) == ref["fingerprint"]
    with hf.open(path, model, fingerprint=ref["fingerprint"], create=False) as store:
        with torch.inference_mode():
            _, cache, n = hf.load_session(store, SESSION, config=model.config)
            kv_equal = kv_digest(hf.cache_to_kv(cache)) == ref["kv_sha256"]
            del cache
            one_restore = store.stats()
            logits = _restored_first_token(model, store, plan, all_logits=True)[4]
            logits_equal = bool(torch.equal(logits, ref["logits"]))
            restored_runs = [_restored_first_token(model, store, plan) for _ in range(REPEAT)]
            t_first, t_load, nxt, n, _ = min(restored_runs, key=lambda r: r[0])
            cold_runs = []
            for _ in range(REPEAT):
                t0 = time.perf_counter()
                cold = model(nxt, use_cache=True, logits_to_keep=1).logits
                int(cold[0, -1].argmax())
                cold_runs.append(time.perf_counter() - t0)
        out = hf.generate(model, store, nxt, save=False, **greedy_kwargs(plan.continuation))
        restored = [int(t) for t in out[0, nxt.shape[1] :]]
        st = store.stats()
    recomputed = recompute(model, nxt, plan.continuation)
    _result(
        {
            "same_model": same_model,
            "tokens": int(nxt.shape[1]),
            "restored_tokens": n,
            "t_load": t_load,
            "ttft_restored": t_first,
            "ttft_cold": min(cold_runs),
            "kv_equal": kv_equal,
            "logits_equal": logits_equal,
            "continuation_equal": restored == recomputed,
            "continuation": restored,
            "bytes_read": one_restore.get("bytes_read", 0),
            "hit_blocks": st.get("hit_blocks", 0),
            "miss_blocks": st.get("miss_blocks", 0),
        }
    )
    return 0


def _worker(path: str, work: str, quick: bool, index: int) -> int:
    """A worker with the shared system prompt and its own question."""
    import torch

    from . import hf

    torch.set_num_threads(1)  # two workers share the machine's cores
    plan = _plan(quick)
    model, _ = load_model(quick)
    vocab = model.config.vocab_size
    ids = torch.cat([system_prompt(plan, vocab), question(plan, index, vocab)], dim=1)
    warm_up(model)
    _wait_for_go()
    ref = torch.load(os.path.join(work, "ref.pt"))
    same_model = hf.fingerprint(model) == ref["fingerprint"]
    with hf.open(path, model, fingerprint=ref["fingerprint"], create=False) as store:
        info: dict[str, int] = {}
        first = FirstToken()
        out = hf.generate(
            model,
            store,
            ids,
            stats=info,
            streamer=first,
            return_dict_in_generate=True,
            **greedy_kwargs(plan.continuation),
        )
        saved = out.sequences[0, : out.past_key_values.get_seq_length()]
        store.flush()
    restored = [int(t) for t in out.sequences[0, ids.shape[1] :]]
    _result(
        {
            "same_model": same_model,
            "tokens": int(ids.shape[1]),
            "restored_tokens": info["restored_tokens"],
            "ttft": first.first,
            "continuation_equal": restored == recompute(model, ids, plan.continuation),
            "saved": [int(t) for t in saved],
        }
    )
    return 0


class _Child:
    """A child process of this demo, started early, told to go later."""

    def __init__(self, role: list[str], path: str, work: str, quick: bool) -> None:
        argv = [sys.executable, "-m", "kvstore.demo", *role, path, work]
        self.name = " ".join(role)
        self._ready: bool | None = None
        self.proc = subprocess.Popen(
            argv + (["--quick"] if quick else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> bool:
        """Waits until it has loaded torch and the model (and is idle)."""
        if self._ready is None:
            assert self.proc.stdout is not None
            self._ready = self.proc.stdout.readline().strip() == "READY"
        return self._ready

    def go(self) -> None:
        if not self.ready():
            return  # it failed: finish() reports why
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()  # communicate() closes it

    def finish(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=600)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if self.proc.returncode != 0 or line is None:
            raise RuntimeError(
                f"demo process '{self.name}' exited {self.proc.returncode}:\n{out}{err}"
            )
        result: dict[str, Any] = json.loads(line[len("RESULT ") :])
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# -- the agent and the report ------------------------------------------------------------------


def _distinct_blocks(sequences: list[list[int]], block_size: int) -> int:
    """Blocks a content-addressed store needs for these sequences: one per distinct
    full-block prefix."""
    prefixes = {
        tuple(s[: k * block_size]) for s in sequences for k in range(1, len(s) // block_size + 1)
    }
    return len(prefixes)


def run(path: str | None, quick: bool = False, model: str | None = None) -> int:
    """The demo; 0 if every equality check passed. `model`: a local transformers
    checkpoint (default: $KVSTORE_DEMO_MODEL, else a seeded random Llama)."""
    from rich.console import Console

    console = Console()
    if model:
        os.environ[MODEL_ENV] = model  # the child processes load the same one
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-") as work:
        if path is None:
            path = os.path.join(work, "store")
        children = [
            _Child(["--resume"], path, work, quick),
            _Child(["--worker", "0"], path, work, quick),
            _Child(["--worker", "1"], path, work, quick),
        ]
        try:
            return _run(console, path, work, quick, children)
        except RuntimeError as e:
            console.print(f"[red]{e}[/red]")
            return 1
        finally:
            for c in children:
                c.kill()


def _run(console: Any, path: str, work: str, quick: bool, children: list[_Child]) -> int:
    import torch

    from . import hf

    plan = _plan(quick)
    t_start = time.perf_counter()
    model, what = load_model(quick)
    vocab = model.config.vocab_size
    fingerprint = hf.fingerprint(model)
    layout = hf.layout_of(model)
    warm_up(model)
    for c in children:  # their imports overlapped ours; from now on they sit idle
        c.ready()
    console.print(
        f"[bold]kvstore demo[/bold]: {what}; layout L={layout.num_layers} "
        f"H={layout.num_kv_heads} D={layout.head_dim} {layout.dtype}, "
        f"{layout.block_bytes // 1024} KiB per {layout.block_size}-token block; store at {path}"
    )

    # 1. The agent: several turns, each restoring the previous ones from the store.
    saved: list[list[int]] = []
    turns: list[tuple[int, int, float]] = []  # restored, prefilled, time to first token
    # Each block's KV as computed by the turn that first filled (and stored) it: the
    # reference the restart must reproduce, independent of what the store reads back.
    computed: dict[int, Any] = {}
    b = layout.block_size

    def keep_computed(cache: Any, start: int, end: int) -> None:
        kv = hf.cache_to_kv(cache)
        for k in range(start // b, end // b):
            computed.setdefault(k, kv[:, :, k * b : (k + 1) * b].clone())

    with hf.open(path, model, fingerprint=fingerprint, durability="batch") as store:
        blocks_at_start = store.stats()["blocks"]
        conv = system_prompt(plan, vocab)
        for i in range(plan.turns):
            conv = torch.cat([conv, user_turn(plan, i, vocab)], dim=1)
            info: dict[str, int] = {}
            first = FirstToken()
            out = hf.generate(
                model,
                store,
                conv,
                stats=info,
                streamer=first,
                return_dict_in_generate=True,
                **greedy_kwargs(plan.answer),
            )
            conv, cache = out.sequences, out.past_key_values
            keep_computed(cache, info["restored_tokens"], cache.get_seq_length())
            saved.append([int(t) for t in conv[0, : cache.get_seq_length()]])
            turns.append((info["restored_tokens"], info["prefilled_tokens"], first.first or 0.0))
        # The cache lacks the last generated token: compute it, so that the session
        # stores the KV of all its full blocks.
        with torch.inference_mode():
            model(conv[:, cache.get_seq_length() :], **hf.cache_kwarg(cache), use_cache=True)
        keep_computed(cache, 0, cache.get_seq_length())
        n = hf.save_session(store, SESSION, conv, cache)
        saved.append([int(t) for t in conv[0]])
        store.flush()
    # What the restarted process must reproduce: the KV the session restores and the
    # next turn's logits, from the KV as computed.
    kv = torch.cat([computed[k] for k in range(n // b)], dim=2)
    ref = {"fingerprint": fingerprint, "kv_sha256": kv_digest(kv), "n": n}
    nxt = torch.cat([conv, user_turn(plan, -1, vocab)], dim=1)
    with torch.inference_mode():
        computed_cache = hf.kv_to_cache(kv, model.config)
        ref["logits"] = model(nxt[:, n:], **hf.cache_kwarg(computed_cache), use_cache=True).logits
    torch.save(ref, os.path.join(work, "ref.pt"))
    computed.clear()
    del cache, out, computed_cache, kv  # the "restart": only the store keeps KV

    # 2. A fresh process resumes the conversation; 3. then two workers at once.
    children[0].go()
    resumed = children[0].finish()
    for c in children[1:]:
        c.go()
    workers = [c.finish() for c in children[1:]]
    for w in workers:
        saved.append(w["saved"])
    with hf.open(path, model, fingerprint=fingerprint, create=False) as store:
        blocks = store.stats()["blocks"]
    distinct = _distinct_blocks(saved, layout.block_size)
    system_blocks = plan.system // layout.block_size

    checks = {
        "same model in every process (fingerprint)": resumed["same_model"]
        and all(w["same_model"] for w in workers),
        "restored KV == KV as computed (bitwise)": resumed["kv_equal"],
        "next-token logits: restored == from KV as computed": resumed["logits_equal"],
        "restored continuation == recomputed": resumed["continuation_equal"],
        "workers: restored continuation == recomputed": all(
            w["continuation_equal"] for w in workers
        ),
        "blocks stored once (store == distinct)": blocks == distinct
        if blocks_at_start == 0
        else True,
    }
    _report(console, plan, layout, turns, resumed, workers, blocks, distinct, system_blocks)
    _report_checks(console, checks, plan, blocks_at_start)
    ok = all(checks.values())
    elapsed = time.perf_counter() - t_start
    verdict = "[green]all checks passed[/green]" if ok else "[red]a check FAILED[/red]"
    console.print(f"{verdict} in {elapsed:.1f} s")
    return 0 if ok else 1


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _report(
    console: Any,
    plan: Plan,
    layout: Any,
    turns: list[tuple[int, int, float]],
    resumed: dict[str, Any],
    workers: list[dict[str, Any]],
    blocks: int,
    distinct: int,
    system_blocks: int,
) -> None:
    from rich.table import Table

    table = Table(title="kvstore demo", title_justify="left")
    table.add_column("step", no_wrap=True)
    table.add_column("figure", justify="right")
    table.add_row("system prompt", f"{plan.system} tokens")
    for i, (restored, prefilled, ttft) in enumerate(turns):
        table.add_row(f"agent turn {i + 1}: restored + prefilled", f"{restored} + {prefilled}")
        table.add_row(f"agent turn {i + 1}: time to first token", _ms(ttft))
    table.add_section()
    cold, warm = resumed["ttft_cold"], resumed["ttft_restored"]
    table.add_row("restart: session restored", f"{resumed['restored_tokens']} tokens")
    table.add_row("restart: session load (read + to cache)", _ms(resumed["t_load"]))
    table.add_row("time to first token, cold (recompute)", _ms(cold))
    table.add_row("time to first token, restored", _ms(warm))
    table.add_row("speedup", f"{cold / warm:.1f}x" if warm else "-")
    table.add_row("tokens reused", f"{resumed['restored_tokens']} / {resumed['tokens']}")
    table.add_row("bytes read per restore", f"{resumed['bytes_read'] / 2**20:.1f} MiB")
    hits, misses = resumed["hit_blocks"], resumed["miss_blocks"]
    table.add_row("hit rate (blocks)", f"{hits / max(1, hits + misses):.1%}")
    table.add_section()
    for i, w in enumerate(workers):
        table.add_row(
            f"worker {i}: restored / prompt tokens", f"{w['restored_tokens']} / {w['tokens']}"
        )
        table.add_row(f"worker {i}: time to first token", _ms(w["ttft"] or 0.0))
    table.add_row("system prompt blocks", f"{system_blocks}, shared by {len(workers) + 1} convs")
    table.add_row("blocks in store / distinct", f"{blocks} / {distinct}")
    console.print(table)


def _report_checks(console: Any, checks: dict[str, bool], plan: Plan, blocks_at_start: int) -> None:
    from rich.table import Table

    table = Table(title=f"checks (greedy: {plan.continuation} tokens)", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("ok", justify="right")
    for label, ok in checks.items():
        if label.startswith("blocks stored once") and blocks_at_start:
            table.add_row(label, "n/a (store was not empty)")
            continue
        table.add_row(label, "[green]yes[/green]" if ok else "[red]NO[/red]")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.demo", description=__doc__)
    p.add_argument("path", nargs="?", help="store directory (default: a temporary one)")
    p.add_argument("--quick", action="store_true", help="small sizes (for CI)")
    p.add_argument("--model", help=f"local transformers checkpoint (default: ${MODEL_ENV})")
    # Internal: the roles of the child processes.
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("work", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.resume:
        return _resume(args.path, args.work, args.quick)
    if args.worker is not None:
        return _worker(args.path, args.work, args.quick, args.worker)
    return run(args.path, quick=args.quick, model=args.model)


if __name__ == "__main__":
    sys.exit(main())
