"""A real decoder whose KV cache lives in hbmd buffers: serve, crash and resume, sleep and wake, share a GPU.

    python examples/engine.py [--run-dir DIR] MODE [--device cpu|cuda] [--config tiny|gpu] [--start-daemon] [--json] ...

The daemon is found as ``hbmctl`` finds it: under ``--run-dir``, else
``$HBMD_RUN_DIR``, else ``/run/hbmd``. Each engine sizes its KV cache to what
its requests need (a full batch of the longest sequences); ``--kv-share F``
sizes it to F of what the daemon has left instead, as a serving engine's
``--gpu-memory-utilization`` does, and ``--kv-blocks N`` to N blocks.

Modes:

- ``generate``: one engine: warm up on a few KV blocks, size the cache,
  prefill a batch of seeded random prompts and greedy-decode.
  ``--persistent`` names its buffers ``<name>-kv-layerN`` and saves the
  decode state after every step; ``--kill-after K`` SIGKILLs the process
  after K decode steps; ``--resume`` attaches the buffers and the state a
  dead worker left and finishes the request; ``--hold`` keeps the session
  until a line arrives on stdin.
- ``crash-resume``: an uninterrupted run, a run killed halfway, a resumed
  run; are the tokens identical, and how long did resuming take against
  recomputing the prefix?
- ``sleep-wake``: serve a request, release the KV cache's pages (the
  daemon's committed bytes drop), recommit, serve another request and
  compare it with a fresh engine's answer.
- ``sleep-keep``: serve a request halfway, sleep keeping the KV cache in
  the daemon's host tier (the GPU pages go back), decode one step on the
  cache where it lies, wake and finish: the tokens of an undisturbed run,
  and the wake against recomputing the prefix (the daemon needs
  ``--host-budget``; ``--start-daemon`` gives it one as large as
  ``--budget``).
- ``two-engines``: two engines with different models under one daemon. With
  ``--kv-share F`` the first takes F of what fits and the second sizes its
  cache from what the first left. Each declares a tenant, and
  ``--daemon-config FILE`` starts the daemon with a quota file.
- ``make-room``: engine A, of a tenant the daemon may demote, serves a
  request halfway and idles; engine B, another model, wants a cache that
  does not fit beside A's. The daemon has A's client move A's cache to the
  host tier instead of refusing B; B serves and exits; A's cache comes back
  by itself and A finishes. Both engines' tokens against undisturbed runs
  (``--start-daemon`` writes the tenants, ``--tenants``, into a config with
  the first one demotable, and gives the daemon a host tier as large as
  ``--budget``). Each engine sizes its cache to ``--kv-share`` (default 0.6)
  of what fits: two caches that do not fit together are the point.
- ``restart``: a worker restart, from process start to its first generated
  token, with the weights loaded from a checkpoint file on local disk
  (``torch.load``; once evicted from the page cache, once cached) against
  attached from hbmd (sealed weights, read-only views, no copy); same
  tokens?
- ``share-weights``: two engines with their own weights, then two serving
  one model from one copy of its weights in hbmd (committed once, read by
  both, charged to neither), each with the same KV cache: the device memory
  each pair uses, and the same tokens from all four?

``generate --weights file:PATH`` or ``--weights hbmd:NAME`` loads the
weights from a ``torch.save`` checkpoint or from sealed weights in hbmd
(:mod:`hbmd.client.weights`) instead of drawing them from ``--seed``.

``--start-daemon`` starts ``hbmd`` for the run (host backend for ``--device
cpu``, CUDA for ``cuda``) under ``--run-dir``, else in a new temporary run
directory, and stops it at the end; otherwise a daemon must be serving. The
example keeps its own files (decode state, weight checkpoints, a started
daemon's log) in ``--work-dir``, by default ``~/.cache/hbmd-examples``: the
run directory is the daemon's, and in production not the worker's to write.
Progress goes to stderr, a line per phase with its time; the result goes to
stdout as a short summary or, with ``--json``, as one JSON line (the summary
then goes to stderr). The exit status is 1 when a mode's check fails or no
daemon serves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hbmd.client import Client, connect
from hbmd.proto.errors import DaemonUnavailable
from hbmd.proto.instance import RUN_DIR_ENV, resolve_run_dir
from hbmd.proto.units import format_bytes, parse_size
from hbmd.testing.spawn import DaemonProcess, wait_until

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WORKLOADS = {
    # config: (batch, longest prompt, new tokens per sequence)
    "tiny": (4, 40, 24),
    "small": (4, 40, 24),
    "gpu": (8, 2048, 64),
    "gpu-small": (8, 2048, 64),
    "gpu-large": (8, 1024, 32),
}
SECOND_CONFIG = {"tiny": "small", "small": "tiny", "gpu": "gpu-small", "gpu-small": "gpu", "gpu-large": "gpu"}
DEFAULT_BUDGET = {"cpu": "256MiB", "cuda": "50%"}
DEFAULT_MARGIN = {"cpu": "0", "cuda": "1GiB"}


def log(who: str, message: str) -> None:
    print(f"[{who}] {message}", file=sys.stderr, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def default_work_dir() -> Path:
    """``$XDG_CACHE_HOME/hbmd-examples``, else ``~/.cache/hbmd-examples``: the user's own, on a disk (``restart``
    reads a checkpoint from it)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hbmd-examples"


# the daemon


@contextlib.contextmanager
def daemon_for(args: argparse.Namespace) -> Iterator[str | None]:
    """With ``--start-daemon``, an ``hbmd`` subprocess serving the run directory for the block; yields its instance.

    Without ``--run-dir`` it serves a new temporary run directory (short, under
    ``/tmp``: socket paths are limited), removed afterwards, and ``args.run_dir``
    names it for the engines this run starts.
    """
    if not args.start_daemon:
        yield None
        return
    backend = "cuda" if args.device == "cuda" else "host"
    budget = args.budget or DEFAULT_BUDGET[args.device]
    options = ["--backend", backend, "--budget", budget]
    if args.mode in ("sleep-keep", "make-room"):
        options += ["--host-budget", budget]
    if args.daemon_config:
        options += ["--config", str(args.daemon_config)]
    elif args.mode == "make-room":
        options += ["--config", str(demotable_config(args))]
    temporary = args.run_dir is None
    if temporary:
        args.run_dir = Path(tempfile.mkdtemp(prefix="hbmd-", dir="/tmp"))
    if backend == "host":
        # A small pool of the run's own, meant to serve beside any other host daemon (a quick start's): it locks host
        # memory in its run directory, apart from theirs.
        options += ["--device-lock-dir", str(args.run_dir)]
    try:
        start = time.perf_counter()
        daemon = DaemonProcess(args.run_dir, *options, log_path=args.work_dir / "hbmd.log").start()
        try:
            log("daemon", f"hbmd pid {daemon.pid} serves {daemon.instance} under {args.run_dir} ({backend} backend, "
                          f"budget {budget}), started in {ms(time.perf_counter() - start)}; log in {daemon.log_path}")
            yield daemon.instance
        finally:
            daemon.stop()
    finally:
        if temporary:
            shutil.rmtree(args.run_dir, ignore_errors=True)


