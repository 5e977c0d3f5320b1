"""A vLLM engine core ends when the front end that started it ends.

vLLM 0.34 runs its engine core in a child process of its front end
(``vllm serve``'s API server, or the process that made an ``LLM``) and that
child watches nothing: a front end SIGKILLed (a forced stop, the OOM killer,
a crash) leaves the engine core running, serving nobody, with its GPU memory
held. Under hbmd it also holds its session: its memory counts against the
budget of the engine that restarts, its kept KV cache stays its own (the
successor starts cold beside it), and a warm standby, which waits for that
process to end, waits for ever. So where hbmd's plugin is on, an engine core
ends itself at once, cleaning nothing up (what hbmd keeps is made to outlive
exactly that), the moment the kernel says its front end ended.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

log = logging.getLogger("vllm.hbmd")

ENGINE_CORE = "EngineCore"
"""What vLLM names its engine core processes (``EngineCore``, or ``EngineCore_DP<rank>`` in a data-parallel
engine): the children this module ends with their front end, and no other process."""


_watch: threading.Thread | None = None
"""This process's watch of its front end, once started."""


def patch_engine_core() -> None:
    """Start the watch as an engine core's process starts: a forked one runs vLLM's ``run_engine_core`` as patched
    here (it loads no plugin: the front end's are loaded already), a spawned one loads the plugin, which calls
    :func:`end_with_front_end` itself."""
    from vllm.v1.engine.core import EngineCoreProc

    if not hasattr(EngineCoreProc.run_engine_core, "__wrapped__"):
        EngineCoreProc.run_engine_core = staticmethod(ending_with_front_end(EngineCoreProc.run_engine_core))


def ending_with_front_end(run_engine_core: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run_engine_core)
    def run(*args: Any, **kwargs: Any) -> Any:
        end_with_front_end()
        return run_engine_core(*args, **kwargs)

    return run


def end_with_front_end() -> threading.Thread | None:
    """In a vLLM engine core's process, a thread that ends the process once the front end that started it ends
    (at once where it has ended already), started once; None in any other process."""
    global _watch
    if _watch is not None:
        return _watch
    front_end = multiprocessing.parent_process()
    if front_end is None or front_end.pid is None or not multiprocessing.current_process().name.startswith(ENGINE_CORE):
        return None
    try:
        pidfd = os.pidfd_open(front_end.pid)
        # It has exited where the pidfd is readable now (its parent may not have reaped it yet). One that ended before
        # the pidfd was opened may have left its pid to a process started since, after this one. (Not its parent where
        # a fork server started it.)
        gone = bool(select.select([pidfd], [], [], 0)[0]) or started(front_end.pid) > started(os.getpid())
    except (ProcessLookupError, FileNotFoundError):
        gone = True
    if gone:
        end(front_end.pid)
    _watch = threading.Thread(target=wait_and_end, args=(pidfd, front_end.pid), name="hbmd-front-end", daemon=True)
    _watch.start()
    return _watch


def started(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since the boot."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def wait_and_end(pidfd: int, pid: int) -> None:
    select.select([pidfd], [], [])
    end(pid)


def end(pid: int) -> NoReturn:
    log.error("hbmd: vLLM's front end (pid %d) has ended, and this engine core (pid %d) ends with it: its GPU memory "
              "and the KV cache it keeps go to the engine that follows", pid, os.getpid())
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    os._exit(1)
