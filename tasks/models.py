"""Tasks, their attempts, and the per-key permit rows of keyed concurrency."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models

from orbit.fields import BinaryCharField, IdField, id_primary_key, uint32, uint64


class TaskState(models.TextChoices):
    BLOCKED = "BLOCKED"
    WAITING = "WAITING"
    LEASED = "LEASED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NEEDS_REVIEW = "NEEDS_REVIEW"


FINAL_TASK_STATES = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})
# The states in which a task fails when its deadline passes: the sweep's computed
# columns and its check under lock (endings.fail_for_deadline) both read these.
SWEPT_STATES = [TaskState.BLOCKED, TaskState.WAITING, TaskState.LEASED]


class DependencyFailure(models.TextChoices):
    CANCEL = "CANCEL"
    RUN = "RUN"


class AttemptState(models.TextChoices):
    LEASED = "LEASED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"
    EXPIRED = "EXPIRED"
    RELEASED = "RELEASED"
    CANCELLED = "CANCELLED"


ACTIVE_ATTEMPT_STATES = frozenset({AttemptState.LEASED, AttemptState.RUNNING})


class Task(models.Model):
    id = id_primary_key("任务ID，32位小写十六进制")
    namespace_id = IdField(db_comment="所属命名空间ID")
    application_id = IdField(db_comment="所属应用ID（冗余，按固定顺序加锁时使用）")
    queue_id = IdField(db_comment="所属队列ID")
    handler = BinaryCharField(max_length=128, db_comment="处理器名称")
    handler_version = BinaryCharField(max_length=64, db_comment="处理器版本")
    payload_version = BinaryCharField(max_length=64, db_comment="负载格式版本")
    payload = models.JSONField(db_comment="任务负载（JSON，编码后不超过 256 KiB）")
    business_key = BinaryCharField(
        max_length=191, blank=True, default="", db_comment="业务追踪键；只用于关联，不限制并发、不去重；空串表示无"
    )
    concurrency_key = BinaryCharField(
        max_length=191, blank=True, default="", db_comment="资源键，受理时冻结；空串表示不参与资源互斥"
    )
    fairness_key = BinaryCharField(
        max_length=191,
        blank=True,
        default="",
        db_comment="公平分组键：同优先级内按分组轮转领取；空串表示无分组（全部无键任务为一组）",
    )
    key_ready = models.BooleanField(
        default=True,
        db_comment="资源键就绪：同一命名空间、资源键和队列的等待任务中只有一个为真，其余不进入领取扫描；无键任务恒为真",
    )
    priority = models.PositiveSmallIntegerField(default=5, db_comment="优先级 0–9，越大越先领取")
    state = models.CharField(max_length=16, choices=TaskState.choices, db_comment="任务状态")
    attempts = models.PositiveIntegerField(default=0, db_comment="已批准 Start 的尝试次数")
    max_attempts = models.PositiveSmallIntegerField(default=3, db_comment="最大尝试次数 1–100")
    epoch = models.PositiveIntegerField(default=0, db_comment="租约纪元：每次领取加一")
    available_at = models.DateTimeField(db_comment="最早可领取时间（含重试退避）")
    start_deadline_at = models.DateTimeField(null=True, blank=True, db_comment="开始截止时间；到期仍未开始则失败")
    deadline_at = models.DateTimeField(null=True, blank=True, db_comment="总截止时间；之后不再开始或续租")
    retry_initial_seconds = models.FloatField(default=1, db_comment="重试首次退避秒数")
    retry_multiplier = models.FloatField(default=2, db_comment="重试退避倍数")
    retry_max_seconds = models.FloatField(default=300, db_comment="重试最大退避秒数")
    lease_seconds = models.PositiveIntegerField(default=30, db_comment="每次租约秒数 5–3600")
    cancel_requested = models.BooleanField(default=False, db_comment="运行中取消意图；Worker 在续租时获知")
    depends_on = models.JSONField(
        null=True, blank=True, db_comment="依赖的任务ID列表（受理时冻结，按提交顺序）；空表示无依赖"
    )
    on_dependency_failure = models.CharField(
        max_length=8,
        choices=DependencyFailure.choices,
        default=DependencyFailure.CANCEL,
        db_comment="依赖失败或取消时：CANCEL 随之取消，RUN 等其余依赖结束后照常运行",
    )
    blocked_by = uint32("尚未结算的依赖数：为 0 且处于 BLOCKED 时转为 WAITING", default=0)
    has_dependents = models.BooleanField(
        default=False, db_comment="是否有依赖方任务：进入终态时据此结算依赖边（无依赖方的任务结束不多一次查询）"
    )
    output = models.JSONField(null=True, blank=True, db_comment="成功结果输出")
    last_error = models.JSONField(null=True, blank=True, db_comment="最近一次错误")
    created_at = models.DateTimeField(db_comment="受理时间（UTC）")
    updated_at = models.DateTimeField(db_comment="最后状态变化时间（UTC）")
    finished_at = models.DateTimeField(null=True, blank=True, db_comment="进入 SUCCEEDED/FAILED/CANCELLED 的时间")
    # What the deadline sweep looks for, computed by the database: a deadline
    # only while the task can still miss it, NULL otherwise. Indexed instead of
    # (state, deadline), whose entries every state change of every task
    # rewrote; these change only when a task with a deadline leaves WAITING/LEASED.
    deadline_due_at = models.GeneratedField(
        expression=models.Case(models.When(state__in=SWEPT_STATES, then=models.F("deadline_at"))),
        output_field=models.DateTimeField(null=True),
        db_persist=False,
        db_comment="总截止时间（仅 BLOCKED/WAITING/LEASED 时，供截止扫描索引；其余为空）",
    )
    start_deadline_due_at = models.GeneratedField(
        expression=models.Case(models.When(state__in=SWEPT_STATES, attempts=0, then=models.F("start_deadline_at"))),
        output_field=models.DateTimeField(null=True),
        db_persist=False,
        db_comment="开始截止时间（仅未开始过的 BLOCKED/WAITING/LEASED 任务，供截止扫描索引；其余为空）",
    )

    # Not a column: a fair queue's candidate's place in the lease's round
    # robin (tasks.actions.fairness), set on the rows a lease scans.
    fair_rank: tuple[Any, ...] = ()

    class Meta:
        db_table = "orbit_task"
        db_table_comment = "任务：受理后冻结的定义与当前状态"
        indexes = [
            # Matches the lease ORDER BY so one queue's scan stops at LIMIT.
            models.Index(
                fields=["queue_id", "state", "key_ready", "-priority", "available_at", "id"], name="idx_task_dispatch"
            ),
            models.Index(fields=["namespace_id", "queue_id", "created_at"], name="idx_task_ns_queue"),
            # Finds a key's waiting siblings in one queue, in promotion order; fairness_key
            # last, so a fair queue's lease ranks a key's fairness groups from the index alone.
            models.Index(
                fields=[
                    "namespace_id",
                    "concurrency_key",
                    "queue_id",
                    "state",
                    "-priority",
                    "available_at",
                    "id",
                    "fairness_key",
                ],
                name="idx_task_ns_ckey",
            ),
            models.Index(fields=["namespace_id", "business_key"], name="idx_task_ns_bkey"),
            models.Index(fields=["start_deadline_due_at"], name="idx_task_start_deadline_due"),
            models.Index(fields=["deadline_due_at"], name="idx_task_deadline_due"),
        ]

    def __str__(self) -> str:
        return self.id


class TaskDependency(models.Model):
    """One edge of the dependency graph: `task_id` waits for `depends_on_id`.
    Settled once, in the transaction that ends the dependency (or its
    follow-up): the dependent's blocked_by goes down by one, or, for a failed
    dependency under CANCEL, the dependent is cancelled."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    task_id = IdField(db_comment="依赖方任务ID（等待者）")
    depends_on_id = IdField(db_comment="被依赖的任务ID")
    position = models.PositiveSmallIntegerField(db_comment="在依赖方 depends_on 中的序号")
    settled = models.BooleanField(default=False, db_comment="被依赖任务结束后是否已结算到依赖方")

    class Meta:
        db_table = "orbit_task_dependency"
        db_table_comment = "任务依赖边：依赖方在全部依赖结束前保持 BLOCKED"
        constraints = [models.UniqueConstraint(fields=["task_id", "depends_on_id"], name="uniq_dependency_edge")]
        indexes = [
            # A dependency's dependents still to settle, in edge order (the follow-up's chunks).
            models.Index(fields=["depends_on_id", "settled", "id"], name="idx_dependency_parent"),
        ]


