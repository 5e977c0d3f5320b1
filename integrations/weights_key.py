"""What hbmd adds to vLLM's ``WeightCacheKey`` before trusting sealed weights, and whose claim on a name it waits for.

vLLM's key fingerprints a checkpoint by its tensor names and safetensors
headers: a fine-tune of the same shapes in another folder, or a checkpoint
overwritten in place, has the same key. vLLM's own weight daemon lives only
as long as its process; hbmd keeps sealed weights after every engine exits,
so :mod:`hbmd.integrations.vllm_weights` adds to the key the fields of
:func:`checkpoint_fields`, which change with the bytes: the checkpoint's
folder resolved, and each weight file's resolved path, size, modification
time, and what a copy that keeps times (``cp -p``, ``rsync -a``) or a mount of
another folder at the same path cannot keep: its device, inode and change
time (``st_ctime_ns``, which no user can set).

An engine storing the weights does so from a session of its own named
:func:`storer_name`; another engine of the same key waits for it, and for
nothing else (:func:`not_a_store`).

No vLLM here, so that CI tests it without vLLM (tests/test_weights_key.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from hbmd.proto.admin import SessionInfo
from hbmd.proto.buffers import BufferInfo

STORER_PREFIX = "vllm-weights-store"
FILE_FIELDS = ("path", "size", "mtime_ns", "device", "inode", "ctime_ns")
"""What :func:`checkpoint_fields` records of each weight file, in the order :func:`files_changes` names them."""


def checkpoint_fields(folder: str, files: Iterable[str]) -> dict[str, Any]:
    """The fields of hbmd's key that identify the bytes of the weight ``files`` an engine reads from ``folder``.

    ``weights_dir`` is ``folder`` resolved (symlinks followed: a Hugging Face
    snapshot folder names its revision); ``weights_files`` lists, sorted by
    name, each file's name under ``folder``, its resolved path (a snapshot's
    blob), size, ``st_mtime_ns``, device, inode and ``st_ctime_ns``. Reads
    no weight bytes, yet any write to a file, or a file put in its place,
    changes its change time. Raises ``OSError`` for a file that cannot be
    looked at.
    """
    entries = []
    for path in files:
        stat = os.stat(path)
        entries.append({"name": os.path.relpath(path, folder), "path": os.path.realpath(path), "size": stat.st_size,
                        "mtime_ns": stat.st_mtime_ns, "device": stat.st_dev, "inode": stat.st_ino,
                        "ctime_ns": stat.st_ctime_ns})
    return {"weights_dir": os.path.realpath(folder), "weights_files": sorted(entries, key=lambda e: e["name"])}


def files_changes(stored: Any, ours: list[dict[str, Any]]) -> list[str]:
    """What differs between two ``weights_files`` lists, a phrase per file, for a log line; [] when they are equal."""
    # What a buffer recorded is read, not trusted: entries of another shape count as no file.
    recorded = stored if isinstance(stored, list) else []
    before = {e["name"]: e for e in recorded if isinstance(e, Mapping) and isinstance(e.get("name"), str)}
    after = {e["name"]: e for e in ours}
    changes = [f"{n} is new" for n in sorted(after.keys() - before.keys())]
    changes += [f"{n} is gone" for n in sorted(before.keys() - after.keys())]
    for name in sorted(before.keys() & after.keys()):
        differ = [f"{field} {before[name].get(field)} -> {after[name].get(field)}"
                  for field in FILE_FIELDS if before[name].get(field) != after[name].get(field)]
        if differ:
            changes.append(f"{name}: {', '.join(differ)}")
    return changes


def storer_name(weights_name: str) -> str:
    """The client name of the session that stores ``weights_name``: the name's digest, within a session name's 128
    characters."""
    return f"{STORER_PREFIX}:{weights_name.rsplit(':', 1)[-1]}"


def not_a_store(weights_name: str, holder: SessionInfo, wait_s: float, unsealed_s: float = 0.0) -> str:
    """Why the live session ``holder``, which holds the unsealed buffer ``weights_name``, is no engine storing these
    weights whose seal is worth waiting for, so that an engine loads from disk at once; "" when it is one.

    A process of the same user can take the name first (by mistake, or to
    keep engines waiting), under any session name, a storer's too: nothing
    a process of that user can show tells it from an engine. What bounds it
    is time: an engine waits ``wait_s`` at most for a store, so a name held
    unsealed for longer than that has been storing longer than any engine
    waits, and none waits for it again. Once it holds the name, a squatter
    delays engines ``wait_s`` in all, not each engine by as much. How long is
    the longer of the holder's session's age and ``unsealed_s``, the
    daemon's count across every session that held the name
    (:attr:`~hbmd.proto.BufferInfo.unsealed_since`, 0 from a daemon older
    than protocol 1.14): a squatter handing the name on to a new session of
    its own, or deleting and making it again, does not start it over.
    """
    who = f"session {holder.session_id} (pid {holder.pid}, uid {holder.uid}, client {holder.client_name!r})"
    expected = storer_name(weights_name)
    if holder.client_name != expected:
        return (f"{weights_name} is held unsealed by {who}, not by an engine storing these weights (client "
                f"{expected!r}); not waiting for it to be sealed")
    held_s = max(holder.connected_s, unsealed_s)
    if held_s > wait_s:
        return (f"{weights_name} is held unsealed by {who}; it has been unsealed for {held_s:.0f} s, longer than an "
                f"engine waits for a store ({wait_s:g} s, wait_s); not waiting for it to be sealed (end that process "
                "to let an engine store them)")
    return ""


def unsealed_for(buffer: BufferInfo, now: float) -> float:
    """How long, at Unix time ``now``, the daemon has seen ``buffer``'s name held unsealed; 0 where it does not say."""
    return max(0.0, now - buffer.unsealed_since) if buffer.unsealed_since else 0.0
