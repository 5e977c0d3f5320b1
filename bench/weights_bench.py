"""vLLM's weights in hbmd on a GPU: the storage path of ``--load-format hbmd``, a restart to weights ready, two engines.

vLLM cannot be installed on the GPU machine (no network, its wheel is over
the carry limit), so this drives the loader's storage path itself, with what
the loader gives it: a state dict shaped like a Llama's after vLLM's
``process_weights_after_loading`` (bfloat16, on the GPU), a record shaped as
the loader writes it (vLLM's ``WeightCacheKey`` fields, each tensor's kind),
a claim the size of the budget, ``write_weights``, ``open_weights``. The
tier test (tests/test_vllm_weights.py) runs the same path under vLLM's own
loader and model classes, on the CPU. Three cases, each against its
baseline in the same run:

- **store**: the first engine's store (claim, write, detach, open read-only)
  against a plain device-to-device copy of the same bytes;
- **restart**: a fresh process (Python, torch, CUDA context and all) until
  its weights are on the GPU: from a safetensors checkpoint on local disk
  evicted from the page cache, from the page cache, and mapped from hbmd;
- **share**: device memory two engine processes use holding the model, each
  with its own copy from disk, against both mapping the one copy in hbmd.

``python bench/weights_bench.py --size-gib 8``; writes bench/results/<gpu>-<date>-weights.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, Daemon, GiB, metadata, nvidia_smi, today_utc, write_json

HIDDEN, KV, FFN, VOCAB = 4096, 1024, 14336, 128256
"""Llama 3 8B's shapes."""

ENGINE = r"""
import json, sys, time
import torch
source, where, ready_file = sys.argv[1], sys.argv[2], sys.argv[3]
torch.cuda.init()
torch.zeros(1, device="cuda")  # the CUDA context, as an engine has it before loading weights
start = time.time()
if source == "disk":
    from safetensors.torch import load_file
    tensors = load_file(where, device="cuda:0")
else:
    from hbmd.client.weights import open_weights
    weights = open_weights(where, "cuda:0")
    kinds = weights.meta["kinds"]
    tensors = {n: t if kinds[n] == "param" else t.clone() for n, t in weights.tensors.items()}
torch.cuda.synchronize()
ready = time.time()
total = sum(t.numel() * t.element_size() for t in tensors.values())
# Every tensor's first and last elements, in name order (a checkpoint file lists its tensors sorted).
checksum = sum(tensors[n].reshape(-1)[[0, -1]].float().sum().item() for n in sorted(tensors))
print(json.dumps({"weights_s": ready - start, "ready_at": ready, "bytes": total, "checksum": checksum}), flush=True)
Path = None
open(ready_file, "w").close()
sys.stdin.readline()
"""


