"""Tenancy, credentials, idempotency records, audit rows and the event log."""

from __future__ import annotations

from django.db import models

from orbit.fields import BinaryCharField, IdField, id_primary_key, uint32, uint64

SCOPES = (
    "queues:read",
    "queues:manage",
    "tasks:submit",
    "tasks:read",
    "tasks:cancel",
    "workers:connect",
    "workers:consume",
    "plans:manage",
    "applications:manage",
    "keys:manage",
)

DEFAULT_APPLICATION_MAX_ACTIVE_ATTEMPTS = 100_000
DEFAULT_APPLICATION_MAX_UNFINISHED_TASKS = 10_000_000


class Application(models.Model):
    id = id_primary_key("应用ID，32位小写十六进制")
    name = BinaryCharField(max_length=128, unique=True, db_comment="应用名称，按字节精确比较")
    max_active_attempts = uint32(
        "应用跨全部命名空间的有效尝试上限（LEASED+RUNNING，有键尝试只计一次）",
        default=DEFAULT_APPLICATION_MAX_ACTIVE_ATTEMPTS,
    )
    max_unfinished_tasks = uint32(
        "应用跨全部命名空间的未终结任务上限", default=DEFAULT_APPLICATION_MAX_UNFINISHED_TASKS
    )
    revision = uint64("应用配置版本，每次配置加一", default=1)
    key_policy_generation = uint64(
        "应用内各命名空间资源键策略的变更代数：每次策略变更加一，进程内策略缓存据此失效", default=0
    )
    moving = models.BooleanField(
        default=False, db_comment="正在迁往另一单元：停止接收提交与领取，只完成已在运行的尝试（orbit_move_application）"
    )
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")
    updated_at = models.DateTimeField(auto_now=True, db_comment="最后修改时间（UTC）")

    class Meta:
        db_table = "orbit_application"
        db_table_comment = "应用：多租户的顶层单位，承载跨命名空间配额"

    def __str__(self) -> str:
        return self.name


class ApplicationState(models.Model):
    """Running counters of an application, apart from its configuration row so
    that configuration reads never wait on dispatch."""

    application_id = IdField(primary_key=True, db_comment="应用ID，与应用表一一对应")
    active_attempts = uint64("当前有效尝试数（LEASED+RUNNING）", default=0)
    unfinished_tasks = uint64("当前未终结任务数（WAITING/LEASED/RUNNING/NEEDS_REVIEW）", default=0)

    class Meta:
        db_table = "orbit_application_state"
        db_table_comment = "应用运行计数：领取与提交事务中首先加锁的行"


class Namespace(models.Model):
    id = id_primary_key("命名空间ID，32位小写十六进制")
    application = models.ForeignKey(
        Application, on_delete=models.DO_NOTHING, db_constraint=False, db_comment="所属应用ID"
    )
    environment = BinaryCharField(max_length=64, db_comment="环境名称，例如 development、test、production")
    name = BinaryCharField(max_length=128, db_comment="命名空间名称，应用与环境内唯一")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")

    class Meta:
        db_table = "orbit_namespace"
        db_table_comment = "命名空间：队列、任务、资源键、幂等记录和计划的隔离范围"
        constraints = [
            models.UniqueConstraint(fields=["application", "environment", "name"], name="uniq_namespace_app_env_name")
        ]

    def __str__(self) -> str:
        return f"{self.environment}/{self.name}"


class Credential(models.Model):
    id = id_primary_key("凭据ID，令牌 orb_<id>_<secret> 中的 id 部分")
    application_id = IdField(db_comment="所属应用ID（冗余，便于鉴权时直接取得）")
    namespace = models.ForeignKey(
        Namespace, on_delete=models.DO_NOTHING, db_constraint=False, db_comment="所属命名空间ID"
    )
    name = models.CharField(max_length=128, blank=True, default="", db_comment="凭据备注名称")
    secret_hash = models.CharField(max_length=64, db_comment="令牌密文部分的 SHA-256 十六进制摘要；不保存明文")
    scopes = models.JSONField(db_comment="授权范围列表，例如 queues:read、tasks:submit")
    queue_ids = models.JSONField(
        null=True, blank=True, db_comment="队列范围：NULL 表示命名空间内全部队列，否则为队列ID列表"
    )
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")
    revoked_at = models.DateTimeField(null=True, blank=True, db_comment="吊销时间；非空即失效")

    class Meta:
        db_table = "orbit_credential"
        db_table_comment = "访问凭据：只保存令牌摘要、授权范围和队列范围"

    def __str__(self) -> str:
        return self.name or self.id


