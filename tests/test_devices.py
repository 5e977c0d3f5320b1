"""Device names and the UUID matching that picks a GPU's instance (no GPU needed)."""

from __future__ import annotations

import pytest
from hbmd import driver
from hbmd.client.cuda import instance_for_cuda_device
from hbmd.client.devices import parse_device
from hbmd.proto.errors import NotFound
from hbmd.proto.instance import InstanceInfo, InstancePaths
from helpers import torch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "device, expected",
    [("cpu", ("cpu", -1)), ("cpu:0", ("cpu", -1)), ("cuda:1", ("cuda", 1)), (3, ("cuda", 3))],
)
def test_parse_device(device, expected):
    assert parse_device(device) == expected


@pytest.mark.torch
def test_parse_torch_devices():
    assert parse_device(torch.device("cpu")) == ("cpu", -1)
    assert parse_device(torch.device("cuda", 2)) == ("cuda", 2)


@pytest.mark.parametrize("device", ["meta", "mps", "cuda:-1", "cpu:1", "", -1, True, "xpu:0"])
def test_unsupported_devices_are_value_errors(device):
    with pytest.raises(ValueError):
        parse_device(device)


def publish(root, instance, uuid, index):
    paths = InstancePaths.of(root, instance)
    paths.directory.mkdir()
    backend = "cuda" if index >= 0 else "host"
    info = InstanceInfo(instance, backend, index, uuid, 4242, [1, 0], "0", paths.endpoint, str(paths.handles))
    paths.info.write_text(info.to_json())


def test_a_gpu_is_matched_to_its_instance_by_uuid_not_index(tmp_path, monkeypatch):
    # Under CUDA_VISIBLE_DEVICES=1 this process's cuda:0 is the node's GPU 1: it must reach gpu1, not gpu0.
    publish(tmp_path, "gpu0", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 0)
    publish(tmp_path, "gpu1", "GPU-bbbbbbbb-0000-0000-0000-000000000000", 1)
    publish(tmp_path, "host", "", -1)
    visible = ["GPU-bbbbbbbb-0000-0000-0000-000000000000"]
    monkeypatch.setattr(driver, "device_uuid", lambda ordinal: visible[ordinal])
    assert instance_for_cuda_device(0, tmp_path) == "gpu1"


def test_no_instance_for_the_gpu_is_a_clear_not_found(tmp_path, monkeypatch):
    publish(tmp_path, "gpu0", "GPU-aaaaaaaa-0000-0000-0000-000000000000", 0)
    monkeypatch.setattr(driver, "device_uuid", lambda ordinal: "GPU-cccccccc-0000-0000-0000-000000000000")
    with pytest.raises(NotFound, match="GPU-cccccccc"):
        instance_for_cuda_device(0, tmp_path)