class DependencySettlement(models.Model):
    """A finished task whose dependents were not all settled in the
    transaction that ended it (a wide fan-out): the follow-up settles the
    rest in chunks, each its own transaction, then deletes this row. Written
    in the ending's transaction, so a crash between chunks loses nothing."""

    task_id = IdField(primary_key=True, db_comment="已结束、依赖边尚未全部结算的任务ID")
    namespace_id = IdField(db_comment="命名空间ID")
    application_id = IdField(db_comment="所属应用ID（结算时先锁其运行计数行）")
    created_at = models.DateTimeField(db_comment="任务结束时间（UTC）")

    class Meta:
        db_table = "orbit_dependency_settlement"
        db_table_comment = "待结算的依赖：宽扇出的依赖边分批结算，全部结算后删除"


def started_with_its_lease(started_at: datetime | None, leased_at: datetime) -> bool:
    """A Start made by the round that leased the attempt (a result's start_next,
    "started ahead"), not by a task.start of its own: both times are that round's."""
    return started_at is not None and started_at == leased_at


class Attempt(models.Model):
    id = id_primary_key("尝试ID，32位小写十六进制")
    task_id = IdField(db_comment="所属任务ID")
    namespace_id = IdField(db_comment="所属命名空间ID")
    application_id = IdField(db_comment="所属应用ID（冗余）")
    queue_id = IdField(db_comment="所属队列ID（冗余）")
    number = models.PositiveIntegerField(null=True, blank=True, db_comment="尝试序号，Start 获批时设定")
    state = models.CharField(max_length=16, choices=AttemptState.choices, db_comment="尝试状态")
    epoch = models.PositiveIntegerField(db_comment="租约纪元，等于领取时任务的纪元")
    concurrency_key = BinaryCharField(max_length=191, blank=True, default="", db_comment="资源键（冗余）；空串表示无")
    concurrency_token = uint64("资源键许可序号；无资源键为 NULL", null=True, blank=True)
    concurrency_slot = models.PositiveIntegerField(
        null=True, blank=True, db_comment="资源键许可槽位 0…N−1；容量为 1 时为 NULL"
    )
    key_rate_reserved = models.BooleanField(
        default=False, db_comment="领取时是否为资源键速率预留了一次 Start（Start 或释放时归还）"
    )
    worker_id = BinaryCharField(max_length=128, db_comment="持有租约的 Worker 进程身份，按字节精确比较")
    session_id = IdField(db_comment="派发时的 Worker 会话ID")
    leased_at = models.DateTimeField(db_comment="领取时间（UTC）")
    lease_expires_at = models.DateTimeField(db_comment="租约到期时间；续租延长")
    started_at = models.DateTimeField(null=True, blank=True, db_comment="Start 获批时间")
    finished_at = models.DateTimeField(null=True, blank=True, db_comment="尝试结束时间")
    outcome = models.CharField(max_length=16, blank=True, default="", db_comment="上报结果：SUCCEEDED/FAILED/UNKNOWN")
    retryable = models.BooleanField(default=False, db_comment="失败是否可安全重试")
    output = models.JSONField(null=True, blank=True, db_comment="上报的输出")
    error = models.JSONField(null=True, blank=True, db_comment="上报或恢复时记录的错误")
    late_outcome = models.JSONField(null=True, blank=True, db_comment="尝试结束后迟到的结果证据，不改变状态和计数")

    class Meta:
        db_table = "orbit_attempt"
        db_table_comment = "尝试：一次租约及其开始、续租与结果"
        indexes = [
            models.Index(fields=["task_id", "epoch"], name="idx_attempt_task_epoch"),
            models.Index(fields=["state", "lease_expires_at"], name="idx_attempt_expiry"),
            models.Index(fields=["worker_id", "state"], name="idx_attempt_worker"),
            models.Index(fields=["namespace_id", "concurrency_key", "leased_at"], name="idx_attempt_ckey"),
            # The admin's token history, newest lease first (one insert per lease, at the index's end).
            models.Index(fields=["leased_at"], name="idx_attempt_leased"),
        ]


