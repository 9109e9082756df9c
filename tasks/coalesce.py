"""The group-committed verbs: concurrent submits, results, starts and leases
of one application in this server process are decided together, in one
transaction per round (tasks.actions.rounds, workers.groupcommit).

The round applies exactly the per-item rules of each single verb and returns
one outcome per item, so a request's answer never depends on which others
happened to share its transaction."""

from __future__ import annotations

from typing import cast

from orbit.idempotency import Actor
from tasks.actions.batch import Outcome, Submission
from tasks.actions.rounds import Answer, RoundItem, SubmitRequest, run_round
from workers.groupcommit import GroupCommit

ROUNDS: GroupCommit[RoundItem, Answer] = GroupCommit("round", run_round)


def submit_coalesced(actor: Actor, submission: Submission) -> Outcome:
    # A submit's answer is its Receipt (a refusal is raised).
    return cast(Outcome, ROUNDS.call(actor.principal.application_id, SubmitRequest(actor, submission)))
