"""vLLM 0.34 loads its weights from hbmd (issue #26): ``--load-format hbmd``, on the host backend.

Each engine is a process of its own (tests/vllm_engine_load.py) running
vLLM's own configuration, plugin loading, parallel state, model loader and
Llama model classes over a tiny checkpoint this test writes (random
weights, safetensors). Needs vLLM 0.34 installed (integrations/README.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import torch

pytest.importorskip("vllm.model_executor.model_loader.weight_cache.ipc_loader", reason="vLLM is not installed")
safetensors = pytest.importorskip("safetensors.torch")
from hbmd.client import ExtensibleTensor, InvalidRequest  # noqa: E402
from hbmd.client.weights import load_weights, open_weights, store_weights  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.ipc, pytest.mark.torch]

ENGINE = Path(__file__).with_name("vllm_engine_load.py")
HIDDEN, LAYERS, VOCAB = 64, 2, 256


def write_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A two-layer Llama in vLLM's expected layout: config.json and one safetensors file of random weights."""
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "tie_word_embeddings": False, "rope_theta": 10000.0,
    }
    (directory / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
             "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
             "model.norm.weight": torch.rand(HIDDEN, generator=g)}
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN // 2, HIDDEN),
              "self_attn.v_proj": (HIDDEN // 2, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (2 * HIDDEN, HIDDEN), "mlp.up_proj": (2 * HIDDEN, HIDDEN),
              "mlp.down_proj": (HIDDEN, 2 * HIDDEN)}
    for layer in range(LAYERS):
        for part, shape in shapes.items():
            state[f"model.layers.{layer}.{part}.weight"] = torch.randn(*shape, generator=g)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{layer}.{norm}.weight"] = torch.rand(HIDDEN, generator=g)
    safetensors.save_file(state, directory / "model.safetensors")
    return directory


def header(checkpoint: Path) -> bytes:
    """The safetensors header of the checkpoint's weight file: all vLLM's key knows of its bytes."""
    data = (checkpoint / "model.safetensors").read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


def copied_keeping_times(checkpoint: Path, source: Path) -> Path:
    """``source``'s weight file put in place of ``checkpoint``'s as ``cp -p`` and ``rsync -a`` put one (written beside
    it, times copied, renamed over it), its size and modification time those of the file it replaces."""
    path = checkpoint / "model.safetensors"
    before = path.stat()
    staged = checkpoint / ".model.safetensors.tmp"
    staged.write_bytes((source / "model.safetensors").read_bytes())
    os.utime(staged, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(staged, path)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    return checkpoint


def zeroed_in_place(checkpoint: Path) -> Path:
    """The checkpoint with every weight byte zeroed in place, its size and modification time put back: only its
    change time tells (``touch`` cannot set that)."""
    path = checkpoint / "model.safetensors"
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[len(header(checkpoint)):] = bytes(len(data) - len(header(checkpoint)))
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return checkpoint


@pytest.fixture
def checkpoint(tmp_path):
    return write_checkpoint(tmp_path / "a" / "tiny-llama")


@pytest.fixture
def engine(daemon):
    """Start one engine's load: ``engine(checkpoint, load_format="hbmd", extra=None, **env).wait()``."""
    started: list[subprocess.Popen] = []

    def start(checkpoint: Path, load_format: str = "hbmd", extra: dict | None = None, **env: str) -> Engine:
        environ = {k: v for k, v in os.environ.items() if k not in ("HBMD_VLLM", "VLLM_PLUGINS")}
        environ |= {"HBMD_RUN_DIR": str(daemon.run_dir), "HBMD_VLLM": "1", "VLLM_TARGET_DEVICE": "cpu"} | env
        args = [sys.executable, str(ENGINE), str(checkpoint), load_format, json.dumps(extra or {})]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
        started.append(proc)
        return Engine(proc)

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


class Engine:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def wait(self, ok: bool = True) -> dict:
        """The engine's report; ``ok=False``: it is expected to fail. ``log`` is then its output (vLLM logs to
        stdout, Python's last resort and tracebacks to stderr)."""
        out, err = self.proc.communicate(timeout=300)
        self.log = out + err
        if ok:
            assert self.proc.returncode == 0, self.log[-6000:]
            return json.loads(out.strip().splitlines()[-1])
        return {}


def weights_buffers(client):
    return [b for b in client.buffers() if b.name.startswith("vllm-weights:")]


def test_the_loader_is_vllms_load_format_hbmd_only_with_the_opt_in(daemon):
    code = ("from vllm.plugins import load_general_plugins\nload_general_plugins()\n"
            "from vllm.config.load import LoadConfig\nfrom vllm.model_executor.model_loader import get_model_loader\n"
            "try:\n    print(type(get_model_loader(LoadConfig(load_format='hbmd'))).__name__)\n"
            "except ValueError as exc:\n    print('refused:', exc)\n")
    environ = {k: v for k, v in os.environ.items() if k not in ("HBMD_VLLM", "VLLM_PLUGINS")}
    runs = {opt_in: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                   env=environ | ({"HBMD_VLLM": "1"} if opt_in else {}))
            for opt_in in (True, False)}
    assert runs[True].stdout.strip().splitlines()[-1] == "HbmdModelLoader", runs[True].stderr[-3000:]
    assert runs[False].stdout.strip().splitlines()[-1].startswith("refused:"), runs[False].stderr[-3000:]