class ConcurrencyKey(models.Model):
    """One row per (namespace, key), never deleted or reset: its version is the
    source of strictly increasing permit tokens. Slot 0's holder is on this
    row; slots 1…N−1 of a key with capacity N are ConcurrencySlot rows."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    key = BinaryCharField(max_length=191, db_comment="资源键，按 UTF-8 字节精确匹配")
    version = uint64("资源行版本：每次领取和释放都加一；新许可序号等于领取后的版本", default=0)
    holder_attempt_id = IdField(blank=True, default="", db_comment="槽位 0 当前持有许可的尝试ID；空串表示空闲")
    holder_task_id = IdField(blank=True, default="", db_comment="槽位 0 当前持有许可的任务ID；空串表示空闲")
    holders = uint32("当前有效许可数（全部槽位）", default=0)
    capacity = uint32("按策略解析的容量（缓存，供领取扫描过滤；加锁后按策略重新判断）", default=1)
    rate_tat = models.DateTimeField(
        null=True, blank=True, db_comment="GCRA 理论到达时间：按速率下一次 Start 的理想时刻；空表示从未按速率开始"
    )
    rate_reserved = uint32("已按速率预留、尚未 Start 的尝试数", default=0)
    next_start_at = models.DateTimeField(
        null=True, blank=True, db_comment="按速率下一次可领取的最早时间（缓存，供领取扫描过滤）；空表示不限速"
    )
    updated_at = models.DateTimeField(db_comment="最后领取或释放时间（UTC）")

    class Meta:
        db_table = "orbit_concurrency_key"
        db_table_comment = "资源键许可行：同一命名空间内跨队列共享容量个有效许可，序号单调递增"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "key"], name="uniq_ckey_ns_key")]
        indexes = [
            # When the next rate-limited key of a namespace reopens (the lease's wake-up).
            models.Index(fields=["namespace_id", "next_start_at"], name="idx_ckey_ns_next_start"),
        ]


class ConcurrencySlot(models.Model):
    """Slots 1…N−1 of a key with capacity N, made the first time each is
    granted. Read and changed only while holding its key's row lock, which
    serializes every change to a key's slots."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    key = BinaryCharField(max_length=191, db_comment="资源键，按 UTF-8 字节精确匹配")
    slot = uint32("槽位序号 1…N−1（槽位 0 在资源键行上）")
    holder_attempt_id = IdField(blank=True, default="", db_comment="当前持有该槽位许可的尝试ID；空串表示空闲")
    holder_task_id = IdField(blank=True, default="", db_comment="当前持有该槽位许可的任务ID；空串表示空闲")
    token = uint64("该槽位最近一次许可的序号", default=0)
    updated_at = models.DateTimeField(db_comment="最后领取或释放时间（UTC）")

    class Meta:
        db_table = "orbit_concurrency_slot"
        db_table_comment = "资源键许可槽位：容量大于 1 的资源键的槽位 1…N−1，仅在持有资源键行锁时读写"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "key", "slot"], name="uniq_cslot_ns_key_slot")]


