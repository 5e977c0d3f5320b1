"""The vLLM GPU tier: real vLLM 0.34 engines on hbmd's CUDA backend, each compared with the same engine without hbmd.

Run on a machine with an NVIDIA GPU and vLLM 0.34 importable (``scripts/vllm-gpu-tier.sh`` sets both up):

    python3 bench/vllm_tier.py --out DIR [--groups core,budget,faults,serve,big]

It makes its models itself (random Llama checkpoints written with
transformers, no download), starts ``hbmd --backend cuda`` daemons under a
temporary run directory, and runs every engine in a process of its own
(``engine`` subcommand: one offline ``vllm.LLM``, steps read from a JSON
spec, results printed as ``TIER {json}`` lines). It writes
``DIR/vllm-tier.json`` (every engine's figures and every check) and exits 1
when a check failed.

How engines are compared, so that noise fools the comparison neither way:
greedy decoding of fixed token prompts with the top-2 log-probabilities of
each step. Two engines agree on a prompt when they choose the same tokens up
to the first step where the reference's margin between its first and second
choice is under :data:`NEAR_TIE` (a near-tie any numeric noise may flip;
nothing after it is compared), and their log-probabilities of the chosen
tokens differ by at most :data:`LOGPROB_TOLERANCE` up to there. The
reference is a plain vLLM engine run twice; its two runs must agree
exactly. Beside that, exact checks: the weights' digests (vLLM's own
``compute_weight_checksums``) and the KV cache's first blocks, digested on
the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GiB = 1 << 30
NEAR_TIE = 0.05
"""A reference step whose top two log-probabilities are closer than this is a near-tie: comparison stops there."""
LOGPROB_TOLERANCE = 0.02
"""Largest difference of a chosen token's log-probability between two engines that agree."""
MAX_TOKENS = 32
PROMPT_LEN = 48
NUM_PROMPTS = 8
KV_DIGEST_BLOCKS = 32
LONG_PROMPT_LEN = 1000
KEEP_PREFIX_LEN = 8192
"""The keep group's long prompt: #50 asks for the first token of a request with an 8k-token prefix."""
ENGINE_TIMEOUT_S = 300
DRAIN_S = 10
"""How long an ended engine's output is read on: a process it started may hold the pipe open."""


def prompts(n: int = NUM_PROMPTS, length: int = PROMPT_LEN, seed: int = 0, vocab: int = 32000) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


# --- models -----------------------------------------------------------------------------------------------------


def make_model(folder: Path, big: bool) -> Path:
    """A random-weight Llama checkpoint (bf16 safetensors) with a word-level tokenizer, made once per folder."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if big:  # about 2.5B parameters: 4.6 GiB of bf16
        shape = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=20, num_attention_heads=24,
                     num_key_value_heads=8)
    else:  # about 156M parameters
        shape = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=4)
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=16384, torch_dtype="bfloat16", **shape)
    torch.manual_seed(1234)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1",
                            bos_token="w2").save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


# --- one engine (a process of its own) ----------------------------------------------------------------------


def say(kind: str, **fields: Any) -> None:
    print("TIER " + json.dumps({"kind": kind, **fields}), flush=True)


def count_weight_reads() -> dict[str, int]:
    """Count the checkpoint reads of this process through vLLM's own default loader (which hbmd's loader also falls
    back to), independently of hbmd's account of where weights came from."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    opened = {"files": 0}
    original = DefaultModelLoader._get_weights_iterator

    def weights_iterator(self: Any, source: Any) -> Any:
        opened["files"] += 1
        return original(self, source)

    DefaultModelLoader._get_weights_iterator = weights_iterator
    return opened


def generate(llm: Any, token_prompts: list[list[int]]) -> list[dict[str, Any]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in token_prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        steps = []
        for token, top in zip(completion.token_ids, completion.logprobs):
            ranked = sorted(top.values(), key=lambda lp: lp.rank)
            chosen = top[token].logprob
            second = next((lp.logprob for lp in ranked if lp.rank == 2), None)
            steps.append([token, chosen, chosen - second if second is not None else 99.0])
        results.append({"steps": steps, "cached": output.num_cached_tokens})
    return results


def worker_of(llm: Any) -> Any:
    """The in-process worker (the engine runs with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker


def kv_digest(llm: Any) -> str:
    """A digest of the first :data:`KV_DIGEST_BLOCKS` request blocks of every layer's KV cache, read on the GPU."""
    import hashlib

    import torch

    worker = worker_of(llm)
    runner = worker.model_runner
    num_blocks = runner.kv_cache_config.num_blocks
    digest = hashlib.sha256()
    for name in sorted(runner.kv_caches_by_layer):
        cache = runner.kv_caches_by_layer[name]
        dims = [d for d, size in enumerate(cache.shape) if size == num_blocks]
        if not dims:
            continue
        # Block 0 is vLLM's null block: never a request's KV, written by warm-up's dummy runs.
        first = cache.narrow(dims[0], 1, min(KV_DIGEST_BLOCKS, num_blocks - 1)).contiguous()
        digest.update(first.view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def engine_main(spec: dict[str, Any]) -> None:
    """Run one engine as ``spec`` says and report each step (``TIER`` lines)."""
    opened = count_weight_reads()
    started = time.monotonic()
    from vllm import LLM

    options = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, seed=0,
                   enforce_eager=spec.get("eager", True), enable_prefix_caching=True,
                   load_format=spec.get("load_format", "auto"), enable_sleep_mode=spec.get("sleep", False))
    if not options["enforce_eager"]:
        options["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    options.update(spec.get("options", {}))
    llm = LLM(**options)
    config = llm.llm_engine.vllm_config
    say("started", seconds=time.monotonic() - started, num_blocks=config.cache_config.num_gpu_blocks,
        block_size=config.cache_config.block_size, weight_files_opened=opened["files"], pid=os.getpid())
    token_prompts = prompts()
    if spec.get("first_output", True):
        first = time.monotonic()
        generate(llm, token_prompts[:1])
        say("first_output", seconds=time.monotonic() - started, generate_seconds=time.monotonic() - first)
    for step in spec.get("steps", ["generate"]):
        if step == "generate":
            say("generate", outputs=generate(llm, token_prompts))
        elif step == "checksums":
            checksums = llm.collective_rpc("compute_weight_checksums")[0]
            say("checksums", weights=sorted(checksums.items()))
        elif step == "kv_digest":
            say("kv_digest", digest=kv_digest(llm))
        elif step == "physical":
            kv = worker_of(llm).model_runner.extensible_kv_cache
            say("physical", kv_bytes=kv.physical_bytes if kv is not None else -1,
                blocks=kv.num_committed_blocks if kv is not None else -1,
                buffer=type(kv.buffer).__module__ if kv is not None else "")
        elif step.startswith("sleep:"):
            level = int(step.split(":")[1])
            began = time.monotonic()
            llm.sleep(level=level)
            say("slept", level=level, seconds=time.monotonic() - began)
            wait_for_line("wake")
            began = time.monotonic()
            llm.wake_up()
            if level == 2:  # level 2 discarded the weights: vLLM's own reload brings them back from the checkpoint
                llm.collective_rpc("reload_weights")
            say("woke", seconds=time.monotonic() - began)
        elif step == "reload":
            llm.collective_rpc("reload_weights")  # in place, from the checkpoint: what an RL weight sync does
            say("reloaded")
        elif step == "pause":
            say("paused")
            wait_for_line("go")
        elif step == "long":
            # One long prompt, one token: the time to first token, which a prefix served from cache shortens.
            from vllm import SamplingParams, TokensPrompt

            length = spec.get("long_len", LONG_PROMPT_LEN)
            began = time.monotonic()
            output = llm.generate([TokensPrompt(prompt_token_ids=prompts(n=1, length=length, seed=11)[0])],
                                  SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
            now = time.monotonic()
            say("long", seconds=now - began, since_start=now - started, at=now, length=length,
                cached=output.num_cached_tokens, token=output.outputs[0].token_ids[0])
        elif step == "decode":
            # Steady decoding, many sequences at once: the tokens per second a keeping engine's index may cost.
            from vllm import SamplingParams, TokensPrompt

            batch = prompts(n=64, length=64, seed=13)
            params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch[:4]], params, use_tqdm=False)
            began = time.monotonic()
            done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
            seconds = time.monotonic() - began
            say("decode", tokens_per_s=sum(len(o.outputs[0].token_ids) for o in done) / seconds, seconds=seconds)
        elif step == "stress":
            # Long prompts, many at once, then again: the block pool hands out every block it counts and reuses them.
            long_prompts = prompts(n=spec.get("stress_prompts", 160), length=spec.get("stress_len", 900), seed=7)
            from vllm import SamplingParams, TokensPrompt

            began = time.monotonic()
            for _ in range(2):
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in long_prompts],
                             SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
            say("stressed", seconds=time.monotonic() - began, prompts=len(long_prompts))
        else:
            raise ValueError(f"unknown step {step}")
    say("done")