def connect_for(args: argparse.Namespace, instance: str | None, client_name: str, tenant: str = "") -> Client:
    """A session with the daemon serving ``--device`` under the run directory (``--run-dir``, else
    ``$HBMD_RUN_DIR``, else ``/run/hbmd``, as the client library resolves it)."""
    if instance is not None:
        return connect(run_dir=args.run_dir, instance=instance, client_name=client_name, tenant=tenant)
    # "cuda:0", not "cuda": naming the index keeps an orchestrator from creating a CUDA context just to ask torch.
    return connect(
        "cuda:0" if args.device == "cuda" else "cpu", run_dir=args.run_dir, client_name=client_name, tenant=tenant
    )


# generate: one engine, in this process


def generate(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Serve one batch (or finish a dead worker's batch with ``--resume``); the result as a dict."""
    import torch
    from serving import DecodeState, Engine, config_named, make_prompts

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()  # torch's primary context first: hbmd's client maps into it
    client = connect_for(args, instance, f"engine {args.name}", args.tenant)
    weights_start = time.perf_counter()
    weights = load_weights_from(args.weights, device, client)
    weights_s = time.perf_counter() - weights_start
    state_path = args.work_dir / f"{args.name}.state.json"
    started = time.perf_counter()
    resumed_at = None
    if args.resume:
        load_start = time.perf_counter()
        state = DecodeState.load(state_path)
        state_s = time.perf_counter() - load_start
        engine = Engine(
            client,
            config_named(state.config),
            device,
            weights_seed=state.weights_seed,
            batch_size=state.batch_size,
            name=args.name,
            persistent=True,
            weights=weights,
        )
        engine.resume(state)
        engine.timings["state_s"] = state_s
        engine.timings["resume_s"] = state_s + engine.timings["attach_s"]
        engine.capture()
        resumed_at = state.step
        in_cache = [list(g) for g in state.generated]
        log(args.name, f"resuming at decode step {state.step} of {state.new_tokens - 1}")
    else:
        engine = Engine(
            client,
            config_named(args.config),
            device,
            weights_seed=args.seed,
            batch_size=args.batch,
            name=args.name,
            persistent=args.persistent,
            weights=weights,
        )
        engine.start(args.warmup_blocks, sizing(args))
        prompts = make_prompts(engine.config, args.prompt_seed, args.batch, args.prompt_len)
        state = engine.prefill(prompts, args.prompt_seed, args.prompt_len, args.new_tokens)
        # Wall-clock time, so that the orchestrator measures from before it started this process.
        engine.timings["first_token_at"] = time.time()
    engine.timings["weights_s"] = weights_s

    def checkpoint(state: DecodeState) -> None:
        if engine.persistent:
            state.save(state_path)
        if args.kill_after is not None and state.step == args.kill_after:
            log(args.name, f"SIGKILL after decode step {state.step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if args.announce_step is not None and state.step == args.announce_step:
            print(json.dumps({"decode_step": state.step}), flush=True)
        time.sleep(args.step_delay)

    if not args.resume:
        checkpoint(state)
    engine.decode(state, after_step=checkpoint)
    if resumed_at is not None:
        prompts = make_prompts(engine.config, state.prompt_seed, len(state.prompt_lens), state.prompt_len)
        if [len(p) for p in prompts] != state.prompt_lens:
            raise RuntimeError("the prompts rebuilt from the saved seed differ from the ones served")
        engine.timings["recompute_s"] = engine.time_recompute(prompts, in_cache)
        engine.timings["recompute_tokens"] = sum(len(p) + len(g) - 1 for p, g in zip(prompts, in_cache))
    engine.timings["total_s"] = time.perf_counter() - started
    session = client.sessions(client.session_id)[0]
    result = {
        "mode": "generate",
        "ok": True,
        "engine": args.name,
        "pid": os.getpid(),
        "config": engine.config.name,
        "device": str(device),
        "params": engine.num_params,
        "tenant": session.tenant,
        "batch": len(state.prompt_lens),
        "prompt_lens": state.prompt_lens,
        "new_tokens": state.new_tokens,
        "resumed_at_step": resumed_at,
        "graph": engine.step_fn.graph is not None,
        "tokens": state.generated,
        "kv": engine.kv_summary(),
        "session_committed_bytes": session.committed_bytes,
        "timings": engine.timings,
    }
    if args.hold:
        emit(args, result)
        sys.stdin.readline()
    engine.cache.free()
    if engine.persistent:
        state_path.unlink(missing_ok=True)
    client.close()
    return result


def sizing(args: argparse.Namespace) -> Any:
    """How ``--kv-blocks``, ``--kv-share`` or, by default, the request (``--prompt-len``, ``--new-tokens``) size the
    KV cache."""
    from serving import Sizing

    return Sizing(blocks=args.kv_blocks, share=args.kv_share, request=(args.prompt_len, args.new_tokens),
                  margin_bytes=args.margin, tenant=args.tenant)


def load_weights_from(source: str, device: Any, client: Client) -> dict[str, Any] | None:
    """The state dict ``--weights`` names: None for ``seed`` (drawn by the engine), else a checkpoint's or hbmd's."""
    if source == "seed":
        return None
    kind, _, where = source.partition(":")
    if kind == "file":
        import torch

        return torch.load(where, map_location=device, weights_only=True)
    if kind == "hbmd":
        from hbmd.client.weights import load_weights

        return load_weights(where, device, client=client)
    raise ValueError(f"--weights {source!r}: expected seed, file:PATH or hbmd:NAME")


def summarize_generate(r: dict[str, Any]) -> str:
    kv, t = r["kv"], r["timings"]
    lines = [
        f"engine {r['engine']} ({r['config']}, {r['params'] / 1e6:.1f}M params, {r['device']}, "
        f"decode step {'in a CUDA graph' if r['graph'] else 'eager'}): "
        f"{r['batch']} sequences x {r['new_tokens']} new tokens",
        f"  KV cache ({kv['sized_to']}): {kv['num_blocks']} blocks x {format_bytes(kv['bytes_per_block'])} = "
        f"{format_bytes(kv['physical_bytes'])} "
        f"in {kv['buffers']} hbmd buffers ({kv['segments']} segments, {kv['chunks']} chunks); "
        f"session committed {format_bytes(r['session_committed_bytes'])}",
        f"  decode {t['decode_steps']:.0f} steps in {ms(t['decode_s'])}"
        + (f", prefill {ms(t['prefill_s'])}" if "prefill_s" in t else ""),
    ]
    if r["resumed_at_step"] is not None:
        lines.append(
            f"  resumed at step {r['resumed_at_step']}: setup {ms(t['resume_s'])} (attach {ms(t['attach_s'])}) "
            f"vs recomputing the prefix {ms(t['recompute_s'])} ({t['recompute_tokens']:.0f} tokens)"
        )
    return "\n".join(lines)


# orchestrated modes: engines as subprocesses


def engine_command(args: argparse.Namespace, *extra: str) -> list[str]:
    """The ``generate`` command line for an engine subprocess, with this run's workload options."""
    command = [sys.executable, str(Path(__file__).resolve())]
    if args.run_dir is not None:
        command += ["--run-dir", str(args.run_dir)]
    command += [
        "generate",
        "--json",
        "--work-dir",
        str(args.work_dir),
        "--device",
        args.device,
        "--config",
        args.config,
        "--seed",
        str(args.seed),
        "--prompt-seed",
        str(args.prompt_seed),
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--warmup-blocks",
        str(args.warmup_blocks),
        "--margin",
        str(args.margin),
    ]
    if args.kv_blocks:
        command += ["--kv-blocks", str(args.kv_blocks)]
    if args.kv_share:
        command += ["--kv-share", str(args.kv_share)]
    return command + list(extra)


def run_engine(args: argparse.Namespace, *extra: str, killed: bool = False) -> dict[str, Any] | None:
    """Run an engine to completion (or, with ``killed``, to its SIGKILL); its JSON result."""
    proc = subprocess.run(engine_command(args, *extra), stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    if killed:
        if proc.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the engine was to die of SIGKILL; it exited with {proc.returncode}")
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"engine {' '.join(extra)} exited with {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class HeldEngine:
    """An engine subprocess that serves, reports, then holds its session until released (``generate --hold``)."""

    def __init__(self, args: argparse.Namespace, *extra: str) -> None:
        self.timeout = args.timeout
        self.proc = subprocess.Popen(
            engine_command(args, "--hold", *extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def result(self) -> dict[str, Any]:
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        if not selector.select(self.timeout):
            raise TimeoutError(f"engine pid {self.proc.pid} reported nothing in {self.timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine pid {self.proc.pid} exited with {self.proc.wait(5)} before reporting")
        return json.loads(line)

    def release(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        if self.proc.wait(self.timeout) != 0:
            raise RuntimeError(f"engine pid {self.proc.pid} exited with {self.proc.returncode}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def kv_buffers_of(client: Client, engine: str) -> list:
    from paged_kv import buffer_name

    prefix = buffer_name(engine, 0)[: -len("0")]
    return [b for b in client.buffers() if b.name.startswith(prefix)]


def crash_resume(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Uninterrupted run, a run SIGKILLed after ``--kill-after`` steps, and its resumption: same tokens?"""
    kill_after = args.kill_after if args.kill_after is not None else (args.new_tokens - 1) // 2
    observer = connect_for(args, instance, "crash-resume")
    for stale in kv_buffers_of(observer, args.name):
        log("crash-resume", f"deleting {stale.name}, left by an earlier run")
        observer.delete(stale.name)
    (args.work_dir / f"{args.name}.state.json").unlink(missing_ok=True)

    log("crash-resume", "1/3 uninterrupted reference run")
    reference = run_engine(args, "--name", f"{args.name}-reference")
    log("crash-resume", f"2/3 persistent run, SIGKILLed after {kill_after} decode steps")
    run_engine(args, "--name", args.name, "--persistent", "--kill-after", str(kill_after), killed=True)
    # The daemon ends the session when the dead worker's socket closes; until then the buffers are still attached.
    wait_until(lambda: all(b.session_id == 0 for b in kv_buffers_of(observer, args.name)))
    orphans = kv_buffers_of(observer, args.name)
    log(
        "crash-resume",
        f"the daemon keeps {len(orphans)} orphaned buffers, "
        f"{format_bytes(sum(b.physical_bytes for b in orphans))} committed",
    )
    log("crash-resume", "3/3 a new worker attaches them and resumes")
    resumed = run_engine(args, "--name", args.name, "--resume")
    leftover = kv_buffers_of(observer, args.name)
    observer.close()
    t = resumed["timings"]
    identical = resumed["tokens"] == reference["tokens"]
    return {
        "mode": "crash-resume",
        "ok": identical and resumed["resumed_at_step"] == kill_after and not leftover,
        "tokens_identical": identical,
        "config": reference["config"],
        "device": reference["device"],
        "killed_at_step": resumed["resumed_at_step"],
        "decode_steps": args.new_tokens - 1,
        "orphaned_buffers": len(orphans),
        "orphaned_bytes": sum(b.physical_bytes for b in orphans),
        "resume_s": t["resume_s"],
        "attach_s": t["attach_s"],
        "recompute_s": t["recompute_s"],
        "recompute_tokens": t["recompute_tokens"],
        "saved_s": t["recompute_s"] - t["resume_s"],
        "buffers_left_after": len(leftover),
        "reference": reference,
        "resumed": resumed,
    }


def summarize_crash_resume(r: dict[str, Any]) -> str:
    res = r["resumed"]
    return "\n".join(
        [
            f"crash-resume ({r['config']} on {r['device']}): "
            f"SIGKILL after {r['killed_at_step']} of {r['decode_steps']} decode steps; "
            f"the daemon kept {r['orphaned_buffers']} persistent buffers "
            f"({format_bytes(r['orphaned_bytes'])} committed)",
            f"  tokens identical to an uninterrupted run: {'yes' if r['tokens_identical'] else 'NO'} "
            f"({res['batch']} sequences x {res['new_tokens']} tokens)",
            f"  resume setup {ms(r['resume_s'])} (attach {res['kv']['buffers']} buffers {ms(r['attach_s'])}) "
            f"vs recomputing the prefix "
            f"{ms(r['recompute_s'])} (prefill of {r['recompute_tokens']:.0f} tokens): "
            + (f"{ms(r['saved_s'])} saved" if r["saved_s"] >= 0 else f"{ms(-r['saved_s'])} more than recomputing"),
            f"  bytes committed: {format_bytes(res['kv']['physical_bytes'])} KV cache; "
            f"buffers left after the run: {r['buffers_left_after']}",
        ]
    )


def started_engine(args: argparse.Namespace, instance: str | None) -> tuple[Any, Client, Any]:
    """An engine in this process with its KV cache sized and warmed up: its device, client and itself."""
    import torch
    from serving import Engine, config_named

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()
    client = connect_for(args, instance, f"engine {args.name}", args.tenant)
    engine = Engine(
        client, config_named(args.config), device, weights_seed=args.seed, batch_size=args.batch, name=args.name
    )
    engine.start(args.warmup_blocks, sizing(args))
    return device, client, engine


def sleep_wake(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Serve, release the KV pages, recommit, serve another request; compare it with a fresh engine."""
    from paged_kv import BlockTables
    from serving import make_prompts

    second_seed = args.prompt_seed + 1
    # The fresh run first: it can size its cache freely and is gone before this engine takes its share.
    log("sleep-wake", f"fresh engine serving request B (prompt seed {second_seed}), for comparison")
    fresh = run_engine(args, "--name", f"{args.name}-fresh", "--prompt-seed", str(second_seed))

    device, client, engine = started_engine(args, instance)
    base_ptrs = [view.data_ptr() for view in engine.cache.layers]

    def serve(prompt_seed: int) -> list[list[int]]:
        prompts = make_prompts(engine.config, prompt_seed, args.batch, args.prompt_len)
        return engine.decode(engine.prefill(prompts, prompt_seed, args.prompt_len, args.new_tokens)).generated

    def committed() -> tuple[int, int]:
        mine = client.sessions(client.session_id)[0]
        return client.status().committed_bytes, mine.committed_bytes

    log("sleep-wake", f"request A (prompt seed {args.prompt_seed})")
    serve(args.prompt_seed)
    awake = committed()
    start = time.perf_counter()
    engine.cache.release_physical()
    release_s = time.perf_counter() - start
    asleep = committed()
    log("sleep-wake", f"asleep: daemon committed {format_bytes(awake[0])} -> {format_bytes(asleep[0])}")
    show_hbmctl(args, instance)
    start = time.perf_counter()
    engine.cache.recommit()
    recommit_s = time.perf_counter() - start
    engine.tables = BlockTables(engine.config.block_size, engine.cache.num_blocks)
    rewoken = committed()
    log("sleep-wake", f"awake: {engine.cache.num_blocks} blocks recommitted; request B (prompt seed {second_seed})")
    second = serve(second_seed)
    num_blocks = engine.cache.num_blocks
    same_ptrs = base_ptrs == [view.data_ptr() for view in engine.cache.layers]
    engine.cache.free()
    client.close()
    identical = second == fresh["tokens"]
    return {
        "mode": "sleep-wake",
        "ok": identical and asleep[1] == 0 and rewoken[1] == awake[1] and same_ptrs,
        "tokens_identical": identical,
        **slept_engine(engine, device, same_ptrs, num_blocks),
        "committed_awake_bytes": awake[0],
        "committed_asleep_bytes": asleep[0],
        "committed_rewoken_bytes": rewoken[0],
        "session_awake_bytes": awake[1],
        "session_asleep_bytes": asleep[1],
        "release_s": release_s,
        "recommit_s": recommit_s,
        "tokens": second,
        "fresh_tokens": fresh["tokens"],
    }


class DaemonUnfit(Exception):
    """The daemon serving lacks what a mode needs; the message says what, and how to get a daemon that has it."""


def require_host_tier(args: argparse.Namespace, instance: str | None, config: bool = False) -> None:
    """Raise :class:`DaemonUnfit` at once where the daemon has no host tier (or, with ``config``, no ``--config``),
    rather than after the first engines ran."""
    client = connect_for(args, instance, args.mode)
    try:
        status = client.status()
    finally:
        client.close()
    lacks = []
    if not status.host_budget_bytes:
        lacks.append("a host tier (hbmd --host-budget SIZE)")
    if config and not status.config_path:
        lacks.append("a config with a demotable tenant (hbmd --config FILE)")
    if lacks:
        raise DaemonUnfit(f"{args.mode} needs a daemon with {' and '.join(lacks)}; the daemon of instance "
                          f"{status.instance} has none: pass --start-daemon to start one that has")


def sleep_keep(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Decode halfway, sleep with the KV cache kept in the host tier, one step there, wake, finish; against an
    undisturbed engine's tokens, and the wake against recomputing the prefix."""
    from serving import make_prompts

    require_host_tier(args, instance)

    log("sleep-keep", f"undisturbed engine serving the request (prompt seed {args.prompt_seed}), for comparison")
    undisturbed = run_engine(args, "--name", f"{args.name}-undisturbed")
    device, client, engine = started_engine(args, instance)
    base_ptrs = [view.data_ptr() for view in engine.cache.layers]
    prompts = make_prompts(engine.config, args.prompt_seed, args.batch, args.prompt_len)
    state = engine.prefill(prompts, args.prompt_seed, args.prompt_len, args.new_tokens)
    sleep_at = max(1, (state.new_tokens - 1) // 2)
    seen: dict[str, Any] = {"step_s": []}
    last = [time.perf_counter()]

    def where() -> dict[str, int]:
        status = client.status()
        return {"device": status.committed_bytes, "host": status.host_bytes}

    def after_step(state: Any) -> None:
        now = time.perf_counter()
        seen["step_s"].append(now - last[0])
        if state.step == sleep_at:
            seen["awake"] = where()
            seen["in_cache"] = [list(g) for g in state.generated]
            start = time.perf_counter()
            engine.cache.release_physical(keep=True)
            seen["sleep_s"] = time.perf_counter() - start
            seen["asleep"] = where()
            log("sleep-keep", f"asleep after decode step {state.step}: "
                              f"device {format_bytes(seen['asleep']['device'])}, "
                              f"host tier {format_bytes(seen['asleep']['host'])}; one step on the cache there")
            show_hbmctl(args, instance)
        elif state.step == sleep_at + 1:
            seen["demoted_step_s"] = seen["step_s"][-1]
            start = time.perf_counter()
            engine.cache.recommit()
            seen["wake_s"] = time.perf_counter() - start
            seen["rewoken"] = where()
            log("sleep-keep", f"awake in {ms(seen['wake_s'])}: device {format_bytes(seen['rewoken']['device'])}")
        last[0] = time.perf_counter()

    engine.decode(state, after_step=after_step)
    recompute_s = engine.time_recompute(prompts, seen["in_cache"])
    same_ptrs = base_ptrs == [view.data_ptr() for view in engine.cache.layers]
    num_blocks = engine.cache.num_blocks
    engine.cache.free()
    client.close()
    awake_steps = sorted(t for i, t in enumerate(seen["step_s"]) if i != sleep_at)
    identical = state.generated == undisturbed["tokens"]
    return {
        "mode": "sleep-keep",
        "ok": identical and same_ptrs and seen["asleep"]["device"] == 0
        and seen["asleep"]["host"] == seen["awake"]["device"] == seen["rewoken"]["device"] > 0,
        "tokens_identical": identical,
        **slept_engine(engine, device, same_ptrs, num_blocks),
        "slept_after_step": sleep_at,
        "bytes_awake": seen["awake"],
        "bytes_asleep": seen["asleep"],
        "bytes_rewoken": seen["rewoken"],
        "sleep_s": seen["sleep_s"],
        "wake_s": seen["wake_s"],
        "recompute_prefix_s": recompute_s,
        "recompute_tokens": sum(len(p) + len(g) - 1 for p, g in zip(prompts, seen["in_cache"])),
        "decode_step_s": awake_steps[len(awake_steps) // 2],
        "decode_step_demoted_s": seen["demoted_step_s"],
        "tokens": state.generated,
        "undisturbed_tokens": undisturbed["tokens"],
    }


def show_hbmctl(args: argparse.Namespace, instance: str | None) -> None:
    """What an operator sees meanwhile: ``hbmctl status``, to stderr."""
    command = [sys.executable, "-m", "hbmd.client.ctl"]
    if args.run_dir is not None:
        command += ["--run-dir", str(args.run_dir)]
    if instance is not None:
        command += ["--instance", instance]
    shown = subprocess.run([*command, "status"], capture_output=True, text=True, timeout=60)
    print(shown.stdout + shown.stderr, file=sys.stderr, end="", flush=True)


def slept_engine(engine: Any, device: Any, same_ptrs: bool, num_blocks: int) -> dict[str, Any]:
    """What a sleep mode's result says of the engine that slept: its model, device, decode step, cache and pointers."""
    return {
        "config": engine.config.name,
        "device": str(device),
        "graph": engine.step_fn.graph is not None,
        "base_pointers_kept": same_ptrs,
        "num_blocks": num_blocks,
    }


def engine_line(r: dict[str, Any]) -> str:
    """A sleep mode's first line: the mode, the model, the device, the cache and how the decode step runs."""
    return (f"{r['mode']} ({r['config']} on {r['device']}, {r['num_blocks']} KV blocks, "
            f"decode step {'in a CUDA graph' if r['graph'] else 'eager'})")


def summarize_sleep_wake(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{engine_line(r)}:",
            f"  daemon committed: awake {format_bytes(r['committed_awake_bytes'])}, "
            f"asleep {format_bytes(r['committed_asleep_bytes'])} (release {ms(r['release_s'])}), "
            f"awake again {format_bytes(r['committed_rewoken_bytes'])} (recommit {ms(r['recommit_s'])})",
            f"  base pointers kept: {'yes' if r['base_pointers_kept'] else 'NO'}; "
            f"request B after wake identical to a fresh engine: {'yes' if r['tokens_identical'] else 'NO'}",
        ]
    )


def summarize_sleep_keep(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{engine_line(r)}, asleep after step {r['slept_after_step']}:",
            f"  device/host tier bytes: awake {format_bytes(r['bytes_awake']['device'])}/"
            f"{format_bytes(r['bytes_awake']['host'])}, asleep {format_bytes(r['bytes_asleep']['device'])}/"
            f"{format_bytes(r['bytes_asleep']['host'])} (sleep {ms(r['sleep_s'])}), "
            f"awake again {format_bytes(r['bytes_rewoken']['device'])}",
            f"  wake {ms(r['wake_s'])} against recomputing the {r['recompute_tokens']}-token prefix "
            f"{ms(r['recompute_prefix_s'])}; a decode step {ms(r['decode_step_s'])}, on the demoted cache "
            f"{ms(r['decode_step_demoted_s'])}",
            f"  base pointers kept: {'yes' if r['base_pointers_kept'] else 'NO'}; "
            f"tokens identical to an undisturbed run: {'yes' if r['tokens_identical'] else 'NO'}",
        ]
    )


def two_engines(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Engine A, then engine B (another model) beside it: each sized to its requests, or, with ``--kv-share``, A to
    that share of what fits and B to what A left."""
    second_config = args.second_config or SECOND_CONFIG[args.config]
    tenants = tenant_pair(args)
    batch, prompt_len, new_tokens = WORKLOADS[second_config]
    if args.kv_blocks:
        sized = (f"{args.kv_blocks} blocks", f"{args.kv_blocks} blocks", [])
    elif args.kv_share:
        sized = (f"{args.kv_share:.0%} of what fits", "what is left", ["--kv-share", "1"])
    else:
        sized = ("what its requests need", "what its requests need", [])
    held: list[HeldEngine] = []
    try:
        log("two-engines", f"engine A: {args.config}, tenant {tenants[0]}, takes {sized[0]}")
        held.append(HeldEngine(args, "--name", "engine-a", "--tenant", tenants[0]))
        first = held[0].result()
        log("two-engines", f"engine B: {second_config}, tenant {tenants[1]}, takes {sized[1]}")
        held.append(
            HeldEngine(
                args,
                "--name",
                "engine-b",
                "--tenant",
                tenants[1],
                "--config",
                second_config,
                "--batch",
                str(batch),
                "--prompt-len",
                str(prompt_len),
                "--new-tokens",
                str(new_tokens),
                *sized[2],
            )
        )
        second = held[1].result()
        observer = connect_for(args, instance, "two-engines")
        status = observer.status()
        sessions = [s for s in observer.sessions() if s.pid in (first["pid"], second["pid"])]
        observer.close()
        for engine in held:
            engine.release()
    finally:
        for engine in held:
            engine.kill()
    by_pid = {s.pid: s for s in sessions}
    rows = [
        {
            "engine": r["engine"],
            "config": r["config"],
            "params": r["params"],
            "tenant": by_pid[r["pid"]].tenant,
            "session_id": by_pid[r["pid"]].session_id,
            "committed_bytes": by_pid[r["pid"]].committed_bytes,
            "num_blocks": r["kv"]["num_blocks"],
            "bytes_per_block": r["kv"]["bytes_per_block"],
            "tokens": r["kv"]["tokens"],
            "available_at_sizing": r["kv"]["available_at_sizing"],
        }
        for r in (first, second)
        if r["pid"] in by_pid
    ]
    return {
        "mode": "two-engines",
        "ok": len(rows) == 2 and all(row["committed_bytes"] > 0 for row in rows),
        "device": first["device"],
        "budget_bytes": status.budget_bytes,
        "committed_bytes": status.committed_bytes,
        "sessions": rows,
        "tenants": [
            {
                "name": t.name,
                "used_bytes": t.used_bytes,
                "guaranteed_bytes": t.guaranteed_bytes,
                "max_bytes": t.max_bytes,
            }
            for t in getattr(status, "tenants", None) or []
        ],
        "engines": [first, second],
    }


def demotable_config(args: argparse.Namespace) -> Path:
    """A daemon config naming the two ``--tenants``, the first one demotable under pressure."""
    demotable, other = tenant_pair(args)
    path = args.work_dir / "make-room.toml"
    path.write_text(f'[[tenants]]\nname = "{demotable}"\ndemote = 1\n\n[[tenants]]\nname = "{other}"\n')
    return path


def tenant_pair(args: argparse.Namespace) -> tuple[str, str]:
    tenants = args.tenants.split(",")
    if len(tenants) != 2:
        raise ValueError(f"--tenants takes two names, got {args.tenants!r}")
    return tenants[0], tenants[1]


def make_room(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Engine A serves halfway and idles; B's cache does not fit beside A's, so A's is demoted instead of B refused;
    B serves and exits, A's cache comes back and A finishes; both against undisturbed runs."""
    from hbmd.daemon.state import DEMOTE_IDLE_S
    from serving import make_prompts

    require_host_tier(args, instance, config=True)
    demotable, other = tenant_pair(args)
    second_config = args.second_config or SECOND_CONFIG[args.config]
    batch, prompt_len, new_tokens = WORKLOADS[second_config]
    second = ["--config", second_config, "--batch", str(batch), "--prompt-len", str(prompt_len),
              "--new-tokens", str(new_tokens)]
    log("make-room", f"undisturbed runs, each engine alone taking {args.kv_share:.0%} of what fits: "
                     f"A ({args.config}), B ({second_config})")
    undisturbed_a = run_engine(args, "--name", "a-undisturbed")
    undisturbed_b = run_engine(args, "--name", "b-undisturbed", *second)
    a_args = argparse.Namespace(**{**vars(args), "name": "engine-a", "tenant": demotable,
                                   "kv_blocks": undisturbed_a["kv"]["num_blocks"]})
    device, client, engine = started_engine(a_args, instance)
    observer = connect_for(args, instance, "make-room")
    base_ptrs = [view.data_ptr() for view in engine.cache.layers]
    prompts = make_prompts(engine.config, args.prompt_seed, args.batch, args.prompt_len)
    state = engine.prefill(prompts, args.prompt_seed, args.prompt_len, args.new_tokens)
    pause_at = max(1, (state.new_tokens - 1) // 2)
    seen: dict[str, Any] = {}

    def tiers() -> dict[str, int]:
        """Engine A's tenant's bytes on the device (its leased granules too) and in the host tier."""
        tenants = {t.name: t for t in observer.status().tenants}
        return {"device": tenants[demotable].used_bytes, "host": tenants[demotable].host_bytes}

    def after_step(state: Any) -> None:
        if state.step != pause_at:
            return
        seen["a_before"] = tiers()
        log("make-room", f"engine A idles after decode step {state.step}, its cache "
                         f"{format_bytes(seen['a_before']['device'])} on the device; engine B starts")
        for tensor in engine.cache.tensors:
            tensor.set_idle()  # its client may move it now: nothing of engine A touches it until set_idle(False)
        time.sleep(DEMOTE_IDLE_S + 0.5)  # idle as the daemon counts it: only an idle tenant is demoted
        during: list[dict[str, int]] = []
        watching = threading.Event()
        watcher = threading.Thread(target=watch, args=(during, watching), daemon=True)
        watcher.start()
        start = time.perf_counter()
        seen["b"] = run_engine(args, "--name", "engine-b", "--tenant", other,
                               "--kv-blocks", str(undisturbed_b["kv"]["num_blocks"]), *second)
        seen["b_s"] = time.perf_counter() - start
        watching.set()
        watcher.join()
        during.append(tiers())
        # The daemon demotes as many of A's buffers as B needs, no more: the most that was in the host tier at once.
        seen["a_during_b"] = {"device": min(t["device"] for t in during), "host": max(t["host"] for t in during)}
        log("make-room", f"engine B done in {ms(seen['b_s'])}; up to {format_bytes(seen['a_during_b']['host'])} of "
                         "engine A's cache was in the host tier meanwhile; waiting for it to come back")
        start = time.perf_counter()
        wait_until(lambda: all(t.tier == "device" for t in engine.cache.tensors), timeout=args.timeout)
        seen["back_s"] = time.perf_counter() - start
        for tensor in engine.cache.tensors:
            tensor.set_idle(False)
        seen["a_after"] = tiers()
        log("make-room", f"engine A's cache is back on the device after {ms(seen['back_s'])}; A finishes")

    def watch(during: list[dict[str, int]], watching: threading.Event) -> None:
        while not watching.wait(0.02):
            during.append(tiers())

    engine.decode(state, after_step=after_step)
    same_ptrs = base_ptrs == [view.data_ptr() for view in engine.cache.layers]
    kv_a = engine.cache.physical_bytes
    engine.cache.free()
    client.close()
    budget = observer.status().budget_bytes
    observer.close()
    a_identical = state.generated == undisturbed_a["tokens"]
    b_identical = seen["b"]["tokens"] == undisturbed_b["tokens"]
    return {
        "mode": "make-room",
        "ok": a_identical and b_identical and same_ptrs and 0 < seen["a_during_b"]["host"] <= kv_a
        and seen["a_after"]["host"] == 0 and seen["a_after"]["device"] >= kv_a,
        "tokens_identical": {"a": a_identical, "b": b_identical},
        "config": engine.config.name,
        "second_config": second_config,
        "device": str(device),
        "tenants": [demotable, other],
        "paused_after_step": pause_at,
        "kv_bytes": {"a": kv_a, "b": seen["b"]["kv"]["physical_bytes"]},
        "budget_bytes": budget,
        "a_before": seen["a_before"],
        "a_during_b": seen["a_during_b"],
        "a_after": seen["a_after"],
        "b_s": seen["b_s"],
        "back_s": seen["back_s"],
        "base_pointers_kept": same_ptrs,
        "tokens": {"a": state.generated, "b": seen["b"]["tokens"]},
        "undisturbed_tokens": {"a": undisturbed_a["tokens"], "b": undisturbed_b["tokens"]},
    }


def summarize_make_room(r: dict[str, Any]) -> str:
    a, b = r["kv_bytes"]["a"], r["kv_bytes"]["b"]
    return "\n".join(
        [
            f"make-room ({r['config']} and {r['second_config']} on {r['device']}, budget "
            f"{format_bytes(r['budget_bytes'])}): A's cache {format_bytes(a)} + B's {format_bytes(b)} do not fit",
            f"  engine A ({r['tenants'][0]}, demotable) idle after step {r['paused_after_step']}, its tenant's "
            f"device/host tier bytes: before B {format_bytes(r['a_before']['device'])}/"
            f"{format_bytes(r['a_before']['host'])}, while B served down to {format_bytes(r['a_during_b']['device'])}"
            f"/up to {format_bytes(r['a_during_b']['host'])}, after {format_bytes(r['a_after']['device'])}/"
            f"{format_bytes(r['a_after']['host'])} (back {ms(r['back_s'])} after B exited)",
            f"  engine B ({r['tenants'][1]}) served in {ms(r['b_s'])}, refused nothing; "
            f"tokens identical to undisturbed runs: A {'yes' if r['tokens_identical']['a'] else 'NO'}, "
            f"B {'yes' if r['tokens_identical']['b'] else 'NO'};"
            f" A's base pointers kept: {'yes' if r['base_pointers_kept'] else 'NO'}",
        ]
    )


# weights: a checkpoint on disk or sealed weights in hbmd


@contextlib.contextmanager
def stored_weights(args: argparse.Namespace, instance: str | None, who: str) -> Iterator[tuple[Client, str, Path]]:
    """The ``--seed`` model's weights written once as a checkpoint file and once as sealed weights in hbmd.

    Yields this process's session, the hbmd name and the file; both are
    removed at the end (the engines using them have ended by then).
    """
    import torch
    from decoder import Decoder
    from hbmd.client.weights import store_weights
    from serving import config_named

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.init()
    client = connect_for(args, instance, who)
    name, checkpoint = f"{args.name}-weights", args.work_dir / f"{args.name}.weights.pt"
    if client.buffers(name=name):
        log(who, f"deleting {name}, left by an earlier run")
        client.delete(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Decoder(config_named(args.config), device, dtype, args.seed)
    torch.save(model.state_dict(), checkpoint)
    stored = store_weights(model.state_dict(), name, device, client=client)
    log(who, f"weights: {checkpoint.stat().st_size / 2**20:.1f} MiB checkpoint, "
             f"{format_bytes(stored.physical_bytes)} in hbmd")
    # The weights stay in hbmd, sealed, for the engines to read: this process lets go of them and of its copy.
    stored.detach()
    del model, stored
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        yield client, name, checkpoint
    finally:
        client.delete(name)
        checkpoint.unlink(missing_ok=True)
        client.close()


def evict_from_page_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache, so that the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


RESTART_KINDS = {
    # kind: (where the weights come from, evict the checkpoint from the page cache first)
    "disk": ("file", True),
    "file": ("file", False),
    "hbmd": ("hbmd", False),
}


def restart(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """A worker started from scratch, weights from a checkpoint file (cold and cached) and from hbmd: time to its first
    token.

    Each kind runs twice, interleaved, and the faster run counts, so that
    none gets the operating system's warm caches (Python, torch) alone.
    """
    with stored_weights(args, instance, "restart") as (_client, name, checkpoint):
        sources = {"file": f"file:{checkpoint}", "hbmd": f"hbmd:{name}"}
        checkpoint_bytes = checkpoint.stat().st_size
        runs: dict[str, dict[str, Any]] = {}
        for _ in range(2):
            for kind, (source, evict) in RESTART_KINDS.items():
                if evict:
                    evict_from_page_cache(checkpoint)
                log("restart",
                    f"a worker starts with its weights from {sources[source]}" + (" (not cached)" if evict else ""))
                spawned_at = time.time()
                result = run_engine(args, "--name", f"{args.name}-{kind}", "--weights", sources[source])
                run = {
                    "first_token_s": result["timings"]["first_token_at"] - spawned_at,
                    "weights_s": result["timings"]["weights_s"],
                    "result": result,
                }
                if kind not in runs or run["first_token_s"] < runs[kind]["first_token_s"]:
                    runs[kind] = run
    tokens = [run["result"]["tokens"] for run in runs.values()]
    identical = all(t == tokens[0] for t in tokens)
    first = runs["file"]["result"]
    return {
        "mode": "restart",
        "ok": identical,
        "tokens_identical": identical,
        "config": first["config"],
        "device": first["device"],
        "params": first["params"],
        "checkpoint_bytes": checkpoint_bytes,
        **{kind: {k: v for k, v in run.items() if k != "result"} for kind, run in runs.items()},
    }


def summarize_restart(r: dict[str, Any]) -> str:
    d, f, h = r["disk"], r["file"], r["hbmd"]
    return "\n".join(
        [
            f"restart ({r['config']}, {r['params'] / 1e6:.1f}M params, "
            f"{format_bytes(r['checkpoint_bytes'])} checkpoint, "
            f"{r['device']}): process start to first token",
            f"  weights from a checkpoint on disk:  {ms(d['first_token_s'])} (loading them {ms(d['weights_s'])})",
            f"  weights from the page cache:        {ms(f['first_token_s'])} (loading them {ms(f['weights_s'])})",
            f"  weights attached from hbmd:         {ms(h['first_token_s'])} (attaching them {ms(h['weights_s'])})",
            f"  tokens identical: {'yes' if r['tokens_identical'] else 'NO'}",
        ]
    )


def share_weights(args: argparse.Namespace, instance: str | None) -> dict[str, Any]:
    """Two engines with their own copies of the weights, then two on one copy in hbmd: device memory and tokens.

    Every engine commits the same KV cache (``--kv-blocks``, by default what
    its requests need), so the difference in the device memory the pair uses
    is the weights. The shared copy is committed once, read by both engines
    and charged to neither; all four engines must produce the same tokens.
    """
    import torch

    if args.device == "cuda":
        # This process's own context is made before the baseline, so that it is not counted as the engines'.
        torch.empty(1, device="cuda")
    observer = connect_for(args, instance, "share-weights")

    def pair(kind: str, weights: str) -> tuple[list[dict[str, Any]], Any, list[Any]]:
        """Two engines held at once on ``weights``; their results, the daemon's status and buffers meanwhile."""
        engines: list[HeldEngine] = []
        try:
            results = []
            for i in (1, 2):
                log("share-weights", f"{kind}: engine {i} starts with its weights from {weights}")
                engines.append(HeldEngine(args, "--name", f"{args.name}-{kind}-{i}", "--weights", weights))
                results.append(engines[-1].result())
            held, buffers = observer.status(), observer.buffers()
            for engine in engines:
                engine.release()
        finally:
            for engine in engines:
                engine.kill()
        return results, held, buffers

    baseline = observer.status().device_free_bytes
    own, own_held, _ = pair("own", "seed")
    with stored_weights(args, instance, "share-weights") as (_, name, _):
        shared, shared_held, buffers = pair("shared", f"hbmd:{name}")
    observer.close()
    (weights,) = [b for b in buffers if b.name == name]
    committed = shared_held.committed_bytes
    kv = sum(r["kv"]["physical_bytes"] for r in shared)
    kv_blocks = {r["kv"]["num_blocks"] for r in own + shared}
    uncharged = all(r["session_committed_bytes"] == r["kv"]["physical_bytes"] for r in shared)
    identical = all(r["tokens"] == own[0]["tokens"] for r in own + shared)
    return {
        "mode": "share-weights",
        "ok": identical and uncharged and weights.readers == 2 and committed == weights.physical_bytes + kv
        and len(kv_blocks) == 1,
        "tokens_identical": identical,
        "config": shared[0]["config"],
        "device": shared[0]["device"],
        "params": shared[0]["params"],
        "kv_blocks": max(kv_blocks),
        "weights_bytes": weights.physical_bytes,
        "readers": weights.readers,
        "kv_bytes": kv,
        "committed_bytes": committed,
        "engines_charged_for_weights": not uncharged,
        "attach_s": [r["timings"]["weights_s"] for r in shared],
        "device_used_bytes": {
            "own": baseline - own_held.device_free_bytes,
            "shared": baseline - shared_held.device_free_bytes,
        },
    }


def summarize_share_weights(r: dict[str, Any]) -> str:
    used = r["device_used_bytes"]
    saved = used["own"] - used["shared"]
    # On the host backend "device memory" is the machine's free RAM, which other processes move as much.
    saving = f"saved {format_bytes(saved)}" if saved >= 0 else f"{format_bytes(-saved)} more"
    return "\n".join(
        [
            f"share-weights ({r['config']}, {r['params'] / 1e6:.1f}M params, {r['device']}): "
            f"two engines, {r['kv_blocks']} KV blocks each",
            f"  device memory used by the pair: own weights {format_bytes(used['own'])}, "
            f"shared weights {format_bytes(used['shared'])} ({saving})",
            f"  weights {format_bytes(r['weights_bytes'])} committed once, read by {r['readers']} engines "
            f"(attached in {', '.join(ms(s) for s in r['attach_s'])}); KV caches {format_bytes(r['kv_bytes'])}; "
            f"daemon committed {format_bytes(r['committed_bytes'])}",
            f"  engines charged for the weights: {'YES' if r['engines_charged_for_weights'] else 'no'}; "
            f"tokens identical in all four engines: {'yes' if r['tokens_identical'] else 'NO'}",
        ]
    )


def summarize_two_engines(r: dict[str, Any]) -> str:
    lines = [
        f"two engines under one daemon on {r['device']} (budget {format_bytes(r['budget_bytes'])}, "
        f"committed {format_bytes(r['committed_bytes'])}):"
    ]
    for row in r["sessions"]:
        lines.append(
            f"  session {row['session_id']} {row['engine']} "
            f"({row['config']}, {row['params'] / 1e6:.1f}M params, tenant {row['tenant']}): "
            f"{row['num_blocks']} blocks x {format_bytes(row['bytes_per_block'])} = {row['tokens']} tokens, "
            f"committed {format_bytes(row['committed_bytes'])} "
            f"(saw {format_bytes(row['available_at_sizing'])} left after warm-up)"
        )
    for t in r["tenants"]:
        limit = f", max {format_bytes(t['max_bytes'])}" if t["max_bytes"] >= 0 else ""
        lines.append(
            f"  tenant {t['name']}: uses {format_bytes(t['used_bytes'])}, "
            f"guaranteed {format_bytes(t['guaranteed_bytes'])}{limit}"
        )
    return "\n".join(lines)


MODES = {
    "generate": (generate, summarize_generate),
    "crash-resume": (crash_resume, summarize_crash_resume),
    "sleep-wake": (sleep_wake, summarize_sleep_wake),
    "sleep-keep": (sleep_keep, summarize_sleep_keep),
    "two-engines": (two_engines, summarize_two_engines),
    "make-room": (make_room, summarize_make_room),
    "restart": (restart, summarize_restart),
    "share-weights": (share_weights, summarize_share_weights),
}


def emit(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The summary on stdout; with ``--json`` the JSON line there instead, and the summary with the progress on
    stderr."""
    summary = MODES[result["mode"]][1](result)
    if args.json:
        print(summary, file=sys.stderr, flush=True)
        print(json.dumps(result), flush=True)
    else:
        print(summary, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="the daemon's run directory (default: $HBMD_RUN_DIR, else /run/hbmd; with --start-daemon a new "
        "temporary one)",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    common.add_argument(
        "--config",
        help="model config: tiny, small (CPU), gpu, gpu-small, gpu-large (4.9 GiB of weights); "
             "default tiny on cpu, gpu on cuda",
    )
    common.add_argument("--seed", type=int, default=0, help="weights seed")
    common.add_argument("--prompt-seed", type=int, default=1)
    common.add_argument("--batch", type=int, help="sequences per request (the decode batch)")
    common.add_argument("--prompt-len", type=int, help="longest prompt; lengths are drawn from [len/2, len]")
    common.add_argument("--new-tokens", type=int, help="tokens generated per sequence (the prefill's one included)")
    common.add_argument("--warmup-blocks", type=int, default=4, help="KV blocks committed for warm-up")
    common.add_argument(
        "--margin", help="with --kv-share, bytes left free when sizing the KV cache (default: 0 on cpu, 1GiB on cuda)"
    )
    common.add_argument(
        "--kv-share",
        type=float,
        metavar="F",
        help="size the KV cache to the budget: commit F of what fits, as --gpu-memory-utilization does (default: "
        "to what the requests need; make-room: 0.6; two-engines: A takes F, B what A left)",
    )
    common.add_argument(
        "--kv-blocks",
        type=int,
        metavar="N",
        help="commit N KV blocks, over --kv-share and what the requests need",
    )
    common.add_argument(
        "--name", default="engine", help="engine name: labels, persistent buffer names <name>-kv-layerN"
    )
    common.add_argument("--tenant", default="", help="tenant declared to the daemon (quota accounting)")
    common.add_argument("--kill-after", type=int, metavar="K", help="SIGKILL this process after K decode steps")
    common.add_argument("--announce-step", type=int, metavar="K",
                        help='print {"decode_step": K} after K decode steps, and go on (to restart the daemon then)')
    common.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                        help="sleep S seconds after each decode step: a slower engine, for demonstrations")
    common.add_argument(
        "--json", action="store_true", help="print one JSON line on stdout (the summary goes to stderr)"
    )
    common.add_argument("--start-daemon", action="store_true",
                        help="start hbmd for this run, under --run-dir or a new temporary run directory")
    common.add_argument("--work-dir", type=Path, default=default_work_dir(),
                        help="where the example keeps its files: decode state, weight checkpoints, a started "
                        "daemon's log (default: %(default)s)")
    common.add_argument("--budget", help="the started daemon's --budget (default: 256MiB on cpu, 50%% on cuda)")
    common.add_argument(
        "--daemon-config", type=Path, metavar="FILE", help="the started daemon's --config (tenant quotas, TOML)"
    )
    common.add_argument("--timeout", type=float, default=300.0, help="seconds an engine subprocess may take")
    common.add_argument(
        "--weights", default="seed", help="seed (drawn from --seed), file:PATH (a torch.save checkpoint) or hbmd:NAME"
    )
    modes = parser.add_subparsers(dest="mode", required=True)
    gen = modes.add_parser("generate", parents=[common], help="one engine serves a batch")
    gen.add_argument(
        "--persistent", action="store_true", help="persistent named buffers and a state file saved every step"
    )
    gen.add_argument(
        "--resume", action="store_true", help="attach the buffers and state a dead worker left, and finish"
    )
    gen.add_argument("--hold", action="store_true", help="after reporting, keep the session until a line on stdin")
    modes.add_parser("crash-resume", parents=[common], help="kill a worker halfway, resume it, compare")
    modes.add_parser("sleep-wake", parents=[common], help="release and recommit the KV cache between requests")
    modes.add_parser("sleep-keep", parents=[common], help="sleep mid-request with the KV cache kept in host memory")
    two = modes.add_parser("two-engines", parents=[common], help="two models under one daemon")
    two.add_argument("--second-config", help="engine B's model (default: small for tiny, gpu-small for gpu)")
    two.add_argument("--tenants", default="engine-a,engine-b", help="the two engines' tenant names")
    room = modes.add_parser("make-room", parents=[common],
                            help="an idle engine's cache demoted to make room for another")
    room.add_argument("--second-config", help="engine B's model (default: small for tiny, gpu-small for gpu)")
    room.add_argument("--tenants", default="batch,online",
                      help="A's tenant (demotable) and B's, named in the started daemon's config")
    modes.add_parser("restart", parents=[common], help="process start to first token: weights from a file or hbmd")
    modes.add_parser("share-weights", parents=[common], help="two engines on one copy of the weights in hbmd")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.config = args.config or ("gpu" if args.device == "cuda" else "tiny")
    if args.config not in WORKLOADS:
        parser.error(f"--config: unknown model {args.config!r}; choose from {', '.join(WORKLOADS)}")
    batch, prompt_len, new_tokens = WORKLOADS[args.config]
    args.batch = args.batch or batch
    args.prompt_len = args.prompt_len or prompt_len
    args.new_tokens = args.new_tokens or new_tokens
    try:
        args.margin = parse_size(args.margin or DEFAULT_MARGIN[args.device])
    except ValueError as exc:
        parser.error(f"--margin: {exc}")
    # Not set_defaults on the make-room parser: the options' actions are shared by every mode through `common`.
    args.kv_share = args.kv_share or {"make-room": 0.6}.get(args.mode)
    if args.kv_share is not None and not 0 < args.kv_share <= 1:
        parser.error("--kv-share must be in (0, 1]")
    if args.mode == "share-weights" and args.kv_share is not None:
        parser.error("share-weights compares engines with equal KV caches: --kv-blocks, not --kv-share")
    if args.kill_after is not None and not 0 <= args.kill_after < args.new_tokens - 1:
        parser.error(f"--kill-after must be below the {args.new_tokens - 1} decode steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run, _ = MODES[args.mode]
    args.work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    who = args.name if args.mode == "generate" else args.mode
    started = time.perf_counter()
    if not args.start_daemon:
        origin = "--run-dir" if args.run_dir else f"${RUN_DIR_ENV}" if os.environ.get(RUN_DIR_ENV) else "the default"
        log(who, f"{args.mode} with the daemon under {resolve_run_dir(args.run_dir)} ({origin})")
    try:
        with daemon_for(args) as instance:
            result = run(args, instance)
    except (DaemonUnavailable, DaemonUnfit) as exc:
        log(who, str(exc))
        return 1
    if not (args.mode == "generate" and args.hold):
        emit(args, result)
    log(who, f"done in {time.perf_counter() - started:.1f} s")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