def test_the_first_engine_stores_and_a_later_one_maps_without_reading_the_checkpoint(engine, checkpoint, client):
    disk = engine(checkpoint, load_format="auto").wait()
    assert disk["files_opened"] >= 1

    first = engine(checkpoint).wait()
    assert first["source"] == "stored" and first["views"] and first["digest"] == disk["digest"]
    assert first["external_bytes"] == 0  # nothing resident yet: vLLM's profile counts what this engine stores
    (stored,) = weights_buffers(client)
    assert stored.name == first["name"] and stored.sealed and stored.session_id == 0 and stored.readers == 0
    assert stored.name.startswith("vllm-weights:LlamaForCausalLM:tiny-llama:float32:tp0of1:pp0of1:")
    recorded = open_weights(stored.name, "cpu", client=client)
    assert recorded.meta["format"] == "vllm-weights-1" and recorded.meta["key"]["model_arch"] == "LlamaForCausalLM"
    assert recorded.meta["kinds"]["lm_head.weight"] == "param"
    assert recorded.meta["key"]["weights_dir"] == str(checkpoint.resolve())
    assert [(f["name"], f["size"]) for f in recorded.meta["key"]["weights_files"]] == [
        ("model.safetensors", (checkpoint / "model.safetensors").stat().st_size)]
    recorded.buffer.detach()

    later = engine(checkpoint).wait()
    assert later["source"] == "mapped" and later["name"] == stored.name
    assert later["files_opened"] == 0, "a later engine read the checkpoint"
    assert later["digest"] == disk["digest"] and later["views"]
    assert later["external_bytes"] == stored.physical_bytes


def test_a_checkpoint_of_the_same_shapes_in_another_folder_is_never_served_the_first_ones_weights(engine, checkpoint,
                                                                                                  client, tmp_path):
    """A fine-tune beside its base model: the same tensor names, shapes and safetensors headers, so the same vLLM
    key; hbmd's key tells them apart by their files."""
    tuned = write_checkpoint(tmp_path / "b" / "tiny-llama", seed=1)
    assert header(tuned) == header(checkpoint)
    tuned_from_disk = engine(tuned, load_format="auto").wait()
    base = engine(checkpoint).wait()
    assert base["source"] == "stored" and base["digest"] != tuned_from_disk["digest"]

    served = engine(tuned).wait()
    assert served["source"] == "stored" and served["name"] != base["name"]
    assert served["digest"] == tuned_from_disk["digest"], "the fine-tune was served the base model's weights"
    assert len(weights_buffers(client)) == 2