class KeyMatch(models.TextChoices):
    KEY = "key"
    PREFIX = "prefix"


class KeyPolicy(models.Model):
    """Capacity and start rate for the keys it matches: an exact key beats the
    longest matching prefix, which beats the default (capacity 1, no rate)."""

    id = id_primary_key("资源键策略ID，32位小写十六进制")
    namespace_id = IdField(db_comment="所属命名空间ID")
    match_kind = models.CharField(max_length=8, choices=KeyMatch.choices, db_comment="匹配方式：key 精确、prefix 前缀")
    match_value = BinaryCharField(max_length=191, db_comment="匹配的资源键或前缀，按字节精确比较")
    capacity = uint32("每个匹配资源键的有效许可上限 1–1000", default=1)
    rate_starts = uint32("速率：每个周期批准的 Start 数 1–100000；空表示不限速", null=True, blank=True)
    rate_per_seconds = uint32("速率周期秒数 1–3600；空表示不限速", null=True, blank=True)
    rate_burst = uint32("速率突发上限 1–100000；空表示不限速", null=True, blank=True)
    revision = uint64("策略版本，每次配置加一", default=1)
    # NULL once retired: the unique constraint then holds among live policies only.
    live = models.BooleanField(null=True, default=True, db_comment="生效中为真；退役后为空（唯一约束只约束生效策略）")
    applied_revision = uint64("已同步到资源键行缓存的策略版本（容量与速率缓存的补齐进度）", default=0)
    retired_at = models.DateTimeField(null=True, blank=True, db_comment="退役时间；空表示生效中")
    created_at = models.DateTimeField(db_comment="创建时间（UTC）")
    updated_at = models.DateTimeField(db_comment="最后修改时间（UTC）")

    class Meta:
        db_table = "orbit_key_policy"
        verbose_name_plural = "key policies"
        db_table_comment = "资源键策略：按精确键或前缀设置容量与 Start 速率"
        constraints = [
            models.UniqueConstraint(
                fields=["namespace_id", "match_kind", "match_value", "live"], name="uniq_key_policy_live_match"
            )
        ]
        indexes = [models.Index(fields=["namespace_id", "live"], name="idx_key_policy_ns_live")]


