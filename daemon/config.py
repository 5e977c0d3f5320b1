"""The daemon's optional TOML config: who may connect and per-tenant limits; :data:`FORMAT` shows it.

A declared tenant name never lifts a uid's limits: a uid with its own entry
is refused a configured name that does not list it in ``uids``, and an unknown
name it declares is charged to its own entry (see ``State.tenant_for``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from typing import Any

from hbmd.proto.units import exact_bytes, parse_size

FORMAT = """\
[access]
allow_uids = [1000, 1001]   # default: anyone who can reach the socket
allow_gids = [2000]         # a peer whose primary or supplementary group is listed
admin_uids = [0]            # see and steer every session (root and the daemon's uid always may)

[[tenants]]
name = "llama-70b"          # declared by clients: connect(tenant="llama-70b") or HBMD_TENANT=llama-70b
uids = [1000]               # who may declare it (default: anyone allowed in)
max = "80GiB"               # burst limit
guaranteed = "40GiB"        # no other tenant's commit can eat into this

[[tenants]]
uid = 1001                  # every session of uid 1001: a name it declares is charged here too,
max = "50%"                 # unless a named tenant lists 1001 in its uids

[[tenants]]
name = "batch"
demote = 1                  # under pressure its idle buffers move to the host tier (--host-budget), lowest
                            # number first, instead of another tenant's commit being refused; not with guaranteed
"""
"""An example of every key (``hbmd --config /etc/hbmd/gpu0.toml``), as ``hbmd --help`` and the README show it.

Sizes take the units of ``--budget``; a percentage is of the device's memory.
Both sections are optional, a tenant names exactly one of ``name`` and
``uid``, and an unknown section or key is refused.
"""


class ConfigError(ValueError):
    """The config file is unreadable or inconsistent; the message says where."""


@dataclasses.dataclass(frozen=True)
class TenantLimits:
    """A configured tenant: by declared ``name`` or by ``uid``."""

    name: str
    uid: int | None
    uids: frozenset[int] | None
    max_bytes: int | None
    guaranteed_bytes: int
    demote: int | None = None
    """Where it comes in the order of tenants whose idle buffers are demoted under pressure (lowest first); None:
    never. A tenant with a guaranteed minimum is never demoted."""


@dataclasses.dataclass(frozen=True)
class Access:
    allow_uids: frozenset[int] | None = None
    allow_gids: frozenset[int] | None = None
    admin_uids: frozenset[int] = frozenset({0, os.getuid()})
    """Root and the daemon's own user are always admins."""

    def admits(self, uid: int, gids: set[int]) -> bool:
        if self.allow_uids is None and self.allow_gids is None:
            return True
        return uid in self.admin_uids or uid in (self.allow_uids or ()) or bool(gids & (self.allow_gids or set()))


@dataclasses.dataclass(frozen=True)
class Config:
    access: Access = Access()
    tenants: tuple[TenantLimits, ...] = ()
    by_name: dict[str, TenantLimits] = dataclasses.field(init=False, repr=False, compare=False)
    """Each tenant by name (``uid:N`` for a uid's own): every hello and tenant made looks one up, among up to tens of
    thousands (``bench/tenants_bench.py``)."""
    own_uids: frozenset[int] = dataclasses.field(init=False, repr=False, compare=False)
    """The uids with a ``[[tenants]] uid = N`` entry of their own."""
    guaranteed_bytes: int = dataclasses.field(init=False, repr=False, compare=False)
    """The guaranteed minimums of all tenants together."""
    guaranteeing: tuple[TenantLimits, ...] = dataclasses.field(init=False, repr=False, compare=False)
    """The tenants with a guaranteed minimum, by name: what they are owed is held back from the others, in use or
    not, so status and the metrics show them from the start."""

    def __post_init__(self) -> None:
        # Indexed once, as the file is read: a SIGHUP reload reads it outside the server's lock.
        object.__setattr__(self, "by_name", {t.name: t for t in self.tenants})
        object.__setattr__(self, "own_uids", frozenset(t.uid for t in self.tenants if t.uid is not None))
        object.__setattr__(self, "guaranteed_bytes", sum(t.guaranteed_bytes for t in self.tenants))
        object.__setattr__(self, "guaranteeing",
                           tuple(sorted((t for t in self.tenants if t.guaranteed_bytes), key=lambda t: t.name)))


