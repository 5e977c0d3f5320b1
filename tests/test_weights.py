"""Weights in hbmd (issue #18): a state dict stored once, sealed, and loaded as read-only views by any process."""

from __future__ import annotations

import json
import signal

import pytest
from hbmd.client import Conflict, ExtensibleTensor, InvalidRequest
from hbmd.client.weights import ALIGNMENT, HEADER, MAGIC, load_weights, open_weights, store_weights
from helpers import torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


def model(seed: int = 7) -> dict[str, torch.Tensor]:
    """A small state dict of every kind a checkpoint holds: several dtypes, a 0-d, an empty, a transposed and a sliced
    tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "layers.0.attn.qkv": torch.randn(17, 51, generator=g).to(torch.float16),
        "layers.0.norm": torch.randn(17, generator=g),
        "layers.0.mlp.up.T": torch.randn(40, 17, generator=g).t(),
        "position_ids": torch.arange(129, dtype=torch.int64),
        "scale": torch.tensor(0.125, dtype=torch.float64),
        "empty": torch.empty(0, 5, dtype=torch.float32),
        "mask": torch.rand(9, generator=g) > 0.5,
        "codes": torch.randint(-128, 127, (7, 3), dtype=torch.int8, generator=g),
        "every.other": torch.randn(6, 8, generator=g)[:, ::2],
    }


STORE = """
import sys
sys.path.insert(0, {tests!r})
from hbmd.client import connect
from hbmd.client.weights import store_weights
from test_weights import model

c = connect("cpu", client_name="loader")
w = store_weights(model(), "llama", "cpu", client=c)
print(w.buffer_id, c.session_id, flush=True)
sys.stdin.readline()
"""

LOAD = """
import ctypes
import hashlib
import sys
from hbmd.client import connect
from hbmd.client.weights import load_weights

c = connect("cpu", client_name="engine")
weights = load_weights("llama", "cpu", client=c)
digest = hashlib.sha256()
for name, t in weights.items():
    digest.update(name.encode() + str(t.dtype).encode() + str(list(t.shape)).encode())
    digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
print(c.session_id, digest.hexdigest(), flush=True)
if sys.stdin.readline().strip() == "write":
    weights["layers.0.norm"][0] = 1.0
    print("wrote", flush=True)
