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

import logging
import multiprocessing
import os
import select
import threading
from pathlib import Path
from typing import NoReturn

log = logging.getLogger("vllm.hbmd")

ENGINE_CORE = "EngineCore"
"""What vLLM names its engine core processes (``EngineCore``, or ``EngineCore_DP<rank>`` in a data-parallel
engine): the children this module ends with their front end, and no other process."""


def end_with_front_end() -> threading.Thread | None:
    """In a vLLM engine core's process, a thread that ends the process once the front end that started it ends
    (at once where it has ended already); None in any other process."""
    front_end = multiprocessing.parent_process()
    if front_end is None or front_end.pid is None or not multiprocessing.current_process().name.startswith(ENGINE_CORE):
        return None
    try:
        pidfd = os.pidfd_open(front_end.pid)
        # Not its parent where a fork server started it. A front end that ended before the pidfd was opened may have
        # left its pid to a process started since, after this one.
        gone = started(front_end.pid) > started(os.getpid())
    except (ProcessLookupError, FileNotFoundError):
        gone = True
    if gone:
        end(front_end.pid)
    watch = threading.Thread(target=wait_and_end, args=(pidfd, front_end.pid), name="hbmd-front-end", daemon=True)
    watch.start()
    return watch


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