def _ids(where: str, value: Any) -> frozenset[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ConfigError(f"{where} must be a list of non-negative integers")
    return frozenset(value)


def _size(where: str, value: Any, total: int) -> int:
    if type(value) is int and value >= 0:
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a size like \"40GiB\" or \"25%\"")
    try:
        return parse_size(value, total)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_config(text: str, total_bytes: int, budget_bytes: int, where: str = "config") -> Config:
    """Parse and check a config; raises :class:`ConfigError` naming the offending key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables by recursion; a SIGHUP reload must report it, not die.
        raise ConfigError(f"{where}: arrays or inline tables nested too deep") from None
    unknown = set(raw) - {"access", "tenants"}
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(sorted(unknown))}")
    access_raw = raw.get("access", {})
    if not isinstance(access_raw, dict):
        raise ConfigError(f"{where}: access must be a table ([access])")
    tenants_raw = raw.get("tenants", [])
    if not isinstance(tenants_raw, list) or not all(isinstance(entry, dict) for entry in tenants_raw):
        raise ConfigError(f"{where}: tenants must be an array of tables ([[tenants]])")
    unknown = set(access_raw) - {"allow_uids", "allow_gids", "admin_uids"}
    if unknown:
        raise ConfigError(f"{where}: [access] has unknown key(s) {', '.join(sorted(unknown))}")
    access = Access(
        allow_uids=(_ids(f"{where}: access.allow_uids", access_raw["allow_uids"])
                    if "allow_uids" in access_raw else None),
        allow_gids=(_ids(f"{where}: access.allow_gids", access_raw["allow_gids"])
                    if "allow_gids" in access_raw else None),
        admin_uids=_ids(f"{where}: access.admin_uids", access_raw.get("admin_uids", [0])) | {0, os.getuid()},
    )
    tenants: list[TenantLimits] = []
    seen: set[str] = set()
    for i, entry in enumerate(tenants_raw):
        at = f"{where}: tenants[{i}]"
        unknown = set(entry) - {"name", "uid", "uids", "max", "guaranteed", "demote"}
        if unknown:
            raise ConfigError(f"{at} has unknown key(s) {', '.join(sorted(unknown))}")
        if ("name" in entry) == ("uid" in entry):
            raise ConfigError(f"{at} needs exactly one of name or uid")
        if "uid" in entry and (type(entry["uid"]) is not int or entry["uid"] < 0):
            raise ConfigError(f"{at}.uid must be a non-negative integer")
        if "name" in entry and (
            not isinstance(entry["name"], str) or not entry["name"] or entry["name"].startswith("uid:")
        ):
            raise ConfigError(f"{at}.name must be a non-empty string not starting with 'uid:'")
        name = entry["name"] if "name" in entry else f"uid:{entry['uid']}"
        if name in seen:
            raise ConfigError(f"{at}: tenant {name!r} is configured twice")
        seen.add(name)
        max_bytes = _size(f"{at}.max", entry["max"], total_bytes) if "max" in entry else None
        guaranteed = _size(f"{at}.guaranteed", entry.get("guaranteed", 0), total_bytes)
        if max_bytes is not None and guaranteed > max_bytes:
            raise ConfigError(f"{at}: guaranteed ({exact_bytes(guaranteed)}) exceeds max ({exact_bytes(max_bytes)})")
        demote = entry.get("demote")
        if demote is not None and (type(demote) is not int or demote < 0):
            raise ConfigError(f"{at}.demote must be a non-negative integer (its place in the order of demotion)")
        if demote is not None and guaranteed:
            raise ConfigError(f"{at}: a tenant with a guaranteed minimum is never demoted; drop demote or guaranteed")
        tenants.append(
            TenantLimits(
                name=name,
                uid=entry.get("uid"),
                uids=_ids(f"{at}.uids", entry["uids"]) if "uids" in entry else None,
                max_bytes=max_bytes,
                guaranteed_bytes=guaranteed,
                demote=demote,
            )
        )
    config = Config(access, tuple(tenants))
    if config.guaranteed_bytes > budget_bytes:
        raise ConfigError(
            f"{where}: guaranteed minimums add up to {exact_bytes(config.guaranteed_bytes)}, over the budget of "
            f"{exact_bytes(budget_bytes)}"
        )
    return config


def load_config(path: str, total_bytes: int, budget_bytes: int) -> Config:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    return parse_config(text, total_bytes, budget_bytes, where=path)
