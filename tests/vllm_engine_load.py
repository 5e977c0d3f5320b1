"""One vLLM engine's model load, run by tests/test_vllm_weights.py as a process of its own.

vLLM's own configuration, parallel state, plugin loading and model loader,
on the CPU: ``python vllm_engine_load.py MODEL_DIR LOAD_FORMAT EXTRA_CONFIG_JSON``
prints one JSON line saying where the weights came from, what vLLM was told
was held outside the engine, how many times a weights file was opened, a
digest of every tensor and whether every parameter is a view of the sealed
buffer. ``HBMD_TEST_SEAL_DELAY`` holds the seal back that many seconds,
``HBMD_TEST_DIE_BEFORE_SEAL`` kills the process there instead, and
``HBMD_TEST_TOUCH_ON_READ`` moves a weights file's modification time a
second on each time it is opened, as a rewrite during the load would, and
``HBMD_TEST_FAIL`` makes hbmd's loader fail once a model is built:
``quant_check`` in vLLM's quantization check of the model read from disk
(an import error, as once seen), ``build`` after the model over the sealed
buffer is built.

vLLM on a machine with no accelerator needs two things this load never uses
set aside, and nothing else: its CPU platform refuses x86 without triton-cpu
(vllm/platforms/cpu.py, check_and_update_config), and model loading empties
and indexes the accelerator's memory (torch.accelerator.empty_cache,
current_device_index), which raises where there is none.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time

import torch
import vllm.triton_utils

vllm.triton_utils.HAS_TRITON = True
torch.accelerator.empty_cache = lambda: None
torch.accelerator.current_device_index = lambda: 0

from hbmd.client.tensor import ExtensibleTensor  # noqa: E402
from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.logger import configure_logging  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader, weight_utils  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

opened: list[str] = []


def counted(read):
    def read_counted(path, *args, **kwargs):
        opened.append(str(path))
        if os.environ.get("HBMD_TEST_TOUCH_ON_READ"):
            stat = os.stat(path)
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        return read(path, *args, **kwargs)

    return read_counted


for reader in ("safe_open", "load_file", "load"):
    setattr(weight_utils, reader, counted(getattr(weight_utils, reader)))

seal = ExtensibleTensor.seal


def held_back_seal(self):
    if os.environ.get("HBMD_TEST_DIE_BEFORE_SEAL"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("HBMD_TEST_SEAL_DELAY", "0")))
    return seal(self)


ExtensibleTensor.seal = held_back_seal


def digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        hasher.update(name.encode() + str(tensor.dtype).encode() + str(tuple(tensor.shape)).encode())
        hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def fail_after_building() -> None:
    """Make hbmd's loader fail as ``HBMD_TEST_FAIL`` says, after a model was built (see the module's docstring)."""
    from hbmd.integrations import vllm_weights

    failing = os.environ.get("HBMD_TEST_FAIL")
    if failing == "quant_check":
        def check(model):
            raise ImportError("cannot import name 'QuantizeMethodBase' (a stand-in)")

        vllm_weights.check_ipc_quant_support = check
    elif failing == "build":
        build = vllm_weights.HbmdModelLoader._build_model

        def build_then_fail(self, *args, **kwargs):
            build(self, *args, **kwargs)
            raise RuntimeError("failed after the model was built (a stand-in)")

        vllm_weights.HbmdModelLoader._build_model = build_then_fail


def main() -> None:
    model_dir, load_format, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    load_general_plugins()
    fail_after_building()
    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True),
        device_config=DeviceConfig(device="cpu"),
        load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra),
    )
    configure_logging(config.logging_config)  # as vLLM's engine core does in each process it starts
    rendezvous = tempfile.mktemp(prefix="hbmd-vllm-")
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}")
        initialize_model_parallel(1, 1)
        loader = get_model_loader(config.load_config)
        external = loader.get_external_weight_memory(config)
        started = time.perf_counter()
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
        seconds = time.perf_counter() - started
    weights = getattr(loader, "weights", None)
    views = None
    if weights is not None:
        low, high = weights.buffer.base_ptr, weights.buffer.base_ptr + weights.buffer.num_bytes
        views = all(low <= p.data_ptr() < high for p in model.parameters())
    print(json.dumps({
        "loader": type(loader).__name__,
        "source": getattr(loader, "source", "disk"),
        "name": weights.buffer.name if weights else "",
        "external_bytes": external,
        "files_opened": len(opened),
        "digest": digest(model),
        "views": views,
        "load_s": seconds,
    }), flush=True)


if __name__ == "__main__":
    main()
