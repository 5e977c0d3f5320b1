"""An older hbmd's client (run with that checkout on PYTHONPATH, by ``make.py``): one session, a persistent buffer
``kv`` of two 8 MiB segments with two granules committed in each, a plain 8 MiB buffer with one 4 MiB commit; it stays
connected until its stdin closes, so that the daemon stops under it."""

import sys

from hbmd.client import ExtensibleTensor, connect

options = {"lease": False} if "lease" in connect.__code__.co_varnames else {}  # one chunk a commit
client = connect("cpu", client_name="fixture", **options)
kv = ExtensibleTensor(16 << 20, "cpu", num_segments=2, client=client, name="kv", persistent=True)
for step in (1, 2):
    kv.resize_per_segment_(step * (2 << 20))
scratch = ExtensibleTensor(8 << 20, "cpu", client=client)
scratch.resize_per_segment_(4 << 20)
print("ready", flush=True)
sys.stdin.read()