def test_a_checkpoint_overwritten_in_place_is_served_its_new_bytes(engine, checkpoint, client, tmp_path):
    first = engine(checkpoint).wait()
    assert first["source"] == "stored"
    path = checkpoint / "model.safetensors"
    before = path.stat()
    path.write_bytes((write_checkpoint(tmp_path / "new", seed=1) / "model.safetensors").read_bytes())
    # As a write a second later stamps it, whatever the file system's clock granularity.
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == before.st_size
    new_from_disk = engine(checkpoint, load_format="auto").wait()
    assert new_from_disk["digest"] != first["digest"]

    after = engine(checkpoint)
    served = after.wait()
    assert served["source"] == "stored" and served["name"] != first["name"]
    assert served["digest"] == new_from_disk["digest"], "the overwritten checkpoint's old bytes were served"
    mapped = engine(checkpoint).wait()
    assert mapped["source"] == "mapped" and mapped["name"] == served["name"] and mapped["files_opened"] == 0
    assert mapped["digest"] == new_from_disk["digest"]


@pytest.mark.parametrize("replace", ["cp -p", "zeroed in place"])
def test_a_checkpoint_replaced_keeping_its_size_and_modification_time_is_served_its_new_bytes(
        engine, checkpoint, client, tmp_path, replace):
    first = engine(checkpoint).wait()
    assert first["source"] == "stored"
    if replace == "cp -p":
        copied_keeping_times(checkpoint, write_checkpoint(tmp_path / "tuned", seed=1))
    else:
        zeroed_in_place(checkpoint)
    new_from_disk = engine(checkpoint, load_format="auto").wait()
    assert new_from_disk["digest"] != first["digest"]

    later = engine(checkpoint)
    served = later.wait()
    assert served["source"] == "stored" and served["name"] != first["name"], "the replaced checkpoint was mapped"
    assert served["digest"] == new_from_disk["digest"]
    assert "tiny-llama" in served["name"]


def test_a_failure_after_the_model_is_built_falls_back_to_disk_without_building_the_same_layers_twice(
        engine, checkpoint, client):
    """As an import error inside vLLM's quantization check once did: the engine serves from disk, never dies with
    "Duplicate layer name"."""
    disk = engine(checkpoint, load_format="auto").wait()
    storing = engine(checkpoint, HBMD_TEST_FAIL="quant_check")
    stored = storing.wait()
    assert stored["source"] == "disk" and stored["digest"] == disk["digest"] and stored["files_opened"] == 1
    assert "not stored in hbmd (" in storing.log and weights_buffers(client) == []

    assert engine(checkpoint).wait()["source"] == "stored"
    mapping = engine(checkpoint, HBMD_TEST_FAIL="build")
    mapped = mapping.wait()
    assert mapped["source"] == "disk" and mapped["digest"] == disk["digest"]
    assert "loading them from disk" in mapping.log and "Duplicate layer name" not in mapping.log


def test_a_checkpoint_that_changes_while_the_storer_reads_it_is_not_stored(engine, checkpoint, client):
    changing = engine(checkpoint, HBMD_TEST_TOUCH_ON_READ="1")
    result = changing.wait()
    assert result["source"] == "disk" and result["files_opened"] >= 1
    assert "not stored in hbmd (its weight files changed while this engine read them: model.safetensors: mtime_ns" \
        in changing.log
    assert weights_buffers(client) == []


def test_a_weights_name_another_process_holds_unsealed_is_not_waited_for(engine, checkpoint, client):
    """A process of the same user takes the name and never seals it: the engine loads from disk at once and says
    who holds the name, instead of waiting ``wait_s`` for a seal that is not coming."""
    disk = engine(checkpoint, load_format="auto").wait()
    name = engine(checkpoint).wait()["name"]
    client.delete(name)
    squatter = ExtensibleTensor(2 << 20, "cpu", client=client, name=name, persistent=True)

    blocked = engine(checkpoint, extra={"wait_s": 60})
    result = blocked.wait()
    assert result["source"] == "disk" and result["digest"] == disk["digest"]
    assert result["load_s"] < 20, "the engine waited for a name nobody was storing"
    holder = f"session {client.session_id} (pid {os.getpid()}, uid {os.getuid()}, client 'test')"
    assert f"{name} is held unsealed by {holder}" in blocked.log
    assert "loading them from disk" in blocked.log
    assert [b.session_id for b in weights_buffers(client)] == [client.session_id]
    squatter.free()