def state_dict(size: int) -> dict[str, Any]:
    """Llama-shaped bfloat16 weights on the GPU, as many layers as bring them near ``size`` bytes."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * FFN * HIDDEN + 2 * HIDDEN)
    layers = max(1, (size - 2 * 2 * VOCAB * HIDDEN) // per_layer)
    state = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.qkv_proj.weight": weight(HIDDEN + 2 * KV, HIDDEN),
                  p + "self_attn.o_proj.weight": weight(HIDDEN, HIDDEN),
                  p + "mlp.gate_up_proj.weight": weight(2 * FFN, HIDDEN),
                  p + "mlp.down_proj.weight": weight(HIDDEN, FFN),
                  p + "input_layernorm.weight": weight(HIDDEN),
                  p + "post_attention_layernorm.weight": weight(HIDDEN)}
    state |= {"model.norm.weight": weight(HIDDEN), "lm_head.weight": weight(VOCAB, HIDDEN),
              "model.rotary_emb.cos_sin_cache": weight(8192, 128)}
    return state


def record(state: dict[str, Any]) -> dict[str, Any]:
    """What the loader records beside the tensors: the key's fields and each tensor's kind."""
    key = {"checkpoint": "0" * 64, "model_arch": "LlamaForCausalLM", "tp_size": 1, "tp_rank": 0,
           "dtype": "torch.bfloat16", "quantization": None, "quant_config_hash": "0" * 64,
           "rope_parameters_hash": "0" * 64, "kv_cache_dtype": "auto", "kv_cache_dtype_skip_layers": [],
           "revision": None, "vllm_version": "0.34.0", "pp_size": 1, "pp_rank": 0, "is_draft": False, "dp_size": 1,
           "dp_rank": 0, "enable_expert_parallel": False, "expert_placement_strategy": "linear",
           "moe_backend": "auto", "linear_backend": "auto", "linear_backend_per_quant": []}
    kinds = {n: "buffer" if n.endswith("cos_sin_cache") else "param" for n in state}
    return {"format": "vllm-weights-1", "key": key, "kinds": kinds, "aliases": {}, "attrs": {}}


def store_case(state: dict[str, Any], name: str) -> dict[str, Any]:
    import torch
    from hbmd.client import default_client
    from hbmd.client.tensor import ExtensibleTensor
    from hbmd.client.weights import open_weights, write_weights

    total = sum(t.numel() * t.element_size() for t in state.values())
    client = default_client("cuda:0")
    flat = torch.empty(total, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    offset = 0
    for tensor in state.values():
        size = tensor.numel() * tensor.element_size()
        flat[offset : offset + size].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += size
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    del flat

    start = time.perf_counter()
    claim = ExtensibleTensor(client.status().budget_bytes, "cuda:0", client=client, name=name, persistent=True)
    claimed_s = time.perf_counter() - start
    write_weights(claim, state, record(state))
    torch.cuda.synchronize()
    written_s = time.perf_counter() - start
    claim.detach()
    weights = open_weights(name, "cuda:0", client=client)
    torch.cuda.synchronize()
    stored_s = time.perf_counter() - start
    same = all(torch.equal(weights.tensors[n], t) for n, t in state.items())
    weights.buffer.detach()
    return {
        "bytes": total,
        "tensors": len(state),
        "identical": same,
        "copy_floor_s": round(copy_s, 4),
        "claim_s": round(claimed_s, 4),
        "write_and_seal_s": round(written_s - claimed_s, 4),
        "store_total_s": round(stored_s, 4),
        "store_gbps": round(total / stored_s / 1e9, 1),
        "copy_floor_gbps": round(total / copy_s / 1e9, 1),
        "store_over_copy_floor": round(stored_s / copy_s, 2),
    }


def evict(path: Path) -> None:
    """Drop ``path`` from the page cache, so that the next read comes from the disk."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Engine:
    """An engine process holding the weights from ``source`` until told to go."""

    def __init__(self, source: str, where: str, env: dict[str, str]) -> None:
        self.ready_file = tempfile.mktemp(prefix="hbmdw-")
        self.launched = time.time()
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, source, where, self.ready_file],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def result(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited with {self.proc.wait()}")
        figures = json.loads(line)
        figures["launch_to_ready_s"] = round(figures.pop("ready_at") - self.launched, 3)
        figures["weights_s"] = round(figures["weights_s"], 3)
        return figures

    def stop(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=60)
        os.unlink(self.ready_file)


def restart_case(checkpoint: Path, name: str, env: dict[str, str], rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"disk_cold": [], "disk_cached": [], "hbmd": []}
    for _ in range(rounds):
        for kind, source, where in (("disk_cold", "disk", str(checkpoint)), ("disk_cached", "disk", str(checkpoint)),
                                    ("hbmd", "hbmd", name)):
            if kind == "disk_cold":
                evict(checkpoint)
            engine = Engine(source, where, env)
            runs[kind].append(engine.result())
            engine.stop()
    median = {kind: sorted(r["launch_to_ready_s"] for r in rs)[len(rs) // 2] for kind, rs in runs.items()}
    weights = {kind: sorted(r["weights_s"] for r in rs)[len(rs) // 2] for kind, rs in runs.items()}
    checksums = {kind: {r["checksum"] for r in rs} for kind, rs in runs.items()}
    return {
        "runs": runs,
        "median_launch_to_ready_s": median,
        "median_weights_s": weights,
        "same_weights_everywhere": len(set().union(*checksums.values())) == 1,
        "hbmd_over_disk_cold": round(median["hbmd"] / median["disk_cold"], 3),
        "hbmd_over_disk_cached": round(median["hbmd"] / median["disk_cached"], 3),
    }


def device_used_mib() -> int:
    return int(nvidia_smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0").strip() or -1)


def share_case(checkpoint: Path, name: str, env: dict[str, str], stored_mib: int) -> dict[str, Any]:
    used: dict[str, int] = {}
    for source, where in (("disk", str(checkpoint)), ("hbmd", name)):
        before = device_used_mib()
        engines = [Engine(source, where, env) for _ in range(2)]
        for engine in engines:
            engine.result()
        time.sleep(1)
        used[source] = device_used_mib() - before
        for engine in engines:
            engine.stop()
    # With hbmd the one copy was resident before the engines started: it counts once, beside what they added.
    total = {"disk": used["disk"], "hbmd": used["hbmd"] + stored_mib}
    return {
        "added_by_two_engines_mib": used,
        "weights_in_hbmd_mib": stored_mib,
        "two_engines_total_mib": total,
        "hbmd_over_disk": round(total["hbmd"] / total["disk"], 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=8.0, help="weights size (default 8 GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="restarts of each kind (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"h200-{today_utc()}-weights.json")
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    result: dict[str, Any] = {"bench": "weights", "meta": metadata(), "cases": {}}
    name = "vllm-weights:LlamaForCausalLM:bfloat16:tp0of1:pp0of1:bench"
    with tempfile.TemporaryDirectory(prefix="hbmdw-", dir="/tmp") as scratch:
        with Daemon("--backend", "cuda", "--device", "0") as daemon:
            env = os.environ | {"HBMD_RUN_DIR": str(daemon.run_dir)}
            os.environ["HBMD_RUN_DIR"] = str(daemon.run_dir)
            state = state_dict(int(args.size_gib * GiB))
            result["cases"]["store"] = store_case(state, name)
            print(json.dumps(result["cases"]["store"]), flush=True)
            checkpoint = Path(scratch) / "model.safetensors"
            save_file({n: t.cpu() for n, t in state.items()}, checkpoint)
            del state
            torch.cuda.empty_cache()
            write_json(args.out, result)
            result["cases"]["restart"] = restart_case(checkpoint, name, env, args.rounds)
            print(json.dumps({k: v for k, v in result["cases"]["restart"].items() if k != "runs"}), flush=True)
            write_json(args.out, result)
            result["cases"]["share"] = share_case(checkpoint, name, env, result["cases"]["store"]["bytes"] >> 20)
            print(json.dumps(result["cases"]["share"]), flush=True)
    write_json(args.out, result)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
