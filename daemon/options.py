"""``hbmd``'s options: the parser, the types that check each value, and the defaults they name.

:mod:`hbmd.daemon.main` turns the parsed options into a daemon; this module
only reads text. A new option is one ``add_argument`` here and where
``main`` (``_wire``, ``_settings``, ``_limits``) uses it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import textwrap
from collections.abc import Callable
from typing import NoReturn, TypeVar

from hbmd.proto.instance import DEFAULT_RUN_DIR, VERSION

from . import logs
from .backends.pool import HOST_PIECE
from .config import FORMAT as CONFIG_FORMAT
from .restart.persist import RESUME_WINDOW_S
from .state import DEFAULT_CREDIT_BYTES, DEFAULT_LEASE_BYTES, DEMOTE_IDLE_S, Limits

T = TypeVar("T")

HOST_POOL_DEFAULT = "4GiB"
"""Host-tier memory made ahead of demotes without ``--host-pool`` (within the host budget): creating pinned host
memory is slow to make (SPEC.md, "host-NUMA VMM memory"), which a demote would otherwise wait for."""
DEFAULT_WARM_CHUNKS = 4
"""CUDA granules kept made and exported ahead without ``--warm-chunks`` (8 MiB on the H200): a one-granule commit
through the daemon otherwise pays ``cuMemCreate`` and the export on its critical path
(``bench/gpu_bench.py --cases breakdown``, "2 MiB step, lease empty", measures both)."""
HOST_DEFAULT_BUDGET = "50%"
"""The host backend's budget without ``--budget``: its pages are the machine's RAM, which the
kernel, the engines and their page cache need too."""
INSTANCE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
MIN_SECONDS = 0.1
"""The shortest ``--resume-timeout`` or ``--reclaim-timeout`` (``1e-300`` used to be taken): no client resumes or
answers a reclaim sooner, and an idle loop looks at its timers once a second (``server/loop.py``)."""
MAX_SECONDS = 86400.0
"""The longest: a day, as ``hbmctl``'s durations."""
EXIT_INVARIANT_VIOLATED = os.EX_SOFTWARE
"""Exit status (70, sysexits' EX_SOFTWARE) of a daemon whose ``--check-invariants`` found an invariant broken:
a bug in hbmd, told apart from a refusal to start (1, 2) and a clean stop (0)."""


def metrics_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as ``(host, port)``; an argparse type.

    The host is required: a bare port would listen on every interface, which
    an operator should ask for by name (``0.0.0.0:PORT``).
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:9464 or [::1]:9464")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be a number from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"{text!r}: write an IPv6 host in brackets, e.g. [::1]:9464")
    return host, int(port)


def instance_name(text: str) -> str:
    """An instance directory name other than the backend's own; an argparse type."""
    if not INSTANCE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: 1 to 32 of lower-case letters, digits, '-' and '_', starting with a letter"
        )
    return text


