"""Ray's exception names (``ray.exceptions``), for code ported from Ray.

With ``import pmetal as ray``, ``ray.exceptions.RayActorError`` and ``from
ray.exceptions import GetTimeoutError`` name the pmetal classes below. Every
name here is one of the classes of :mod:`pmetal.errors` (the tree is drawn
there); where Ray splits what pmetal raises as one error, the Ray name is an
alias of the pmetal class that covers it:

=========================  =========================================================
Ray name                   what it is in pmetal
=========================  =========================================================
``RayError``               :class:`~pmetal.errors.PMetalError`, the root
``RaySystemError``         :class:`~pmetal.errors.PMetalError`, the root
``RayTaskError``           :class:`~pmetal.errors.RemoteError`: user code raised in
                           a task or actor method (also an instance of its type)
``RayActorError``          :class:`~pmetal.errors.ActorDiedError` (Ray's base of
                           ``ActorDiedError``): the actor died or was killed
``ActorDiedError``         :class:`~pmetal.errors.ActorDiedError`
``ActorUnavailableError``  :class:`~pmetal.errors.ActorUnavailableError` (not raised yet)
``WorkerCrashedError``     :class:`~pmetal.errors.WorkerCrashedError`: a task's worker
                           died (also an ``ActorDiedError``)
``GetTimeoutError``        :class:`~pmetal.errors.GetTimeoutError` (also ``TimeoutError``)
``TaskCancelledError``     :class:`~pmetal.errors.TaskCancelledError`: ``pmetal.cancel``
``ObjectLostError``        :class:`~pmetal.errors.ObjectLostError`: its owner freed it
``OwnerDiedError``         :class:`~pmetal.errors.OwnerDiedError`: its owner died
``RuntimeEnvSetupError``   :class:`~pmetal.errors.RuntimeEnvSetupError`: a working_dir
                           could not be had or did not match its sha256
``TaskUnschedulableError`` :class:`~pmetal.errors.PlacementError`: no node can host it
``ActorUnschedulableError`` :class:`~pmetal.errors.PlacementError`
=========================  =========================================================
"""

from __future__ import annotations

from pmetal.errors import (ActorDiedError, ActorUnavailableError, GetTimeoutError,
                           ObjectLostError, OwnerDiedError, PlacementError, PMetalError,
                           RemoteError, RuntimeEnvSetupError, TaskCancelledError,
                           WorkerCrashedError)

__all__ = [
    "ActorDiedError",
    "ActorUnavailableError",
    "ActorUnschedulableError",
    "GetTimeoutError",
    "ObjectLostError",
    "OwnerDiedError",
    "RayActorError",
    "RayError",
    "RaySystemError",
    "RayTaskError",
    "RuntimeEnvSetupError",
    "TaskCancelledError",
    "TaskUnschedulableError",
    "WorkerCrashedError",
]

RayError = PMetalError
RaySystemError = PMetalError
RayTaskError = RemoteError
RayActorError = ActorDiedError
TaskUnschedulableError = PlacementError
ActorUnschedulableError = PlacementError