class FairShare(models.Model):
    """When each fairness group of a queue was last served by a lease: the
    lease serves the group served least recently first."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    queue_id = IdField(db_comment="队列ID")
    fairness_key = BinaryCharField(max_length=191, blank=True, default="", db_comment="公平分组键；空串为无分组任务")
    served_at = models.DateTimeField(db_comment="该分组最近一次被领取的时间（UTC）")

    class Meta:
        db_table = "orbit_fair_share"
        db_table_comment = "公平分组：每个队列内各分组最近一次被领取的时间，领取按最久未服务优先轮转"
        constraints = [models.UniqueConstraint(fields=["queue_id", "fairness_key"], name="uniq_fair_share_queue_key")]


class QueueMinute(models.Model):
    """Per queue and UTC minute: approved Starts and recorded results, added
    in the transactions that approve and record them (tasks.actions.rollup), so
    the console charts the last hour without scanning attempts."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    queue_id = IdField(db_comment="队列ID")
    minute = models.DateTimeField(db_comment="UTC 分钟起点（秒与微秒为 0）")
    starts = models.PositiveIntegerField(default=0, db_comment="该分钟内批准的 Start 次数")
    results = models.PositiveIntegerField(default=0, db_comment="该分钟内记录的结果（结束尝试的结果上报）数")

    class Meta:
        db_table = "orbit_queue_minute"
        db_table_comment = "按队列与分钟汇总的启动数与结果数（控制台图表用，与状态变更同事务写入）"
        constraints = [models.UniqueConstraint(fields=["queue_id", "minute"], name="uniq_queue_minute")]


class WorkerIdentity(models.Model):
    """A worker process identity (worker_id) in a namespace: its fixed
    registration properties and its current session. The worker protocol
    (workers/) speaks for it; the verbs that grant leases lock it."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    worker_id = BinaryCharField(max_length=128, db_comment="Worker 进程的稳定身份，按字节精确比较")
    concurrency_keys = models.BooleanField(db_comment="是否声明支持资源键；同一身份固定不变")
    credential_id = IdField(db_comment="最近一次连接使用的凭据ID")
    session_id = IdField(db_comment="最近一次会话ID")
    connected_at = models.DateTimeField(db_comment="最近一次握手时间（UTC）")
    queue_ids = models.JSONField(default=list, db_comment="当前会话 hello 声明消费的队列ID列表")
    handlers = models.JSONField(
        default=list, db_comment="当前会话 hello 声明的处理器列表 [[handler, handler_version], ...]；空表示任意"
    )
    seen_at = models.DateTimeField(null=True, db_comment="当前会话连接最近一次心跳时间（UTC）；连接关闭后为空")
    capacity = models.PositiveIntegerField(
        default=0, db_comment="当前会话 hello 声明的容量；0 表示未记录（升级前的会话）"
    )

    class Meta:
        db_table = "orbit_worker_identity"
        verbose_name_plural = "worker identities"
        db_table_comment = "Worker 身份：注册属性（资源键支持）按进程身份固定"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "worker_id"], name="uniq_worker_ns_identity")]
