"""Tenants and the budget: the one place that does budget arithmetic.

Every byte committed or leased is charged here (:meth:`Tenants.charge`),
every commit and lease is admitted here (:meth:`Tenants.admit`,
:meth:`Tenants.lease_room`), and "budget left" has one definition
(:meth:`Tenants.admissible`), which status, ``hbmctl``, the client's
``device_memory()`` and the vLLM cap all read. A reloaded config changes
the limits here too, so a tenant always has the limits the config in
force gives it, whenever it is made.

A tenant is made when a session or buffer is first charged to it and
forgotten with the last: a config may name tens of thousands
(``bench/tenants_bench.py``), and nothing here walks them. Admission reads
a running total of the unmet guarantees, a reload walks the tenants in use
(the config was read and indexed before, outside the server's lock), and
status lists those, and the configured tenants owed a guaranteed minimum
(no more of them than it shows).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from hbmd.proto import TenantInfo
from hbmd.proto.buffers import MAX_NAME
from hbmd.proto.errors import OutOfBudget, PermissionDenied
from hbmd.proto.units import format_bytes

from ..config import Config, ConfigError, TenantLimits
from .records import Tenant

LEASE_TIGHT_DIVISOR = 16
"""No lease is granted that would leave a tenant less room than a 16th of the budget."""
LEASE_TOTAL_DIVISOR = 8
"""All leases together stay within an 8th of the budget."""


def unused_info(limits: TenantLimits) -> TenantInfo:
    """A configured tenant nothing is charged to: its limits, and no use."""
    return TenantInfo(limits.name, 0, limits.guaranteed_bytes, -1 if limits.max_bytes is None else limits.max_bytes, 0,
                      0)


def _listing_order(tenant: TenantInfo) -> tuple[bool, int, str]:
    """Limited tenants first, then the most used: what a capped list must not lose."""
    return tenant.max_bytes < 0 and not tenant.guaranteed_bytes, -tenant.used_bytes, tenant.name


class Tenants:
    """The instance's budget, its tenants and what each is charged."""

    def __init__(self, budget_bytes: int, config: Config, host_budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        """Most bytes the host tier holds at once (demoted buffers); 0: no host tier."""
        self.config = config
        self.by_name: dict[str, Tenant] = {}
        """The tenants in use: those a session or buffer is charged to."""
        self.unmet_guarantees = config.guaranteed_bytes
        """The guaranteed bytes of every configured tenant, in use or not, less what each uses of its own: what
        admission holds back for them all."""
        self.committed_bytes = 0
        self.leased_bytes = 0
        self.host_bytes = 0

    def limits(self, name: str) -> TenantLimits | None:
        """The configured limits of tenant ``name`` under the config in force."""
        return self.config.by_name.get(name)

    def _get(self, name: str) -> Tenant:
        tenant = self.by_name.get(name)
        if tenant is None:
            # Nothing charged to it yet: its guarantee is unmet whole, as the running total has it.
            tenant = self.by_name[name] = Tenant(name)
            limits = self.limits(name)
            if limits is not None:
                tenant.max_bytes, tenant.guaranteed_bytes = limits.max_bytes, limits.guaranteed_bytes
        return tenant

    def resolve(self, uid: int, declared: str) -> Tenant:
        """The tenant a session of ``uid`` declaring ``declared`` (maybe empty) is charged to.

        A declared name never lifts a uid's limits. A uid with its own
        ``[[tenants]] uid = N`` entry is held to it: it may declare a
        configured name only where that name's ``uids`` lists it, and any
        other name it declares is charged to its own entry. For other uids a
        configured name is open as its ``uids`` say, and an unknown name is a
        tenant of its own without limits (as the uid's own would be).
        """
        own = f"uid:{uid}"
        if not declared:
            return self._get(own)
        if declared.startswith("uid:") or len(declared) > MAX_NAME or not declared.isprintable():
            raise PermissionDenied(f"tenant name {declared[:MAX_NAME]!r} is not allowed")
        limited = uid in self.config.own_uids
        limits = self.limits(declared)  # a name entry: a uid's own is named "uid:N", refused above
        if limits is None:
            return self._get(own if limited else declared)
        if limits.uids is not None and uid not in limits.uids:
            raise PermissionDenied(f"uid {uid} may not declare tenant {declared!r}")
        if limited and limits.uids is None:
            raise PermissionDenied(
                f"uid {uid} is held to its own tenant {own!r}; tenant {declared!r} would need to list it in uids"
            )
        return self._get(declared)

    def unconfigured(self, uid: int, declared: str, charged: Tenant) -> str:
        """What a session that declared tenant ``declared`` and is charged to ``charged`` should be told, where a config
        names tenants and not this one (a name mistyped is charged elsewhere, or is a tenant of no limits); "" where
        nothing is amiss."""
        if not declared or not self.config.tenants or self.limits(declared) is not None:
            return ""
        if charged.name != declared:
            return (f"tenant {declared!r} is not in hbmd's config; uid {uid} has an entry of its own there, so its "
                    f"memory is charged to {charged.name!r}")
        return f"tenant {declared!r} is not in hbmd's config: it is a tenant of its own, with no limits"

    def named(self, name: str) -> Tenant:
        """Tenant ``name`` as recorded (a buffer restored after a restart names its own)."""
        return self._get(name)

    def hold(self, tenant: Tenant) -> None:
        tenant.holders += 1

    def let_go(self, tenant: Tenant) -> None:
        """One holder fewer; a tenant left without any is forgotten (names must not pile up; a configured one is made
        again, with the config's limits, when next charged)."""
        tenant.holders -= 1
        if tenant.holders == 0:
            del self.by_name[tenant.name]

    def charge(self, tenant: Tenant, committed: int = 0, leased: int = 0, host: int = 0) -> None:
        """The one place committed, leased and host-tier bytes change: the tenant's use and the instance's totals."""
        self.committed_bytes += committed
        self.leased_bytes += leased
        self.host_bytes += host
        unmet = tenant.unmet_guarantee
        tenant.used_bytes += committed + leased
        tenant.leased_bytes += leased
        tenant.host_bytes += host
        self.unmet_guarantees += tenant.unmet_guarantee - unmet

    def host_room(self) -> int:
        """Host-tier bytes left: what demotes may still take."""
        return max(0, self.host_budget_bytes - self.host_bytes)

    def admit_host(self, requested: int, purpose: str) -> None:
        """Check ``requested`` more host-tier bytes against the host budget; ``OutOfBudget`` saying why not.

        The host tier is one pool for every tenant: a tenant's demoted bytes
        leave its device limits and count here only.
        """
        if not self.host_budget_bytes:
            raise OutOfBudget(
                f"{purpose}: this daemon has no host tier; start hbmd with --host-budget SIZE to demote buffers",
                requested=requested, budget=0,
            )
        if self.host_bytes + requested > self.host_budget_bytes:
            raise OutOfBudget(
                f"{purpose} of {format_bytes(requested)} does not fit the host budget: "
                f"budget {format_bytes(self.host_budget_bytes)}, used {format_bytes(self.host_bytes)}, "
                f"requested {format_bytes(requested)}",
                budget=self.host_budget_bytes, used=self.host_bytes, requested=requested,
            )

    def held_for_others(self, tenant: Tenant) -> int:
        """Bytes of the budget held for other tenants' guaranteed minimums, as far as they have not used them."""
        return self.unmet_guarantees - tenant.unmet_guarantee

    def admissible(self, tenant: Tenant) -> int:
        """Budget left for ``tenant``: the most a commit charged to it would be admitted for now (what :meth:`admit`
        allows)."""
        room = self.budget_bytes - self.committed_bytes - self.leased_bytes - self.held_for_others(tenant)
        if tenant.max_bytes is not None:
            room = min(room, tenant.max_bytes - tenant.used_bytes)
        return max(0, room)

    def admit(self, tenant: Tenant, requested: int, purpose: str, withheld: int = 0, in_use: bool = False) -> None:
        """Check ``requested`` more bytes against the tenant's maximum, the budget and others' guarantees.

        ``in_use``: the memory exists already (declared again by its client
        after a restart): leases are room, being asked back. Others'
        guarantees hold it back as they would a commit of it: a declaration
        is never a way past them. Raises ``OutOfBudget`` saying which limit
        it met, and whether a retry may find room: leased bytes are being
        asked back, except ``withheld`` ones, asked back long ago from
        sessions that do not answer.
        """
        if tenant.max_bytes is not None and tenant.used_bytes + requested > tenant.max_bytes:
            raise OutOfBudget(
                f"{purpose} of {format_bytes(requested)} exceeds the budget of tenant {tenant.name!r}: "
                f"max {format_bytes(tenant.max_bytes)}, used {format_bytes(tenant.used_bytes)}, "
                f"requested {format_bytes(requested)}",
                tenant=tenant.name,
                budget=tenant.max_bytes,
                used=tenant.used_bytes,
                requested=requested,
            )
        held = self.held_for_others(tenant)
        used = self.committed_bytes + (0 if in_use else self.leased_bytes)
        if used + requested + held > self.budget_bytes:
            extra = f", {format_bytes(held)} held for other tenants' guaranteed minimums" if held else ""
            if self.leased_bytes > withheld and not in_use:
                extra += f", {format_bytes(self.leased_bytes - withheld)} of it leased (being asked back: retry)"
            if withheld and not in_use:
                extra += (f", {format_bytes(withheld)} of it leased to sessions that have not given it back when asked "
                          "(it is theirs until they read the request or end)")
            raise OutOfBudget(
                f"{purpose} of {format_bytes(requested)} does not fit the budget: "
                f"budget {format_bytes(self.budget_bytes)}, used {format_bytes(used)}, "
                f"requested {format_bytes(requested)}{extra}",
                budget=self.budget_bytes,
                used=used,
                requested=requested,
                held=held,
            )

    def admit_transfer(self, source: Tenant, target: Tenant, moved: int, purpose: str) -> None:
        """Check that ``moved`` committed bytes charged to ``source`` may be charged to ``target`` instead (a graft):
        within ``target``'s maximum, and without taking the room of a guarantee, as a commit of them would not. The
        budget's total does not change. Raises ``OutOfBudget`` saying which limit it met."""
        if source is target or not moved:
            return
        if target.max_bytes is not None and target.used_bytes + moved > target.max_bytes:
            raise OutOfBudget(
                f"{purpose} of {format_bytes(moved)} exceeds the budget of tenant {target.name!r}: "
                f"max {format_bytes(target.max_bytes)}, used {format_bytes(target.used_bytes)}, "
                f"requested {format_bytes(moved)}",
                tenant=target.name, budget=target.max_bytes, used=target.used_bytes, requested=moved,
            )
        # The source may fall below its guarantee, which the budget must then hold room for.
        unmet = (self.unmet_guarantees - source.unmet_guarantee - target.unmet_guarantee
                 + max(0, source.guaranteed_bytes - source.used_bytes + moved)
                 + max(0, target.guaranteed_bytes - target.used_bytes - moved))
        if unmet > self.unmet_guarantees and self.committed_bytes + self.leased_bytes + unmet > self.budget_bytes:
            raise OutOfBudget(
                f"{purpose} of {format_bytes(moved)} would leave the budget no room for tenant {source.name!r}'s "
                f"guaranteed minimum of {format_bytes(source.guaranteed_bytes)}",
                tenant=source.name, budget=self.budget_bytes, requested=moved,
            )

    def lease_room(self, tenant: Tenant) -> int:
        """Bytes that may be leased to a session of ``tenant`` now.

        None while the tenant's room would drop below a 16th of the budget,
        or all leases together would pass an 8th of it.
        """
        room = self.admissible(tenant) - self.budget_bytes // LEASE_TIGHT_DIVISOR
        return max(0, min(room, self.budget_bytes // LEASE_TOTAL_DIVISOR - self.leased_bytes))

    def demotable(self) -> list[Tenant]:
        """The tenants whose idle buffers are demoted under pressure, in the config's order (its ``demote``)."""
        ranked = []
        for tenant in self.by_name.values():
            limits = self.limits(tenant.name)
            if limits is not None and limits.demote is not None and not tenant.guaranteed_bytes:
                ranked.append((limits.demote, tenant.name, tenant))
        return [tenant for *_, tenant in sorted(ranked, key=lambda r: r[:2])]

    def short_of_guarantee(self, tenant: Tenant, requested: int) -> bool:
        """Whether ``requested`` more bytes would still be within the tenant's guaranteed minimum."""
        return tenant.used_bytes + requested <= tenant.guaranteed_bytes

    def over_guarantee(self) -> Iterable[tuple[Tenant, int]]:
        """Each tenant using more than its guarantee, with the excess."""
        for tenant in self.by_name.values():
            excess = tenant.used_bytes - tenant.guaranteed_bytes
            if excess > 0:
                yield tenant, excess

    def reconfigure(self, config: Config) -> None:
        """Make ``config`` the one in force: limits change in place, for tenants made now and later alike.

        Raises :class:`ConfigError`, changing nothing, where ``config``
        breaks what was already admitted: a new maximum below what a tenant
        has committed, or guaranteed minimums that no longer fit beside the
        memory committed. Leased granules do not count: they are asked back.
        """
        # Only a tenant in use holds anything: one the config names but nobody uses is owed its whole guarantee.
        unmet = config.guaranteed_bytes
        for tenant in self.by_name.values():
            limits = config.by_name.get(tenant.name)
            if limits is None:
                continue
            held = tenant.committed_bytes
            if limits.max_bytes is not None and held > limits.max_bytes:
                raise ConfigError(
                    f"tenant {tenant.name!r} holds {format_bytes(held)}, "
                    f"over its new max of {format_bytes(limits.max_bytes)}"
                )
            unmet -= min(held, limits.guaranteed_bytes)
        if self.committed_bytes + unmet > self.budget_bytes:
            raise ConfigError(
                f"the guaranteed minimums need {format_bytes(unmet)} more, but only "
                f"{format_bytes(self.budget_bytes - self.committed_bytes)} of the budget is uncommitted"
            )
        self.config = config
        self.unmet_guarantees = config.guaranteed_bytes
        for tenant in self.by_name.values():
            limits = config.by_name.get(tenant.name)
            tenant.max_bytes = limits.max_bytes if limits else None
            tenant.guaranteed_bytes = limits.guaranteed_bytes if limits else 0
            self.unmet_guarantees -= tenant.guaranteed_bytes - tenant.unmet_guarantee

    def infos(self, names: set[str] | None, sessions_of: dict[str, int]) -> list[TenantInfo]:
        """Every tenant in use by name (or those in ``names``), with ``sessions_of[name]`` sessions each."""
        chosen = self.by_name.values() if names is None else (self.by_name[n] for n in names if n in self.by_name)
        return [
            TenantInfo(t.name, t.used_bytes, t.guaranteed_bytes, -1 if t.max_bytes is None else t.max_bytes,
                       sessions_of.get(t.name, 0), t.host_bytes)
            for t in sorted(chosen, key=lambda t: t.name)
        ]

    def listed(self, names: set[str] | None, sessions_of: dict[str, int], limit: int) -> tuple[list[TenantInfo], int]:
        """What status lists, by name, and how many more there are: the tenants in use (or those in ``names``), and
        where ``names`` is None the configured ones with a guaranteed minimum, in use or not, since what they are
        owed is held back from every other; at most ``limit``, those with limits kept first, then the most used.

        It walks the tenants in use, and of the configured ones no more than
        it lists: a config may name tens of thousands.
        """
        in_use = sorted(self.infos(names, sessions_of), key=_listing_order)
        owed: Iterable[TenantInfo] = ()
        unused = 0
        if names is None:
            # Unused, each sorts as (False, 0, name): the config's order by name is the listing's.
            owed = (unused_info(limits) for limits in self.config.guaranteeing if limits.name not in self.by_name)
            unused = len(self.config.guaranteeing) - sum(1 for t in self.by_name.values() if t.guaranteed_bytes)
        shown = list(itertools.islice(heapq.merge(in_use, owed, key=_listing_order), limit))
        return sorted(shown, key=lambda t: t.name), len(in_use) + unused - len(shown)
