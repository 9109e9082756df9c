"""The group-committed verbs: concurrent submits of one application in this
server process commit together, and so do its results, starts and leases
(workers.groupcommit).

Each group function applies exactly the per-item rules of its single verb and
returns one outcome per item, so a request's answer never depends on which
others happened to share its transaction."""

from __future__ import annotations

from orbit.idempotency import Actor
from tasks.actions.batch import Outcome, Submission, submit_batch
from tasks.actions.rounds import Answer, RoundItem, run_round
from workers.groupcommit import GroupCommit


def _submit_group(requests: list[tuple[Actor, Submission]]) -> list[Outcome | BaseException]:
    """One batch per credential (range checks belong to the caller's principal).
    A key twice in one group goes to the next round, where it finds its twin's
    record and replays it."""
    outcomes: list[Outcome | BaseException | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    while pending:
        batches: dict[str, list[int]] = {}
        later: list[int] = []
        for index in pending:
            actor, submission = requests[index]
            batch = batches.setdefault(actor.principal.credential_id, [])
            if any(requests[other][1].key == submission.key for other in batch):
                later.append(index)
            else:
                batch.append(index)
        for batch in batches.values():
            try:
                results = submit_batch(actor=requests[batch[0]][0], items=[requests[i][1] for i in batch])
            except Exception as exc:
                results = [exc] * len(batch)
            for index, result in zip(batch, results, strict=True):
                outcomes[index] = result
        pending = later
    return outcomes  # type: ignore[return-value]


SUBMITS: GroupCommit[tuple[Actor, Submission], Outcome] = GroupCommit("submit", _submit_group)
# Results, starts and leases of an application share one lane (tasks.actions.rounds).
ROUNDS: GroupCommit[RoundItem, Answer] = GroupCommit("round", run_round)


def submit_coalesced(actor: Actor, submission: Submission) -> Outcome:
    return SUBMITS.call(actor.principal.application_id, (actor, submission))