def _parsed(convert: Callable[[str], T], text: str, what: str) -> T:
    """``convert(text)``, or a usage error saying ``text`` is not ``what``."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def granule_count(text: str) -> int:
    """A number of granules, 0 or more; an argparse type."""
    count = _parsed(int, text, "a whole number")
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count} is negative; give 0 or more granules")
    return count


def device_index(text: str) -> int:
    """A GPU index as nvidia-smi numbers it, 0 or more; an argparse type."""
    index = _parsed(int, text, "a whole number")
    if index < 0:
        raise argparse.ArgumentTypeError(f"{index} is negative; GPUs are numbered from 0, as nvidia-smi lists them")
    return index


def seconds(text: str) -> float:
    """A duration from :data:`MIN_SECONDS` to :data:`MAX_SECONDS`; an argparse type."""
    value = _parsed(float, text, "a number of seconds")
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of seconds")
    if not MIN_SECONDS <= value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} seconds: give from {MIN_SECONDS:g} to {MAX_SECONDS:g} (a day)")
    return value


def idle_seconds(text: str) -> float:
    """A duration from 0 (none: no wait at all) to :data:`MAX_SECONDS`; an argparse type."""
    value = _parsed(float, text, "a number of seconds")
    if not 0 <= value <= MAX_SECONDS:  # nan too
        raise argparse.ArgumentTypeError(f"{text} seconds: give from 0 to {MAX_SECONDS:g} (a day)")
    return value


class UsageParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as the daemon's other refusals are: a journal line each,
    not the whole usage before it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="hbmd",
        description="Per-GPU memory daemon: owns device memory and serves growable buffers to worker processes.",
        epilog="example: hbmd --backend host --run-dir ~/.hbmd --budget 8GiB\n\n"
               "--config FILE is TOML, every key shown here (sizes as --budget takes them, a percentage of the\n"
               "device's memory; both sections optional; SIGHUP reloads it):\n\n"
               + textwrap.indent(CONFIG_FORMAT, "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backend", choices=("auto", "cuda", "host"), default="auto",
                        help="memory to serve "
                             "(default: auto, CUDA where a driver and the device are present, else host)")
    parser.add_argument("--device", type=device_index, metavar="N",
                        help="GPU index as nvidia-smi numbers it (default: 0); not with --backend host")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help=f"directory for the instance's sockets (default: $HBMD_RUN_DIR, else {DEFAULT_RUN_DIR})")
    parser.add_argument("--budget", metavar="SIZE",
                        help="most bytes committed at once: 96MiB, 120GiB, 90%% (default: all device memory; "
                             f"host backend: {HOST_DEFAULT_BUDGET.replace('%', '%%')} of RAM)")
    parser.add_argument("--host-budget", default="0", metavar="SIZE",
                        help="most bytes of the host tier, where buffers are demoted to (ExtensibleTensor.demote(), "
                             "release_physical(keep=True)): host RAM, pinned (host-NUMA memory on CUDA), as a size or "
                             "a %% of RAM (default: 0, no host tier)")
    parser.add_argument("--host-pool", default=HOST_POOL_DEFAULT, metavar="SIZE",
                        help="host-tier memory made ahead of demotes while idle, within --host-budget "
                             "(default: %(default)s)")
    parser.add_argument("--host-piece", default=f"{HOST_PIECE >> 20}MiB", metavar="SIZE",
                        help="size of the host-tier chunks a demote is cut into and the pool makes ahead, whole "
                             "granules (default: %(default)s)")
    parser.add_argument("--instance-name", type=instance_name, metavar="NAME",
                        help="serve under <run-dir>/NAME instead of gpu<N> or host, e.g. a second host pool (one "
                             "named is not refused as a second host daemon of the node)")
    parser.add_argument("--warm-chunks", type=granule_count, default=None, metavar="N",
                        help="CUDA: keep N granules created and exported ahead of time, set aside from the budget, "
                             "so a one-granule commit through the daemon (a session without a lease, or one whose "
                             f"lease ran dry) skips cuMemCreate and the export (default: {DEFAULT_WARM_CHUNKS})")
    parser.add_argument("--no-export-sentinel", action="store_true",
                        help="CUDA: do not hold the one exported granule that keeps the driver's FD export and close "
                             "on their fast path (a 2 MiB granule out of the budget; default: held)")
    parser.add_argument("--lease", default=f"{DEFAULT_LEASE_BYTES >> 20}MiB", metavar="SIZE",
                        help="the most one session is leased: granules created ahead of need that its client places "
                             "itself, so a small commit costs no round trip; grows with demand, none while the budget "
                             "is tight, 0 turns leases off (default: %(default)s)")
    parser.add_argument("--credit", default=f"{DEFAULT_CREDIT_BYTES >> 30}GiB", metavar="SIZE",
                        help="the most credit one session holds: bytes its client commits in chunks it makes itself, "
                             "so a commit of any size costs no round trip; grows with demand, taken back under "
                             "pressure, all sessions' leases within an 8th of the budget; 0 turns it off "
                             "(default: %(default)s)")
    parser.add_argument("--device-lock-dir", metavar="DIR", default=DEFAULT_RUN_DIR,
                        help="where every daemon of this node locks the GPU it serves by UUID, or host memory, so "
                             "that a second one (another run directory, a container) is refused: one directory for "
                             "the whole node, writable by the service's user only; a daemon that cannot write it locks "
                             "by a name only the daemons of its network namespace see. A host daemon with an "
                             "--instance-name takes no lock (default: %(default)s)")
    parser.add_argument("--takeover", action="store_true",
                        help="take over from the daemon serving this instance: it hands over its sessions, buffers "
                             "and memory and stops once this one serves, so clients resume here without a gap "
                             "(upgrades without systemd; a rolling update); starts afresh where none serves")
    parser.add_argument("--linger", action="store_true",
                        help="once a successor took over, stay (serving nothing) until stopped instead of exiting: "
                             "for a container whose restart policy would start it again, and take over back")
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file with access rules and per-tenant quotas; SIGHUP reloads it")
    parser.add_argument("--check-config", action="store_true",
                        help="check the options and --config as a start would, serve nothing, and exit: 0 when a "
                             "start would take them, 2 when not (before systemctl reload, or in a package's tests)")
    parser.add_argument("--group", metavar="NAME",
                        help="group owning the instance directory and sockets; its members may connect")
    parser.add_argument("--metrics-addr", type=metrics_address, metavar="HOST:PORT",
                        help="serve Prometheus metrics on http://HOST:PORT/metrics and a health check on "
                             "/healthz, e.g. 127.0.0.1:9464 (default: off)")
    parser.add_argument("--metrics-sessions", action="store_true",
                        help="also export per-session series (labelled by session id and pid: a new series "
                             "per worker restart, so off by default)")
    parser.add_argument("--state-dir", metavar="DIR", default=os.environ.get("STATE_DIRECTORY"),
                        help="where to journal the sessions and buffers so that, their memory parked with systemd, "
                             "they survive a restart of the daemon (default: $STATE_DIRECTORY)")
    parser.add_argument("--resume-timeout", type=seconds, default=RESUME_WINDOW_S, metavar="S",
                        help="after a restart, seconds a session waits for its client to resume it before it ends "
                             "as a dead client's does (default: %(default)g)")
    parser.add_argument("--reclaim-timeout", type=seconds, default=30.0, metavar="S",
                        help="seconds before an unanswered reclaim request is reported as ignored (default: 30)")
    parser.add_argument("--demote-idle", type=idle_seconds, default=DEMOTE_IDLE_S, metavar="S",
                        help="seconds a session must have grown no buffer before it may be asked to demote its "
                             "buffers to the host tier for another tenant's commit (a config tenant's demote); "
                             "0: however lately it grew (default: %(default)g)")
    parser.add_argument("--max-sessions-per-uid", type=int, default=Limits.sessions_per_uid, metavar="N",
                        help=f"sessions one uid may hold open at once; each costs the daemon FDs "
                             f"(default: {Limits.sessions_per_uid})")
    parser.add_argument("--max-persistent-per-uid", type=int, default=Limits.persistent_buffers_per_uid, metavar="N",
                        help=f"persistent buffers one uid may hold; each is journaled in the state directory "
                             f"(default: {Limits.persistent_buffers_per_uid})")
    parser.add_argument("--max-buffers-per-uid", type=int, default=Limits.buffers_per_uid, metavar="N",
                        help=f"buffers one uid may hold; they cost no budget but daemon memory "
                             f"(default: {Limits.buffers_per_uid})")
    parser.add_argument("--check-invariants", action="store_true",
                        help="check the invariants (committed bytes, chunks, owners) after every batch of requests and "
                             "events; where one does not hold, log what is off and exit at once with status "
                             f"{EXIT_INVARIANT_VIOLATED} (EX_SOFTWARE); costs time, for tests")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--log-format", default="auto", choices=logs.FORMATS,
                        help="text (with a timestamp), journal (<N> priority prefixes, no timestamp: journald adds "
                             "one), or json (one object per line); default auto: journal where stderr is systemd's "
                             "journal, else text")
    parser.add_argument("--version", action="version", version=f"hbmd {VERSION}")
    return parser
