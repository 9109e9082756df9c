"""The key policy endpoints (SPEC §12): /v1/key-policies.

Writes take keys:manage, reads keys:manage or tasks:read, each over every
queue (a policy is about keys, which every queue of the namespace shares).
After a write commits, the view refreshes the key rows the policy matches
(tasks.actions.policies.reconcile_policy) before it answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from rest_framework.request import Request
from rest_framework.response import Response

from orbit.api.mutations import mutation
from orbit.api.responses import ok, page
from orbit.api.schema import documented
from orbit.api.views import OrbitView, decode_page_token, encode_page_token, page_size_of
from orbit.principal import Actor, Principal
from tasks.actions import policies
from tasks.policy_serializers import KeyPolicyConfigureInput, KeyPolicyCreateInput, KeyPolicyRetireInput

T = TypeVar("T")


def rule_of(fields: dict[str, Any]) -> policies.PolicyRule:
    rate = fields.get("rate")
    return policies.PolicyRule(
        capacity=fields.get("capacity", 1),
        rate=policies.PolicyRate(rate["starts"], rate["per_seconds"], rate.get("burst", 1)) if rate else None,
    )


def over_all_queues(principal: Principal, *_policy_id: str) -> None:
    """A write's check: the credential's range covers every queue, whatever policy it names."""
    principal.require_all_queues()


class ReconcilingView(OrbitView):
    """A policy write whose answer waits for the key rows' refresh: run after
    the transaction (the idempotency runner's) has committed, replays too
    (a no-op once the revision is applied)."""

    def mutate(
        self,
        request: Request,
        *,
        operation: str,
        target: str,
        validate: Callable[[dict[str, Any]], T],
        effect: Callable[[Actor, T], tuple[int, dict[str, Any]]],
    ) -> Response:
        response = super().mutate(request, operation=operation, target=target, validate=validate, effect=effect)
        policies.reconcile_after_commit(response.data["data"]["policy"]["id"])
        return response


class KeyPolicyCollectionView(ReconcilingView):
    @documented(data="KeyPolicyPage", operation_id="key_policies_list", paged=True)
    def get(self, request: Request) -> Response:
        """List key policies.

        The namespace's key policies, retired ones too, in id order, one page at a time (keys:manage
        or tasks:read, over all queues): pass a page's next_page_token as page_token for the next."""
        items, last_id = policies.policy_list(
            principal=self.principal(request), after_id=decode_page_token(request), limit=page_size_of(request)
        )
        return ok(request, page(items, encode_page_token(last_id) if last_id else ""))

    @mutation(
        KeyPolicyCreateInput,
        scope="keys:manage",
        operation="key_policy.create",
        check=over_all_queues,
        data="KeyPolicyReceipt",
        created=True,
        operation_id="key_policies_create",
    )
    def post(self, actor: Actor, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Create a key policy.

        A capacity (1–1000, default 1) and optionally a start rate for one key (match.key) or for
        each key starting with a prefix (match.prefix), compared byte for byte: an exact key
        policy wins, else the longest matching prefix, else capacity 1 and no rate. A second live
        policy with the same match is 409 STATE_CONFLICT. Needs keys:manage over all queues; 201
        with the policy, and the same Idempotency-Key with the same body replays that answer (200)."""
        ((kind, value),) = fields["match"].items()
        policy = policies.policy_create(
            actor=actor, kind=kind, value=value, rule=rule_of(fields), reason=fields["reason"]
        )
        return 201, {"policy": policy}


class KeyPolicyDetailView(OrbitView):
    @documented(data="KeyPolicy", operation_id="key_policies_get")
    def get(self, request: Request, policy_id: str) -> Response:
        """Get a key policy.

        Its match, capacity, rate and revision (keys:manage or tasks:read, over all queues); a
        retired policy answers too, with retired_at. 404 for a policy of another namespace."""
        return ok(request, policies.policy_get(principal=self.principal(request), policy_id=policy_id))


class KeyPolicyConfigureView(ReconcilingView):
    @mutation(
        KeyPolicyConfigureInput,
        scope="keys:manage",
        operation="key_policy.configure",
        check=over_all_queues,
        data="KeyPolicyReceipt",
        operation_id="key_policies_configure",
    )
    def post(self, actor: Actor, fields: dict[str, Any], policy_id: str) -> tuple[int, dict[str, Any]]:
        """Configure a key policy: its capacity and rate.

        Sends the whole rule (capacity, and rate if any: omitted, the policy has none) with the
        revision it was read at (expected_revision: another one is 409 STATE_CONFLICT) and a
        reason for the audit log. The match stays. Lowering the capacity keeps current holders."""
        policy = policies.policy_configure(
            actor=actor,
            policy_id=policy_id,
            expected_revision=fields["expected_revision"],
            reason=fields["reason"],
            rule=rule_of(fields),
        )
        return 200, {"policy": policy}


class KeyPolicyRetireView(ReconcilingView):
    @mutation(
        KeyPolicyRetireInput,
        scope="keys:manage",
        operation="key_policy.retire",
        check=over_all_queues,
        data="KeyPolicyReceipt",
        operation_id="key_policies_retire",
    )
    def post(self, actor: Actor, fields: dict[str, Any], policy_id: str) -> tuple[int, dict[str, Any]]:
        """Retire a key policy, for good.

        Its keys fall back to the next rule that matches them (a shorter prefix, or capacity 1
        and no rate) and its match is free for a new policy; reads keep answering it."""
        policy = policies.policy_retire(
            actor=actor, policy_id=policy_id, expected_revision=fields["expected_revision"], reason=fields["reason"]
        )
        return 200, {"policy": policy}
