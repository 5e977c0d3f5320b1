"""What a chunk the client makes itself costs, on each side, against the in-process commit.

A session with a byte credit creates, maps and exports its chunk in its own
process and hands the FD to the daemon, which must check it (device, kind,
size) before it counts it. This probe times each step in one run:

- client (primary context): create + map + set access (the in-process
  commit), then the same plus export and the FD's send on a Unix socket;
- daemon (a context-free process, as hbmd is): receive, import, read the
  allocation's properties, probe its size with a mapping past its end that
  must fail, release the import.

    python3 bench/own_chunk_probe.py [--device 0] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hbmd import driver
from hbmd.proto.fdpass import receive_with_fds

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import percentile, write_json  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
SIZES = {2 * MiB: 30, 64 * MiB: 20, GiB: 10, 8 * GiB: 5}


def p50(values: list[float]) -> float:
    return round(percentile(values, 50), 1)


def client(device: int, sock: socket.socket) -> dict[str, Any]:
    driver.use_primary_context(device)
    granule = driver.granularity(device)
    sentinel = driver.export_fd(driver.create(device, granule, rdma=False))  # as hbmd's sentinel: exports are fast
    results: dict[str, Any] = {}
    for size, n in SIZES.items():
        base = driver.reserve(size, granule)
        plain, own, export, send = [], [], [], []
        for i in range(2 * n):
            started = time.perf_counter()
            handle = driver.create(device, size, rdma=False)
            driver.map(base, size, handle)
            driver.set_access(base, size, [device])
            mapped = time.perf_counter()
            if i % 2:
                fd = driver.export_fd(handle)
                exported = time.perf_counter()
                socket.send_fds(sock, [json.dumps({"size": size}).encode()], [fd])
                os.close(fd)
                sent = time.perf_counter()
                own.append((sent - started) * 1e6)
                export.append((exported - mapped) * 1e6)
                send.append((sent - exported) * 1e6)
                sock.recv(16)  # the verifier is done with it
            else:
                plain.append((mapped - started) * 1e6)
            driver.unmap(base, size)
            driver.release(handle)
        driver.unreserve(base, size)
        results[str(size)] = {"in_process_us": p50(plain), "own_chunk_us": p50(own), "export_us": p50(export),
                              "send_us": p50(send), "ratio": round(p50(own) / p50(plain), 3)}
        print(size >> 20, "MiB", results[str(size)], flush=True)
    sock.send(b"{}")
    os.close(sentinel)
    return results


def verifier(device: int, fd_number: int) -> None:
    """Context-free: check each FD that comes, and report the steps' times (as JSON on stdout)."""
    cu = driver._bindings()
    driver.init()
    granule = driver.granularity(device)
    sock = socket.socket(fileno=fd_number)
    probe = driver.reserve(granule, granule)
    semantics: dict[str, Any] = {}
    wide = driver.reserve(8 * granule, granule)
    four = driver.create(device, 4 * granule, rdma=False)
    for label, length in (("map_part", 2 * granule), ("map_past_end", 5 * granule), ("map_exact", 4 * granule)):
        started = time.perf_counter()
        try:
            driver.map(wide, length, four)
        except Exception as exc:
            semantics[label] = str(exc)
            continue
        mapped = time.perf_counter()
        driver.unmap(wide, length)
        semantics[label] = {"map_us": round((mapped - started) * 1e6, 1),
                            "unmap_us": round((time.perf_counter() - mapped) * 1e6, 1)}
    driver.release(four)
    driver.unreserve(wide, 8 * granule)
    times: dict[str, dict[str, list[float]]] = {}
    while True:
        data, fds, _ = receive_with_fds(sock, 4096, 4)
        message = json.loads(data)
        if not fds:
            break
        size = message["size"]
        t0 = time.perf_counter()
        handle = driver.import_fd(fds[0])
        t1 = time.perf_counter()
        prop = driver.call("cuMemGetAllocationPropertiesFromHandle", handle)
        t2 = time.perf_counter()
        past_end_mapped = True
        try:
            driver.call("cuMemMap", probe, granule, size, handle, 0)
        except Exception:
            past_end_mapped = False
        else:
            driver.unmap(probe, granule)
        t3 = time.perf_counter()
        try:
            driver.call("cuMemMap", probe, granule, size - granule, handle, 0)
            last_mapped = True
        except Exception as exc:
            last_mapped = str(exc)
        else:
            driver.unmap(probe, granule)
        t4 = time.perf_counter()
        driver.release(handle)
        os.close(fds[0])
        t5 = time.perf_counter()
        entry = times.setdefault(str(size), {"import": [], "props": [], "past_end_probe": [], "last_granule_probe": [],
                                             "release_close": []})
        for key, value in zip(entry, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            value_us = value * 1e6
            entry[key].append(value_us)
        entry.setdefault("facts", [dict(location_type=int(prop.location.type), location_id=int(prop.location.id),
                                        type=int(prop.type), handle_types=int(prop.requestedHandleTypes),
                                        past_end_mapped=past_end_mapped, last_granule_mapped=last_mapped,
                                        device=int(cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE))])
        sock.send(b"ok")
    report: dict[str, Any] = {size: {k: (p50(v) if k != "facts" else v) for k, v in steps.items()}
                              for size, steps in times.items()}
    report["semantics"] = semantics
    print(json.dumps(report), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--verifier", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.verifier is not None:
        verifier(args.device, args.verifier)
        return 0
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = subprocess.Popen([sys.executable, __file__, "--device", str(args.device),
                              "--verifier", str(theirs.fileno())],
                             pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True)
    theirs.close()
    result = {"client": client(args.device, ours)}
    out, _ = child.communicate(timeout=120)
    result["daemon"] = json.loads(out)
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