class IdempotencyRecord(models.Model):
    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID；幂等键在命名空间内唯一")
    key = BinaryCharField(max_length=255, db_comment="Idempotency-Key 原值，按字节精确比较")
    operation = models.CharField(max_length=64, db_comment="操作名称，例如 queue.create、task.submit")
    digest = models.CharField(max_length=64, db_comment="请求内容摘要（SHA-256，按原样提交的字段计算）")
    response_status = models.PositiveSmallIntegerField(db_comment="首次受理时的 HTTP 状态码")
    response_data = models.JSONField(db_comment="首次受理时回执的 data 部分")
    request_id = IdField(db_comment="首次受理请求的 request_id")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="受理时间（UTC）")

    class Meta:
        db_table = "orbit_idempotency_record"
        db_table_comment = "幂等记录：与业务效果同事务提交，被拒绝的请求不留记录"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "key"], name="uniq_idempotency_ns_key")]


class AuditEntry(models.Model):
    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    credential_id = IdField(db_comment="执行操作的凭据ID")
    action = models.CharField(max_length=64, db_comment="管理动作，例如 queue.configure")
    target_type = models.CharField(max_length=32, db_comment="目标类型，例如 queue、task")
    target_id = IdField(db_comment="目标ID")
    reason = models.TextField(blank=True, default="", db_comment="操作原因（审计必填项由接口校验）")
    before = models.JSONField(null=True, blank=True, db_comment="变更前快照")
    after = models.JSONField(null=True, blank=True, db_comment="变更后快照")
    request_id = IdField(db_comment="请求ID")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="记录时间（UTC）")

    class Meta:
        db_table = "orbit_audit_entry"
        verbose_name_plural = "audit entries"
        db_table_comment = "管理审计：与变更同事务写入"
        indexes = [models.Index(fields=["namespace_id", "target_id"], name="idx_audit_ns_target")]


class Event(models.Model):
    """One entry of a namespace's event log. `seq` is its cursor: the log's
    writers take the namespace's EventSequence row last in their transaction
    and hold it to their commit, so a namespace's events become visible in
    `seq` order with no gaps, and a reader after cursor N skips none."""

    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    seq = uint64("事件游标：命名空间内按提交顺序连续递增")
    type = models.CharField(max_length=64, db_comment="事件类型，例如 task.state_changed、queue.configured")
    subject_id = IdField(db_comment="事件主体ID（队列、任务或计划）")
    data = models.JSONField(db_comment="事件内容")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="发生时间（UTC）")

    class Meta:
        db_table = "orbit_event"
        db_table_comment = "事件日志：与状态变化同事务写入，按命名空间和游标读取"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "seq"], name="uniq_event_ns_seq")]


class EventSequence(models.Model):
    """The last cursor of a namespace's event log, locked by each transaction
    that writes events, as its last lock, until its commit."""

    namespace_id = IdField(primary_key=True, db_comment="命名空间ID")
    last_seq = uint64("已分配的最大事件游标", default=0)

    class Meta:
        db_table = "orbit_event_sequence"
        db_table_comment = "事件游标序列：写事件的事务最后锁定本行并递增，持锁至提交，游标因此按提交顺序连续"


class CellPlacement(models.Model):
    """The directory (with ORBIT_CELLS): the cell that holds an application.
    Written before the application's own rows, so a crash between the two
    leaves a placement that the next creation of that name completes."""

    application_id = IdField(primary_key=True, db_comment="应用ID")
    name = BinaryCharField(max_length=128, unique=True, db_comment="应用名称，全部单元内唯一，按字节精确比较")
    cell = models.CharField(max_length=32, db_comment="应用所在单元名称（ORBIT_CELLS 中的键）")
    moving_to = models.CharField(
        max_length=32, blank=True, default="", db_comment="迁移中的目标单元；空表示没有进行中的迁移"
    )
    moving_from = models.CharField(
        max_length=32, blank=True, default="", db_comment="迁移已切换后待清理的源单元；空表示没有"
    )
    move_phase = models.CharField(
        max_length=16,
        blank=True,
        default="",
        db_comment="迁移阶段：draining（停止接收，等待运行中的尝试结束）、copied（已切换到目标单元，待删除源行）；空表示无迁移",
    )
    created_at = models.DateTimeField(auto_now_add=True, db_comment="放置时间（UTC）")
    updated_at = models.DateTimeField(auto_now=True, db_comment="最后一次迁移单元的时间（UTC）")

    class Meta:
        db_table = "orbit_cell_placement"
        db_table_comment = "单元目录：应用到其所在单元的映射，仅在默认数据库（目录）中使用"


class CredentialPlacement(models.Model):
    """The directory (with ORBIT_CELLS): a credential's application, so a
    token is authenticated in its application's cell."""

    credential_id = IdField(primary_key=True, db_comment="凭据ID，令牌 orb_<id>_<secret> 中的 id 部分")
    application_id = IdField(db_comment="凭据所属应用ID")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="登记时间（UTC）")

    class Meta:
        db_table = "orbit_credential_placement"
        db_table_comment = "单元目录：凭据到其应用的映射，鉴权时据此找到单元，仅在默认数据库（目录）中使用"