sys.stdin.readline()
"""


def stored_by_a_worker(daemon, spawn_worker, request):
    worker = spawn_worker(daemon, STORE.format(tests=str(request.path.parent)))
    buffer_id, _session_id = map(int, worker.readline().split())
    return worker, buffer_id


def test_a_state_dict_comes_back_as_views_of_one_sealed_buffer(client):
    state = model()
    stored = store_weights(state, "llama", "cpu", client=client)
    assert stored.sealed and stored.persistent and stored.name == "llama"

    with pytest.raises(Conflict):
        store_weights(state, "llama", "cpu", client=client)
    loaded = load_weights("llama", "cpu", client=client)

    assert list(loaded) == list(state)
    base = stored.base_ptr
    for name, tensor in state.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
    # A transposed weight comes back transposed, as a kernel may want it; a slice with gaps comes back dense.
    assert loaded["layers.0.mlp.up.T"].stride() == state["layers.0.mlp.up.T"].stride() == (1, 17)
    assert loaded["every.other"].is_contiguous()
    # Views, not copies: every tensor with bytes lies in the buffer, on a 256-byte boundary of it.
    view = loaded["position_ids"]
    assert view.untyped_storage().data_ptr() != base  # mapped by the read-only attach, beside the writer's mapping
    offsets = [t.data_ptr() - loaded["embed.weight"].data_ptr() for t in loaded.values() if t.numel()]
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    assert loaded["scale"].dim() == 0 and loaded["empty"].numel() == 0

    # The manifest is at the buffer's start, as documented.
    header = bytes(stored.full_view()[: HEADER.size].tolist())
    magic, length = HEADER.unpack(header)
    manifest = json.loads(bytes(stored.full_view()[HEADER.size : HEADER.size + length].tolist()))
    assert magic == MAGIC and [t["name"] for t in manifest["tensors"]] == list(state)
    assert manifest["tensors"][0] == {"name": "embed.weight", "dtype": "bfloat16", "shape": [33, 17], "offset": 0,
                                      "nbytes": 33 * 17 * 2}
    # One buffer, one chunk set, charged once.
    (info,) = client.buffers()
    assert info.sealed and info.readers == 1 and client.status().committed_bytes == info.physical_bytes


def test_what_the_storer_records_comes_back_with_the_tensors(client):
    store_weights({"w": torch.ones(3)}, "keyed", "cpu", client=client, meta={"key": {"model": "m", "tp": [0, 1]}})
    weights = open_weights("keyed", "cpu", client=client)
    assert weights.meta == {"key": {"model": "m", "tp": [0, 1]}} and list(weights.tensors) == ["w"]
    assert next(b for b in client.buffers() if b.name == "keyed").readers == 1
    weights.buffer.detach()
    assert next(b for b in client.buffers() if b.name == "keyed").readers == 0


def test_strides_that_reach_outside_a_tensors_bytes_are_refused(client):
    stored = store_weights({"w": torch.randn(8, 4).t()}, "forged", "cpu", client=client)
    view = stored.full_view()
    _magic, length = HEADER.unpack(bytes(view[: HEADER.size].tolist()))
    manifest = json.loads(bytes(view[HEADER.size : HEADER.size + length].tolist()))
    assert manifest["tensors"][0]["stride"] == [1, 4]
    stored.free()
    # The same buffer written by hand, with a stride past the tensor's 32 elements: the reader refuses it.
    manifest["tensors"][0]["stride"] = [1, 40]
    text = json.dumps(manifest).encode()
    forged = ExtensibleTensor(2 << 20, "cpu", client=client, name="forged", persistent=True)
    forged.resize_(4096)
    raw = HEADER.pack(MAGIC, len(text)) + text
    forged.full_view()[: len(raw)].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    forged.seal()
    with pytest.raises(ValueError, match="outside its 32 elements"):
        load_weights("forged", "cpu", client=client)


def test_only_dense_tensors_are_stored_and_a_failure_leaves_nothing(client):
    with pytest.raises(TypeError, match="'bias'"):
        store_weights({"w": torch.ones(3), "bias": [1.0, 2.0]}, "bad", "cpu", client=client)
    assert client.buffers() == []
    plain = ExtensibleTensor(2 << 20, "cpu", client=client, name="plain", persistent=True)
    plain.resize_(4096)
    plain.seal()
    with pytest.raises(ValueError, match="no hbmd weights manifest"):
        load_weights("plain", "cpu", client=client)
    (info,) = client.buffers()
    assert info.readers == 0  # the failed load let go of its read claim


def test_unsealed_weights_are_not_loaded(client):
    ExtensibleTensor(2 << 20, "cpu", client=client, name="half-written", persistent=True)
    with pytest.raises(InvalidRequest, match="not sealed"):
        load_weights("half-written", "cpu", client=client)


@pytest.mark.system
def test_two_engines_load_the_same_bytes_and_the_loaders_death_leaves_them(daemon, client, spawn_worker, request):
    loader, buffer_id = stored_by_a_worker(daemon, spawn_worker, request)
    engines = [spawn_worker(daemon, LOAD) for _ in range(2)]
    digests = [e.readline().split()[1] for e in engines]
    assert digests[0] == digests[1]

    loader.kill()
    wait_until(lambda: next(b for b in client.buffers() if b.buffer_id == buffer_id).session_id == 0)
    (info,) = client.buffers()
    assert info.sealed and info.readers == 2

    # A third engine, started after the loader died, loads the very same bytes.
    late = spawn_worker(daemon, LOAD)
    assert late.readline().split()[1] == digests[0]
    weights = load_weights("llama", "cpu", client=client)
    for name, tensor in model().items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.system
def test_a_write_through_loaded_weights_faults(daemon, client, spawn_worker, request):
    stored_by_a_worker(daemon, spawn_worker, request)
    vandal = spawn_worker(daemon, LOAD)
    vandal.readline()
    vandal.send("write")
    assert vandal.wait() == -signal.SIGSEGV
    assert torch.equal(load_weights("llama", "cpu", client=client)["layers.0.norm"], model()["layers.0.norm"])
