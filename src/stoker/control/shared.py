"""What every part of one replica uses: its memory, the one writer, the specs and the clock."""

from __future__ import annotations

from dataclasses import dataclass

from stoker.control.book import Book
from stoker.control.catalog import Catalog
from stoker.control.ids import Ids
from stoker.control.journal import Journal
from stoker.control.ledger import Ledger
from stoker.control.lifecycle import Lifecycle
from stoker.control.metrics import Metrics
from stoker.control.rollouts import Rollouts
from stoker.domain.specs import PlaneSettings
from stoker.ports.clock import Clock
from stoker.ports.tracer import NO_TRACER, Tracer


@dataclass(frozen=True, slots=True)
class Shared:
    """Handed to every part; each part keeps the members it uses. The store's writer is
    only reachable through `lifecycle`."""

    #: This replica's memory (and its instance id).
    book: Book
    #: The only writer of workers and claims.
    lifecycle: Lifecycle
    catalog: Catalog
    #: Each pool's rollout plan: routing, reuse and sizing by revision.
    rollouts: Rollouts
    clock: Clock
    metrics: Metrics
    ids: Ids
    settings: PlaneSettings
    #: This replica's recent events (spawns, retirements, failures).
    journal: Journal
    #: Spans of each claim's steps (`NO_TRACER` unless tracing is on).
    tracer: Tracer = NO_TRACER
    #: What warmth costs and buys, and the claim log (`control.ledger`); None: not kept.
    ledger: Ledger | None = None
    #: Whether the replica keeps what only its readers see: the dashboard's samples and,
    #: while it leads, each pool's sizing in the store (`ControlPlane`'s `views`).
    views: bool = True