def wait_for_line(expected: str) -> None:
    line = sys.stdin.readline().strip()
    if line != expected:
        raise RuntimeError(f"expected {expected!r} on stdin, got {line!r}")


# --- the tier -------------------------------------------------------------------------------------------------


class Engine:
    """An engine process and the ``TIER`` lines it printed, its full log in a file."""

    def __init__(self, tier: Tier, label: str, spec: dict[str, Any], env: dict[str, str]) -> None:
        self.label = label
        self.log_path = tier.out / f"engine-{label}.log"
        self.events: list[dict[str, Any]] = []
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed in wait)
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "HBMD_RUN_DIR": str(tier.run_dir),
                       "HBMD_VLLM_ENGINE": label, **env}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "engine", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=environment)
        from hbmd.testing.spawn import lines_of

        assert self.proc.stdout is not None
        self.lines = lines_of(self.proc.stdout, f"output of {label}")

    def _next(self, deadline: float) -> str | None:
        """The engine's next line, written to its log; None at its end; TimeoutError past ``deadline``."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{self.label}: silent until the deadline: see {self.log_path}") from None
        if line is not None:
            self.log.write(line)
            if line.startswith("TIER "):
                self.events.append(json.loads(line[5:]))
        return line

    def until(self, kind: str, timeout: float = ENGINE_TIMEOUT_S) -> dict[str, Any]:
        """Read the engine's output until its ``kind`` line; raise if it ends first or stays silent too long (it is
        killed then)."""
        deadline = time.monotonic() + timeout
        try:
            while (line := self._next(deadline)) is not None:
                if line.startswith("TIER ") and self.events[-1]["kind"] == kind:
                    return self.events[-1]
        except TimeoutError:
            self.proc.kill()
            raise TimeoutError(f"{self.label}: no {kind} within {timeout:.0f}s: see {self.log_path}") from None
        raise RuntimeError(f"{self.label} exited with {self.proc.wait(30)} before {kind}: see {self.log_path}")

    def until_said(self, phrase: str, timeout: float = ENGINE_TIMEOUT_S) -> None:
        """Read the engine's output until a line of its log says ``phrase``; raise if it ends first."""
        deadline = time.monotonic() + timeout
        while (line := self._next(deadline)) is not None:
            if not line.startswith("TIER ") and phrase in line:
                return
        raise RuntimeError(f"{self.label} exited with {self.proc.wait(30)} before saying {phrase!r}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def event(self, kind: str) -> dict[str, Any]:
        return next(e for e in self.events if e["kind"] == kind)

    def finish(self) -> int:
        """Read to the engine's end; its exit status."""
        self.until("done")
        return self.wait()

    def wait(self) -> int:
        """The engine's exit status, its output read to its end (or for :data:`DRAIN_S`, where a process it started
        holds its output on)."""
        code = self.proc.wait(60)
        deadline = time.monotonic() + DRAIN_S
        with contextlib.suppress(TimeoutError):
            while self._next(deadline) is not None:
                pass
        self.log.close()
        return code

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")


def agree(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Compare two engines' ``generate`` outputs as the module's docstring says; the verdict and its figures."""
    compared = wrong = 0
    worst = 0.0
    first_wrong = None
    for index, (ref, got) in enumerate(zip(reference, other)):
        for step, (r, g) in enumerate(zip(ref["steps"], got["steps"])):
            if r[0] != g[0]:
                if r[2] >= NEAR_TIE:
                    wrong += 1
                    first_wrong = first_wrong or {"prompt": index, "step": step, "margin": r[2]}
                break
            compared += 1
            worst = max(worst, abs(r[1] - g[1]))
            if r[2] < NEAR_TIE:
                break
    ok = wrong == 0 and worst <= LOGPROB_TOLERANCE and len(reference) == len(other) and compared > 0
    return {"ok": ok, "tokens_compared": compared, "wrong_tokens": wrong, "worst_logprob_diff": worst,
            "first_wrong": first_wrong}


def identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [[s[0] for s in o["steps"]] for o in a] == [[s[0] for s in o["steps"]] for o in b]


class Tier:
    def __init__(self, out: Path, work: Path) -> None:
        self.out = out
        self.work = work
        self.run_dir = work / "run"
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.daemon: Any = None
        self.standby_rounds = STANDBY_ROUNDS

    def check(self, name: str, ok: bool, **details: Any) -> bool:
        self.checks.append({"check": name, "ok": bool(ok), **details})
        print(f"{'PASS' if ok else 'FAIL'} {name} {json.dumps(details)[:400]}", flush=True)
        return ok

    def start_daemon(self, *args: str) -> Any:
        from hbmd.testing.spawn import DaemonProcess

        self.stop_daemon()
        self.daemon = DaemonProcess(self.run_dir, "--backend", "cuda", "--device", "0", *args,
                                    log_path=self.out / "hbmd.log").start()
        return self.daemon

    def take_over(self, *args: str) -> Any:
        """A successor started with ``--takeover`` (and ``args``) in place of the daemon serving now, which exits."""
        from hbmd.testing.spawn import DaemonProcess

        old = self.daemon
        self.daemon = DaemonProcess(self.run_dir, "--backend", "cuda", "--device", "0", *args, "--takeover",
                                    log_path=self.out / "hbmd.log").start(timeout=60)
        old.proc.wait(30)
        return self.daemon

    def stop_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def hbmctl(self, *args: str) -> Any:
        out = subprocess.run([sys.executable, "-m", "hbmd.client.ctl", "--run-dir", str(self.run_dir), "--json",
                              *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"hbmctl {' '.join(args)}: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def status(self) -> dict[str, Any]:
        return self.hbmctl("status")["instances"][0]

    def engine(self, label: str, spec: dict[str, Any], hbmd: bool, env: dict[str, str] | None = None) -> Engine:
        return Engine(self, label, spec, {"HBMD_VLLM": "1" if hbmd else "0", **(env or {})})

    def run(self, label: str, spec: dict[str, Any], hbmd: bool, env: dict[str, str] | None = None) -> Engine:
        engine = self.engine(label, spec, hbmd, env)
        engine.finish()
        return engine


def group_core(tier: Tier, model: str) -> None:
    """Weights stored then mapped, the KV cache through hbmd, CUDA graphs: each against plain vLLM."""
    steps = ["generate", "checksums", "kv_digest", "physical"]
    tier.start_daemon("--budget", "40GiB")
    plain = [tier.run(f"plain-{i}", {"model": model, "steps": steps}, hbmd=False) for i in (1, 2)]
    reference = plain[0].event("generate")["outputs"]
    tier.check("plain vLLM twice: identical tokens", identical(reference, plain[1].event("generate")["outputs"]),
               comparison=agree(reference, plain[1].event("generate")["outputs"]))
    tier.check("plain vLLM twice: identical KV blocks",
               plain[0].event("kv_digest")["digest"] == plain[1].event("kv_digest")["digest"])
    stored = tier.run("hbmd-store", {"model": model, "load_format": "hbmd", "steps": steps}, hbmd=True)
    mapped = tier.run("hbmd-map", {"model": model, "load_format": "hbmd", "steps": steps}, hbmd=True)
    kv_only = tier.run("hbmd-kv", {"model": model, "steps": steps}, hbmd=True)
    weights = plain[0].event("checksums")["weights"]
    for engine in (stored, mapped, kv_only):
        outputs = engine.event("generate")["outputs"]
        tier.check(f"{engine.label}: agrees with plain vLLM", **agree(reference, outputs))
        tier.check(f"{engine.label}: identical tokens to plain vLLM", identical(reference, outputs))
        tier.check(f"{engine.label}: bit-identical weights", engine.event("checksums")["weights"] == weights)
        tier.check(f"{engine.label}: KV blocks bit-identical to plain vLLM's",
                   engine.event("kv_digest")["digest"] == plain[0].event("kv_digest")["digest"])
        physical = engine.event("physical")
        tier.check(f"{engine.label}: KV cache is hbmd's", physical["buffer"].startswith("hbmd."),
                   buffer=physical["buffer"])
    tier.check("hbmd-map: no checkpoint read by vLLM's loader, where plain vLLM reads one",
               mapped.event("started")["weight_files_opened"] == 0 < plain[0].event("started")["weight_files_opened"],
               opened=mapped.event("started")["weight_files_opened"],
               plain=plain[0].event("started")["weight_files_opened"])
    tier.check("hbmd-map: mapped, nothing read from disk (vLLM's log)", "nothing read from disk" in mapped.log_text())
    tier.figures["start_to_first_output_s"] = {e.label: round(e.event("first_output")["seconds"], 2)
                                              for e in (*plain, stored, mapped, kv_only)}
    tier.figures["num_blocks"] = {e.label: e.event("started")["num_blocks"] for e in (*plain, stored, mapped, kv_only)}
    # What hbmctl shows of a live engine equals what vLLM holds.
    engine = tier.engine("hbmd-live", {"model": model, "steps": ["physical", "pause", "generate"]}, hbmd=True)
    physical = engine.until("physical")
    engine.until("paused")
    buffers = tier.hbmctl("buffers")["buffers"]
    mine = [b for b in buffers if b["name"] == "vllm-hbmd-live-rank0"]
    tier.check("hbmctl shows the live engine's KV bytes as vLLM counts them",
               len(mine) == 1 and mine[0]["physical_bytes"] == physical["kv_bytes"],
               hbmctl=[b["physical_bytes"] for b in mine], vllm=physical["kv_bytes"])
    engine.send("go")
    engine.finish()
    # CUDA graphs captured over the cache before it grew to its final size.
    graphs_plain = tier.run("plain-graphs", {"model": model, "eager": False}, hbmd=False)
    graphs = tier.run("hbmd-graphs", {"model": model, "eager": False, "load_format": "hbmd"}, hbmd=True)
    tier.check("hbmd-graphs: CUDA graphs replay over the grown cache, agreeing with plain vLLM's graphs",
               **agree(graphs_plain.event("generate")["outputs"], graphs.event("generate")["outputs"]))
    tier.stop_daemon()
    # No daemon at all: the engine starts without hbmd and says why.
    alone = tier.run("no-daemon", {"model": model, "load_format": "hbmd", "steps": ["generate", "physical"]},
                     hbmd=True)
    tier.check("no daemon: vLLM starts without hbmd, says why, agrees with plain vLLM",
               agree(reference, alone.event("generate")["outputs"])["ok"]
               and "hbmd is not reachable" in alone.log_text() and "not from hbmd" in alone.log_text())


def group_sleep(tier: Tier, model: str) -> None:
    """Sleep and wake through vLLM's own calls, dropping and keeping, beside vLLM's own sleep mode."""
    tier.start_daemon("--budget", "40GiB", "--host-budget", "24GiB")
    for label, hbmd, env, level in (("sleep-plain-l1", False, {}, 1), ("sleep-drop-l1", True, {}, 1),
                                    ("sleep-keep-l1", True, {"HBMD_VLLM_SLEEP": "keep"}, 1),
                                    ("sleep-drop-l2", True, {}, 2)):
        spec = {"model": model, "sleep": True, "steps": ["generate", f"sleep:{level}", "generate"]}
        engine = tier.engine(label, spec, hbmd, env)
        before = engine.until("generate")["outputs"]
        slept = engine.until("slept")
        held = sum(b["physical_bytes"] for b in tier.hbmctl("buffers")["buffers"]
                   if b["name"] == f"vllm-{label}-rank0")
        engine.send("wake")
        woke = engine.until("woke")
        after = engine.until("generate")["outputs"]
        engine.finish()
        tier.check(f"{label}: outputs after the wake agree with those before", **agree(before, after))
        if hbmd:
            tier.check(f"{label}: the KV cache's device memory is back in the budget while asleep", held == 0,
                       device_bytes=held)
        tier.figures.setdefault("sleep", {})[label] = {"sleep_s": round(slept["seconds"], 3),
                                                       "wake_s": round(woke["seconds"], 3)}
    tier.stop_daemon()


def group_budget(tier: Tier, model: str) -> None:
    """A budget below what vLLM measures: vLLM's cache is sized to what hbmd admits and every block it counts is
    backed; two engines under tenant quotas on one GPU."""
    tier.start_daemon("--budget", "3GiB")
    engine = tier.run("budget-cap", {"model": model, "steps": ["physical", "stress", "generate"]}, hbmd=True)
    physical = engine.event("physical")
    blocks = engine.event("started")["num_blocks"]
    tier.check("budget cap: vLLM's block pool holds exactly the blocks hbmd committed",
               blocks == physical["blocks"] and physical["kv_bytes"] <= 3 * GiB,
               scheduler_blocks=blocks, committed_blocks=physical["blocks"], kv_bytes=physical["kv_bytes"])
    tier.check("budget cap: every block served, the engine survived two passes of long prompts",
               engine.event("stressed")["prompts"] > 0, seconds=engine.event("stressed")["seconds"],
               said="hbmd admits" in engine.log_text())
    config = tier.work / "tenants.toml"
    config.write_text('[[tenants]]\nname = "a"\nmax = "6GiB"\n\n[[tenants]]\nname = "b"\nmax = "4GiB"\n')
    tier.start_daemon("--budget", "12GiB", "--config", str(config))
    engines = [tier.engine(f"tenant-{t}", {"model": model, "steps": ["physical", "pause", "generate"]}, True,
                           {"HBMD_TENANT": t}) for t in ("a", "b")]
    physical = {e.label: e.until("physical") for e in engines}
    for e in engines:
        e.until("paused")
    status = tier.status()
    tenants = {t["name"]: t for t in status.get("tenants", [])}
    for e in engines:
        e.send("go")
        e.finish()
    limits = {"tenant-a": 6 * GiB, "tenant-b": 4 * GiB}
    tier.check("two engines under tenant quotas: each within its tenant's maximum, the daemon within its budget",
               all(physical[label]["kv_bytes"] <= limits[label] for label in limits)
               and status["committed_bytes"] <= 12 * GiB,
               kv_bytes={label: p["kv_bytes"] for label, p in physical.items()},
               tenants={name: t.get("used_bytes") for name, t in tenants.items()},
               committed=status["committed_bytes"])
    tier.stop_daemon()


def group_faults(tier: Tier, model: str) -> None:
    """Faults under a live engine: it is killed; the daemon restarts cold or is taken over while it serves."""
    tier.start_daemon("--budget", "40GiB")
    engine = tier.engine("killed", {"model": model, "steps": ["physical", "pause"]}, True)
    engine.until("physical")
    engine.until("paused")
    before = tier.status()["committed_bytes"]
    os.kill(engine.proc.pid, signal.SIGKILL)
    engine.wait()
    deadline = time.monotonic() + 10
    after = before
    while time.monotonic() < deadline and after:
        time.sleep(0.2)
        after = tier.status()["committed_bytes"]
    tier.check("an engine SIGKILLed: its memory is back in the budget", after == 0, before=before, after=after)
    for how in ("cold restart", "takeover"):
        label = "daemon-" + how.replace(" ", "-")
        engine = tier.engine(label, {"model": model, "steps": ["generate", "pause", "generate", "physical", "pause"]},
                             True)
        before_outputs = engine.until("generate")["outputs"]
        engine.until("paused")
        began = time.monotonic()
        if how == "takeover":
            tier.take_over("--budget", "40GiB")
        else:
            tier.daemon.kill()
            tier.daemon = None
            tier.start_daemon("--budget", "40GiB")
        restart_s = time.monotonic() - began
        engine.send("go")
        after_outputs = engine.until("generate")["outputs"]
        physical = engine.until("physical")
        engine.until("paused")  # alive while hbmctl looks: its buffer goes with its session
        held = [b["physical_bytes"] for b in tier.hbmctl("buffers")["buffers"] if b["name"] == f"vllm-{label}-rank0"]
        engine.send("go")
        code = engine.finish()
        tier.check(f"daemon {how} under a live engine: outputs after equal those before, the engine ends cleanly",
                   identical(before_outputs, after_outputs) and code == 0, exit_status=code,
                   restart_s=round(restart_s, 2))
        tier.check(f"daemon {how}: the new daemon shows the engine's KV cache as vLLM counts it",
                   held == [physical["kv_bytes"]], hbmctl=held, vllm=physical["kv_bytes"])
    tier.stop_daemon()


class Server:
    """One ``vllm serve`` of the tier's, its log in the tier's folder, and OpenAI completions asked of it."""

    def __init__(self, tier: Tier, label: str, model: str, port: int, env: dict[str, str], *args: str) -> None:
        self.model, self.port, self.label = model, port, label
        self.log_path = tier.out / f"engine-{label}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port),
                 "--load-format", "hbmd", "--dtype", "bfloat16", *args], stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "HBMD_VLLM": "1", "HBMD_RUN_DIR": str(tier.run_dir), **env})

    def healthy(self) -> bool:
        with contextlib.suppress(OSError):
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).status == 200
        return False

    def until_healthy(self, timeout: float = ENGINE_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.healthy():
                return True
            time.sleep(0.5)
        return False

    def complete(self, prompt: str | list[int], max_tokens: int, timeout: float = 60) -> dict[str, Any]:
        """The reply to one greedy completion request; raises ``OSError`` where the server does not give one."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=timeout).read())

    def said(self, text: str) -> bool:
        return text in self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def group_serve(tier: Tier, model: str) -> None:
    """``vllm serve`` on hbmd with one OpenAI completion request."""
    tier.start_daemon("--budget", "40GiB")
    server = Server(tier, "serve", model, 8123, {"HBMD_VLLM_ENGINE": "serve"}, "--enforce-eager", "--max-model-len",
                    "1024")
    try:
        prompt = " ".join(f"w{t}" for t in prompts(1)[0])
        reply = server.complete(prompt, 16) if server.until_healthy() else {}
        buffers = [b["name"] for b in tier.hbmctl("buffers")["buffers"]]
        tier.check("vllm serve on hbmd answers an OpenAI completion request",
                   bool(reply.get("choices")) and reply["choices"][0].get("text") is not None
                   and any(name.startswith("vllm-serve-rank") for name in buffers),
                   text=(reply.get("choices") or [{}])[0].get("text", "")[:80], buffers=buffers)
    finally:
        server.stop()
    tier.stop_daemon()


def group_big(tier: Tier, model: str) -> None:
    """Restart to first output with a model of over 4 GiB: from disk without hbmd, then stored and mapped."""
    tier.start_daemon("--budget", "60GiB")
    runs = [tier.run(label, {"model": model, "load_format": fmt, "steps": ["generate"]}, hbmd)
            for label, fmt, hbmd in (("big-plain", "auto", False), ("big-store", "hbmd", True),
                                     ("big-map", "hbmd", True))]
    reference = runs[0].event("generate")["outputs"]
    for engine in runs[1:]:
        tier.check(f"{engine.label}: agrees with plain vLLM", **agree(reference, engine.event("generate")["outputs"]))
    tier.figures["big_model_start_to_first_output_s"] = {
        e.label: round(e.event("first_output")["seconds"], 2) for e in runs}
    tier.check("big-map: no checkpoint read by vLLM's loader",
               runs[2].event("started")["weight_files_opened"] == 0 < runs[0].event("started")["weight_files_opened"])
    tier.stop_daemon()


def cacheable_prefix(engine: Engine) -> int:
    """The tokens of the keep group's long prompt an engine can serve from cache: its full blocks, the last token
    left to compute."""
    block = engine.event("started")["block_size"]
    return (KEEP_PREFIX_LEN - 1) // block * block


def group_keep(tier: Tier, model: str, tag: str = "keep") -> None:
    """``HBMD_VLLM_KEEP_KV``: an engine SIGKILLed, the daemon taken over while its cache is kept, a successor that
    adopts it and serves its known prompts from cached blocks, stopped cleanly, and a third that adopts again. Each
    engine's first request after its start has an 8k-token prefix: cold, adopted, and vLLM without hbmd. ``tag``
    names the engines, their kept buffers and the figures (the same group with the big model is ``keep-big``)."""
    tier.start_daemon("--budget", "40GiB")
    env = {"HBMD_VLLM_KEEP_KV": "1", "HBMD_VLLM_ENGINE": tag, "HBMD_VLLM_KV_INDEX_DIR": str(tier.work / "kv-index")}
    shape = {"model": model, "first_output": False, "long_len": KEEP_PREFIX_LEN,
             "options": {"max_model_len": KEEP_PREFIX_LEN + 256}}
    # hbmd without the index, before any kept cache holds the budget: the decode baseline for the third's. First, so
    # that the engines whose start is timed do not start on a machine where no engine ran yet.
    off = tier.run(f"{tag}-off", {**shape, "steps": ["decode"]}, True)
    # Every engine's long request twice: the second, a prefix hit in an engine that has served it, is what a request
    # served from cache costs once vLLM's kernels for it have run.
    plain = tier.run(f"{tag}-plain", {**shape, "steps": ["long", "long"]}, False)
    first = tier.engine(f"{tag}-1", {**shape, "steps": ["long", "long", "generate", "kv_digest", "pause"]}, True, env)
    cold_long = first.until("long")
    cold = first.until("generate")["outputs"]
    left_digest = first.until("kv_digest")["digest"]
    first.until("paused")
    os.kill(first.proc.pid, signal.SIGKILL)
    first.wait()
    kept = [b for b in tier.hbmctl("buffers")["buffers"] if b["name"].startswith(f"vllm-{tag}-rank0")]
    tier.check("a SIGKILLed keeping engine leaves its KV cache in hbmd, held by no session",
               len(kept) == 1 and kept[0]["physical_bytes"] > 0 and kept[0]["session_id"] is None, kept=kept)
    tier.take_over("--budget", "40GiB")
    runs = []
    for number in (2, 3):
        # The second follows an engine SIGKILLed (and a daemon taken over since), the third one stopped cleanly.
        label = f"{tag}-{number}"
        steps = ["kv_digest", "long", "long", "generate"] + (["decode"] if number == 3 else [])
        engine = tier.run(label, {**shape, "steps": steps}, True, env)
        runs.append(engine)
        if number == 2:
            tier.check(f"{label}: the adopted cache's blocks are the killed engine's, byte for byte",
                       engine.event("kv_digest")["digest"] == left_digest)
        outputs = engine.event("generate")["outputs"]
        tier.check(f"{label}: serving from the adopted cache, it agrees with the cold engine",
                   **agree(cold, outputs))
        long, cacheable = engine.event("long"), cacheable_prefix(engine)
        tier.check(f"{label}: its first request's 8k prefix is served from the cache, its token the cold engine's",
                   long["cached"] == cacheable and long["token"] == cold_long["token"], cached=long["cached"],
                   cacheable=cacheable, seconds=round(long["seconds"], 4))
    tier.figures[f"{tag}_8k_prefix_first_token"] = {
        e.label: {"since_start_s": round(e.event("long")["since_start"], 2),
                  "request_s": round(e.event("long")["seconds"], 4), "cached_tokens": e.event("long")["cached"],
                  "again_request_s": round([x for x in e.events if x["kind"] == "long"][1]["seconds"], 4)}
        for e in [plain, first, *runs]}
    tier.figures[f"{tag}_prefix_hit_rate_after_restart"] = round(
        sum(e.event("long")["cached"] for e in runs) / sum(cacheable_prefix(e) for e in runs), 4)
    tier.figures[f"{tag}_decode_tokens_per_s"] = {"index kept": round(runs[1].event("decode")["tokens_per_s"], 1),
                                                "no index": round(off.event("decode")["tokens_per_s"], 1)}
    left = [b["name"] for b in tier.hbmctl("buffers")["buffers"] if b["name"].startswith(f"vllm-{tag}-rank0")]
    tier.check("one kept cache is left, the last engine's", len(left) == 1, buffers=left)
    tier.stop_daemon()


KEEP_CHANGES = [
    # label, CUDA graphs, what its start must find (None: not checked; "adopted"; else a phrase its log must say),
    # its env, its vLLM options, the rope_theta its config.json says (None: as made), steps after its long request.
    ("graphs", True, None, {}, {}, None, []),
    ("graphs-again", True, "adopted", {}, {}, None, []),
    ("eager", False, None, {}, {}, None, []),
    ("layout", False, "env.VLLM_KV_CACHE_LAYOUT", {"VLLM_KV_CACHE_LAYOUT": "HND"}, {}, None, []),
    ("overrides", False, "config.model.hf_config", {},
     {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}}, None, []),
    ("config-json", False, "config.model.hf_config", {}, {}, 40000.0, []),
    ("config-json-again", False, "adopted", {}, {}, 40000.0, ["reload"]),
    ("after-reload", False, "the weights were changed in place (Worker.reload_weights)", {}, {}, 40000.0, []),
]
"""The keep-changes group's engines, in order, each the successor of the one before."""


def group_keep_changes(tier: Tier, model: str) -> None:
    """``HBMD_VLLM_KEEP_KV`` with CUDA graphs on, and successors that differ from their predecessor in one thing
    their KV depends on (the KV layout, an ``--hf-overrides``, config.json, weights reloaded in place): each of those
    starts cold and says why, and one that differs in nothing adopts, its tokens the predecessor's."""
    tier.start_daemon("--budget", "40GiB")
    tag = "keep-changes"
    env = {"HBMD_VLLM_KEEP_KV": "1", "HBMD_VLLM_ENGINE": tag, "HBMD_VLLM_KV_INDEX_DIR": str(tier.work / "kv-index")}
    config_json = Path(model) / "config.json"
    made = config_json.read_text()
    previous: Engine | None = None
    try:
        for label, graphs, expect, extra_env, options, theta, steps in KEEP_CHANGES:
            config = json.loads(made)
            if theta is not None:
                config["rope_parameters"]["rope_theta"] = theta
            config_json.write_text(json.dumps(config))
            spec = {"model": model, "first_output": False, "long_len": KEEP_PREFIX_LEN, "eager": not graphs,
                    "options": {"max_model_len": KEEP_PREFIX_LEN + 256, **options},
                    "steps": ["long", "generate", *steps]}
            try:
                engine = tier.run(f"{tag}-{label}", spec, True, {**env, **extra_env})
            except (RuntimeError, TimeoutError) as exc:  # the engines after it still say what they found
                tier.check(f"{tag}-{label}: the engine ran", False, error=str(exc))
                previous = None
                continue
            long, cacheable = engine.event("long"), cacheable_prefix(engine)
            tier.figures.setdefault(f"{tag}_8k_prefix", {})[label] = {
                "cached_tokens": long["cached"], "request_s": round(long["seconds"], 4),
                "since_start_s": round(long["since_start"], 2)}
            if expect == "adopted" and previous is not None:
                tier.check(f"{tag}-{label}: unchanged, it serves the 8k prefix from the adopted cache, its tokens its "
                           "predecessor's", long["cached"] == cacheable
                           and long["token"] == previous.event("long")["token"]
                           and agree(previous.event("generate")["outputs"], engine.event("generate")["outputs"])["ok"],
                           cached=long["cached"], cacheable=cacheable, seconds=round(long["seconds"], 4))
            elif expect is not None:
                said = [line for line in engine.log_text().splitlines() if "no kept prefix cache adopted" in line]
                tier.check(f"{tag}-{label}: it starts cold and says why", long["cached"] == 0
                           and any(expect in line for line in said), cached=long["cached"], said=said[-1:])
            previous = engine
    finally:
        config_json.write_text(made)
    left = [b["name"] for b in tier.hbmctl("buffers")["buffers"] if b["name"].startswith(f"vllm-{tag}-rank0")]
    tier.check(f"{tag}: one kept cache is left, the last engine's", len(left) == 1, buffers=left)
    tier.stop_daemon()


def group_keep_big(tier: Tier, model: str) -> None:
    """The keep group with the big model, whose 8k-token prefill is long enough for adoption to show."""
    group_keep(tier, model, tag="keep-big")


STANDBY_ROUNDS = 3
"""Takeovers in a row in the standby group (``--standby-rounds``): the active engine killed, its standby serves, a
new standby starts beside it."""
STANDING_BY = "standing by for"
"""What a standby's log says once it waits, holding little."""
TAKING_OVER = "taking over its KV cache"
"""What a standby's log says once the active engine's session ended."""


def gpu_memory_of(pid: int) -> int:
    """The GPU memory nvidia-smi counts for process ``pid`` (its context, PyTorch's allocations, CUDA graphs; not
    hbmd's buffers, which the daemon allocated), in bytes."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    used = [int(row.split(",")[1]) for row in out.splitlines() if row.split(",")[0].strip() == str(pid)]
    return sum(used) << 20


def group_standby(tier: Tier, model: str, tag: str = "standby") -> None:
    """``HBMD_VLLM_STANDBY``: an active engine with CUDA graphs and its kept cache, a standby beside it that waits
    holding little, and :data:`STANDBY_ROUNDS` takeovers in a row (the active SIGKILLed, its standby serves the 8k
    prefix from the adopted cache, a new standby starts beside the new active). Kill to first token beside a cold
    restart of plain vLLM and a restart that adopts the kept cache (today's path); the standby's footprint; the
    active engine's decode throughput with and without a standby beside it."""
    tier.start_daemon("--budget", "40GiB")
    env = {"HBMD_VLLM_KEEP_KV": "1", "HBMD_VLLM_ENGINE": tag, "HBMD_VLLM_KV_INDEX_DIR": str(tier.work / "kv-index")}
    shape = {"model": model, "first_output": False, "long_len": KEEP_PREFIX_LEN, "eager": False,
             "options": {"max_model_len": KEEP_PREFIX_LEN + 256}}
    plain = tier.run(f"{tag}-plain", {**shape, "steps": ["long"]}, False)
    shape["load_format"] = "hbmd"  # the weights sealed once, mapped by every engine: a standby holds no copy
    # The first decode commits the pages it grows into; the second, on pages committed, is the engine's pace alone.
    active = tier.engine(f"{tag}-0", {**shape, "steps": ["long", "generate", "decode", "decode", "pause", "decode",
                                                         "pause"]}, True, env)
    cold_long, cold = active.until("long"), active.until("generate")["outputs"]
    active.until("decode")
    alone = active.until("decode")["tokens_per_s"]
    active.until("paused")
    footprints, kills = [], []
    standby_steps = ["long", "long", "generate", "pause"]
    for number in range(1, tier.standby_rounds + 1):
        label = f"{tag}-{number}"
        standby = tier.engine(label, {**shape, "steps": standby_steps}, True, {**env, "HBMD_VLLM_STANDBY": "1"})
        standby.until_said(STANDING_BY)
        buffers = {b["name"]: b for b in tier.hbmctl("buffers")["buffers"] if b["name"].startswith(f"vllm-{tag}-")}
        held = [b for b in buffers.values() if b["session_id"] is not None]
        footprints.append({"standby_gpu_bytes": gpu_memory_of(standby.proc.pid),
                           "active_gpu_bytes": gpu_memory_of(active.proc.pid),
                           "kv_bytes": sorted(b["physical_bytes"] for b in held)})
        if number == 1:  # the active engine decodes again beside its waiting standby
            active.send("go")
            beside = active.until("decode")["tokens_per_s"]
            active.until("paused")
            tier.figures[f"{tag}_active_decode_tokens_per_s"] = {"alone": round(alone, 1),
                                                                  "beside a standby": round(beside, 1)}
        killed = time.monotonic()
        os.kill(active.proc.pid, signal.SIGKILL)
        active.wait()
        long, cacheable = standby.until("long"), cacheable_prefix(standby)
        kills.append({"kill_to_first_token_s": round(long["at"] - killed, 3), "request_s": round(long["seconds"], 4),
                      "cached_tokens": long["cached"]})
        outputs = standby.until("generate")["outputs"]
        tier.check(f"{label}: the standby serves the 8k prefix from the killed engine's cache, its token and outputs "
                   "the cold engine's", long["cached"] == cacheable and long["token"] == cold_long["token"]
                   and agree(cold, outputs)["ok"], cached=long["cached"], cacheable=cacheable,
                   kill_to_first_token_s=kills[-1]["kill_to_first_token_s"])
        standby.until("paused")
        active = standby
    killed = time.monotonic()
    os.kill(active.proc.pid, signal.SIGKILL)
    restart = tier.engine(f"{tag}-restart", {**shape, "steps": ["long"]}, True, env)  # as a supervisor restarts it
    active.wait()
    restarted = restart.until("long")
    restart.finish()
    tier.check(f"{tag}-restart: a restart after the last kill adopts the cache as before",
               restarted["cached"] == cacheable_prefix(restart), cached=restarted["cached"])
    # A restart's own start to its first token is the least a kill costs it; from the kill it waits for the dead
    # process's end too (its GPU memory is the driver's to free first).
    tier.figures[f"{tag}_kill_to_first_token_s"] = {
        "plain vLLM, cold restart (its start to first token)": round(plain.event("long")["since_start"], 3),
        "hbmd, restart adopting the kept cache (its start to first token)": round(restarted["since_start"], 3),
        "hbmd, restart adopting the kept cache (kill to first token)": round(restarted["at"] - killed, 3),
        "hbmd, standby (kill to first token)": [k["kill_to_first_token_s"] for k in kills]}
    tier.figures[f"{tag}_takeovers"] = kills
    tier.figures[f"{tag}_footprint_while_waiting"] = footprints
    tier.check(f"{tag}: every standby served from cache after its takeover",
               all(k["cached_tokens"] == cacheable_prefix(restart) for k in kills))
    buffers = tier.hbmctl("buffers")["buffers"]
    kept = [b["name"] for b in buffers if b["name"].startswith(f"vllm-{tag}-")]
    committed = tier.status()["committed_bytes"]
    tier.check(f"{tag}: nothing leaked: one kept cache is left, the last engine's, beside the sealed weights, and "
               "the daemon commits what its buffers hold", len(kept) == 1 and all(
                   b["sealed"] for b in buffers if b["name"] not in kept)
               and committed == sum(b["physical_bytes"] for b in buffers),
               buffers=[b["name"] for b in buffers], committed=committed)
    tier.stop_daemon()


def engine_cores_of(pid: int) -> list[int]:
    """The engine core processes ``vllm serve`` ``pid`` started (its children vLLM titled ``EngineCore``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid and \
                    b"EngineCore" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
    return found


def cached_tokens(reply: dict[str, Any]) -> int | None:
    """The prompt's tokens an OpenAI completion's reply says came from the prefix cache."""
    return ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def group_standby_serve(tier: Tier, model: str) -> None:
    """``HBMD_VLLM_STANDBY`` with ``vllm serve``, as a user deploys it: two servers on two ports of one GPU, the
    standby's port closed until it takes over. The active front end is SIGKILLed with a request in flight; that
    request fails at its client (it does not hang), the active engine core ends with its front end, and the time
    from the kill to the first token of an 8k-prefix request at the standby's port is measured, with the tokens it
    took from the adopted cache and its token against the active engine's."""
    from hbmd.testing.spawn import ended

    tier.start_daemon("--budget", "40GiB")
    env = {"HBMD_VLLM_KEEP_KV": "1", "HBMD_VLLM_ENGINE": "standby-serve",
           "HBMD_VLLM_KV_INDEX_DIR": str(tier.work / "kv-index")}
    args = ("--max-model-len", str(KEEP_PREFIX_LEN + 256), "--enable-prompt-tokens-details")
    long_prompt = prompts(n=1, length=KEEP_PREFIX_LEN, seed=11)[0]
    active = Server(tier, "standby-serve-active", model, 8131, env, *args)
    standby: Server | None = None
    try:
        if not tier.check("standby-serve: the active server answers", active.until_healthy()):
            return
        first = active.complete(long_prompt, 1)
        # Asked again, the prompt's full blocks come from the active engine's own cache: what a standby can serve.
        cacheable = cached_tokens(active.complete(long_prompt, 1))
        standby = Server(tier, "standby-serve-standby", model, 8132, {**env, "HBMD_VLLM_STANDBY": "1"}, *args)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while time.monotonic() < deadline and standby.proc.poll() is None and not standby.said(STANDING_BY):
            time.sleep(0.5)
        tier.check("standby-serve: the standby waits with its port closed",
                   standby.said(STANDING_BY) and not standby.healthy())
        [core] = engine_cores_of(active.proc.pid) or [0]
        tier.figures["standby_serve_footprint_while_waiting"] = {
            "standby_gpu_bytes": sum(gpu_memory_of(pid) for pid in engine_cores_of(standby.proc.pid)),
            "active_gpu_bytes": gpu_memory_of(core)}
        in_flight: dict[str, Any] = {}

        def ask_long() -> None:
            began = time.monotonic()
            try:
                in_flight["reply"] = active.complete(long_prompt[:256], 4000, timeout=120)
            except OSError as exc:
                in_flight["error"] = f"{type(exc).__name__}: {exc}"
            in_flight["seconds"] = time.monotonic() - began

        asking = threading.Thread(target=ask_long)
        asking.start()
        time.sleep(1.0)  # the request is decoding
        killed = time.monotonic()
        os.kill(active.proc.pid, signal.SIGKILL)
        reply: dict[str, Any] = {}
        took_over_s = None  # where the time goes: the engine core's takeover, then the front end's own start
        while time.monotonic() < killed + ENGINE_TIMEOUT_S and standby.proc.poll() is None:
            if took_over_s is None and standby.said(TAKING_OVER):
                took_over_s = round(time.monotonic() - killed, 3)
            try:
                reply = standby.complete(long_prompt, 1)
                break
            except OSError:
                time.sleep(0.01)
        first_token_s = time.monotonic() - killed
        tier.figures["standby_serve_kill_to_takeover_logged_s"] = took_over_s
        asking.join(60)
        core_ended = ended(core)
        cached = cached_tokens(reply)
        tier.figures["standby_serve_kill_to_first_token_s"] = round(first_token_s, 3)
        tier.check("standby-serve: the request in flight at the kill fails at its client, in seconds",
                   "error" in in_flight and in_flight["seconds"] < 60, **in_flight)
        tier.check("standby-serve: the active engine core ended with its front end", core_ended, core=core)
        tier.check("standby-serve: the standby's port serves the 8k prefix from the killed engine's cache, its token "
                   "the active engine's", bool(cacheable) and cached == cacheable and bool(reply.get("choices"))
                   and reply["choices"][0]["text"] == first["choices"][0]["text"],
                   cached=cached, cacheable=cacheable, kill_to_first_token_s=round(first_token_s, 3))
    finally:
        active.stop()
        if standby is not None:
            standby.stop()
        tier.stop_daemon()


def group_standby_big(tier: Tier, model: str) -> None:
    """The standby group with the big model."""
    group_standby(tier, model, tag="standby-big")


GROUPS = {"core": group_core, "sleep": group_sleep, "budget": group_budget, "faults": group_faults,
          "serve": group_serve, "big": group_big, "keep": group_keep,
          "keep-big": group_keep_big, "keep-changes": group_keep_changes, "standby": group_standby,
          "standby-big": group_standby_big, "standby-serve": group_standby_serve}
BIG_MODEL_GROUPS = {"big", "keep-big", "standby-big"}


def tier_main(args: argparse.Namespace) -> int:
    import torch
    import vllm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="hbmd-vllm-"))
    tier = Tier(out, work)
    tier.standby_rounds = args.standby_rounds
    tier.figures["device"] = torch.cuda.get_device_name(0)
    tier.figures["vllm"] = vllm.__version__
    tier.figures["torch"] = torch.__version__
    for name in args.groups.split(","):
        began = time.monotonic()
        try:
            # Each model is made the first time a group needs it (made once per --work folder).
            big = name in BIG_MODEL_GROUPS
            GROUPS[name](tier, str(make_model(work / ("model-big" if big else "model-156m"), big=big)))
        except Exception as exc:  # one broken group must not hide the others' results
            tier.check(f"group {name} ran to its end", False, error=f"{type(exc).__name__}: {exc}")
            tier.stop_daemon()
        tier.figures.setdefault("group_seconds", {})[name] = round(time.monotonic() - began, 1)
        # After every group: a run cut short keeps what it found.
        result = {"checks": tier.checks, "figures": tier.figures, "near_tie": NEAR_TIE,
                  "logprob_tolerance": LOGPROB_TOLERANCE}
        (out / "vllm-tier.json").write_text(json.dumps(result, indent=1))
    passed = sum(c["ok"] for c in tier.checks)
    print(f"vllm tier: {passed} passed, {len(tier.checks) - passed} failed", flush=True)
    return 0 if passed == len(tier.checks) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    engine = sub.add_parser("engine", help="run one engine (the tier runs these)")
    engine.add_argument("spec")
    parser.add_argument("--out", default="bench/results/vllm-tier")
    parser.add_argument("--work", help="folder for models and run directories (default: a new temporary one)")
    parser.add_argument("--standby-rounds", type=int, default=STANDBY_ROUNDS,
                        help=f"takeovers in a row in the standby groups (default {STANDBY_ROUNDS})")
    parser.add_argument("--groups", default="core,sleep,budget,faults,serve",
                        help=f"comma-separated, of {', '.join(GROUPS)}")
    args = parser.parse_args()
    if args.command == "engine":
        engine_main(json.loads(args.spec))
        return 0
    return tier_main(args)


if __name__ == "__main__":
    sys.exit(main())