def test_two_engines_starting_together_read_the_checkpoint_once(engine, checkpoint, client):
    disk = engine(checkpoint, load_format="auto").wait()
    # The first to claim the name holds its seal back 3 s, so the other surely finds it being stored.
    engines = [engine(checkpoint, HBMD_TEST_SEAL_DELAY="3") for _ in range(2)]
    results = [e.wait() for e in engines]
    assert sorted(r["source"] for r in results) == ["mapped", "stored"]
    assert all(r["digest"] == disk["digest"] and r["views"] for r in results)
    waiter = engines[[r["source"] for r in results].index("mapped")]
    assert re.search(r"waiting up to \d+ s for session \d+ \(pid", waiter.log)
    assert [r["files_opened"] > 0 for r in results] == [r["source"] == "stored" for r in results]
    assert len(weights_buffers(client)) == 1


def test_an_engine_killed_while_storing_leaves_nothing_to_read_and_the_next_stores(engine, checkpoint, client):
    disk = engine(checkpoint, load_format="auto").wait()
    dying = engine(checkpoint, HBMD_TEST_DIE_BEFORE_SEAL="1")
    dying.wait(ok=False)
    assert dying.proc.returncode == -9
    (half,) = weights_buffers(client)
    assert not half.sealed
    with pytest.raises(InvalidRequest, match="not sealed"):
        load_weights(half.name, "cpu", client=client)

    next_engine = engine(checkpoint)
    after = next_engine.wait()
    assert after["source"] == "stored" and after["digest"] == disk["digest"]
    assert "deleting what an engine that died while storing them left" in next_engine.log
    (whole,) = weights_buffers(client)
    assert whole.sealed and whole.name == half.name


def restored_with_key_field(client, name: str, field: str, value) -> None:
    """Store the weights ``name`` again with one field of the recorded key changed, as another vLLM would have."""
    weights = open_weights(name, "cpu", client=client)
    tensors = {n: t.clone() for n, t in weights.tensors.items()}
    meta = dict(weights.meta)
    meta["key"] = dict(meta["key"]) | {field: value}
    weights.buffer.detach()
    client.delete(name)
    store_weights(tensors, name, "cpu", client=client, meta=meta).detach()


def test_weights_stored_for_another_configuration_are_not_used(engine, checkpoint, client):
    disk = engine(checkpoint, load_format="auto").wait()
    name = engine(checkpoint).wait()["name"]
    restored_with_key_field(client, name, "vllm_version", "0.33.0")

    fallen_back = engine(checkpoint)
    result = fallen_back.wait()
    assert result["source"] == "disk" and result["files_opened"] >= 1 and result["digest"] == disk["digest"]
    assert "stored for another configuration: vllm_version differ" in fallen_back.log

    strict = engine(checkpoint, extra={"fallback": False})
    strict.wait(ok=False)
    assert strict.proc.returncode != 0 and "vllm_version differ" in strict.log


def test_with_no_daemon_the_engine_loads_from_disk_or_with_fallback_off_says_why(engine, checkpoint, tmp_path):
    disk = engine(checkpoint, load_format="auto").wait()
    nowhere = str(tmp_path / "no-daemon")
    alone = engine(checkpoint, HBMD_RUN_DIR=nowhere)
    result = alone.wait()
    assert result["source"] == "disk" and result["digest"] == disk["digest"] and result["external_bytes"] == 0
    assert "loading them from disk" in alone.log

    strict = engine(checkpoint, extra={"fallback": False}, HBMD_RUN_DIR=nowhere)
    strict.wait(ok=False)
    assert strict.proc.returncode != 0 and "DaemonUnavailable" in strict.log


def test_an_unknown_option_is_refused(engine, checkpoint):
    wrong = engine(checkpoint, extra={"fallbak": False})
    wrong.wait(ok=False)
    assert wrong.proc.returncode != 0 and "unexpected --model-loader-extra-config keys" in wrong.log
    assert "fallbak" in wrong.log
