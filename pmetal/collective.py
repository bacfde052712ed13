"""Collective groups of actors, as Ray's ``ray.util.collective``.

From the driver (or any process that holds the handles)::

    workers = [Trainer.remote() for _ in range(4)]
    group = pmetal.collective.create_group(workers, name="dp")

Inside the actors' methods::

    g = pmetal.collective.get_group("dp")      # g.rank, g.size
    g.all_reduce(grads)                        # in place for numpy

The operations are methods of the group object (all_reduce, reduce,
broadcast, all_gather, reduce_scatter, barrier, send, recv; see
:class:`~pmetal.collectives.group.Group`), not module functions keyed by
a name. Members exchange data directly over TCP; the group's schedule
(strategy, ring order from the topology's link figures, chunk size) is
fixed when it forms and stamped with the master's term and membership
epoch. How the members find each other, and what happens when one dies:
:mod:`pmetal.collectives.rendezvous` and docs/collectives.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pmetal.actors.handles import ActorHandle
from pmetal.collectives import rendezvous
from pmetal.collectives.actorgroup import ActorGroup, GroupStatistics, join_group
from pmetal.collectives.group import Schedule
from pmetal.collectives.ops import ReduceOp
from pmetal.config import CollectiveConfig
from pmetal.errors import CollectiveError

__all__ = ["ActorGroup", "CollectiveConfig", "CollectiveError", "GroupHandle", "GroupStatistics",
           "ReduceOp", "create_group", "destroy_group", "get_group"]


@dataclass(frozen=True)
class GroupHandle:
    """What :func:`create_group` returns: the group as the driver sees it.
    ``members[r]`` is rank ``r``'s actor; ``epoch`` counts the formations
    of this name; ``term`` is the master's term when it formed;
    ``schedule`` the strategy, ring order and chunk size every member
    follows."""
    name: str
    size: int
    members: tuple[ActorHandle, ...]
    epoch: int
    term: int
    schedule: Schedule


def create_group(actors: Sequence[ActorHandle], *, name: str,
                 config: CollectiveConfig | None = None) -> GroupHandle:
    """Form collective group ``name`` over ``actors`` (rank ``r`` is
    ``actors[r]``). ``config`` may force the strategy and chunk size and
    sets the operations' timeout and the connection timeout (default: the
    ``collectives`` section of the configuration). Idempotent: the same
    actors and settings return the group there is, unless an operation
    failed in it. Otherwise it forms anew under the same name (a new
    epoch), for example over the survivors after a member died, or over
    the same members after one stalled; members then call
    :func:`get_group` again, and one that keeps using the old formation is
    refused with :class:`CollectiveError`."""
    formation, _ = rendezvous.form(actors, name, config)
    return GroupHandle(formation.name, formation.size, tuple(actors), formation.epoch,
                       formation.schedule.term, formation.schedule)


def get_group(name: str) -> ActorGroup:
    """This actor's membership of group ``name``: an object with ``rank``,
    ``size`` and the operations. Call it inside a method of a member; the
    first call of a formation connects to every other member, waiting up
    to ``connect_timeout`` for all of them to call it too, so every member
    must call it. Later calls return the same object while the group keeps
    its formation. Raises :class:`~pmetal.errors.PMetalValueError` outside
    an actor, for a name no group has, or in an actor that is not a
    member; :class:`CollectiveError` when the members do not all connect in
    time."""
    return join_group(name)


def destroy_group(name: str) -> bool:
    """End group ``name``: its rendezvous actor is killed (from the driver),
    and this process's membership closed (in a member). Members that still
    hold it are refused at their next failed operation or ``get_group``.
    False when there was no such group."""
    return rendezvous.destroy(name)
