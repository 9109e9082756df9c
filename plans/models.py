"""Plans: tasks submitted on a schedule. A plan's definition lives in
immutable versions; every scheduled point it reaches is decided once and
recorded as a trigger (CREATED with its task, or SKIPPED with a reason)."""

from __future__ import annotations

from django.db import models

from orbit.fields import BinaryCharField, IdField, id_primary_key, uint32, uint64


class PlanState(models.TextChoices):
    ACTIVE = "ACTIVE"
    PAUSED = "PAUSED"
    RETIRED = "RETIRED"


class TriggerOutcome(models.TextChoices):
    CREATED = "CREATED"
    SKIPPED = "SKIPPED"


class Plan(models.Model):
    id = id_primary_key("计划ID，32位小写十六进制")
    namespace_id = IdField(db_comment="所属命名空间ID")
    application_id = IdField(db_comment="所属应用ID（冗余）")
    queue_id = IdField(db_comment="目标队列ID；计划生成的任务进入该队列，使用同一积压名额")
    name = BinaryCharField(max_length=128, db_comment="计划名称，命名空间内唯一，按字节精确比较；退役后仍占用")
    state = models.CharField(
        max_length=16,
        choices=PlanState.choices,
        db_comment="计划状态：ACTIVE 生成任务，PAUSED 暂停生成，RETIRED 永久停止",
    )
    version = uint32("当前版本号；每次 :update 生成新的不可变版本")
    revision = uint64("计划修订号，每次变更（更新、暂停、恢复、退役）加一", default=1)
    next_fire_at = models.DateTimeField(
        null=True, blank=True, db_comment="下一游标：尚未决定的最早计划触发点（UTC）；满额时保留原触发点"
    )
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")
    updated_at = models.DateTimeField(auto_now=True, db_comment="最后变更时间（UTC）")

    class Meta:
        db_table = "orbit_plan"
        db_table_comment = "计划：按时间表向队列提交任务；触发循环按状态与下一游标扫描"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "name"], name="uniq_plan_ns_name")]
        indexes = [
            models.Index(fields=["state", "next_fire_at"], name="idx_plan_due"),
            models.Index(fields=["queue_id", "state"], name="idx_plan_queue"),
        ]

    def __str__(self) -> str:
        return self.name


class PlanVersion(models.Model):
    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    plan_id = IdField(db_comment="所属计划ID")
    version = uint32("版本号，从 1 开始")
    schedule = models.JSONField(db_comment="时间表：{cron, timezone} 或 {interval_seconds}")
    misfire = models.JSONField(db_comment="漏跑策略：{policy, catch_up_window_seconds}，随版本冻结")
    definition = models.JSONField(db_comment="任务定义：{task: {...}}，按提交时原样保存；无模板插值")
    anchor_at = models.DateTimeField(db_comment="时间表起点（UTC）：间隔计划的触发点为起点加整数倍间隔")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")

    class Meta:
        db_table = "orbit_plan_version"
        db_table_comment = "计划版本：不可变的时间表、漏跑策略与任务定义"
        constraints = [models.UniqueConstraint(fields=["plan_id", "version"], name="uniq_plan_version")]


class PlanTrigger(models.Model):
    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    plan_id = IdField(db_comment="所属计划ID")
    namespace_id = IdField(db_comment="所属命名空间ID")
    version = uint32("决定该触发点时使用的计划版本")
    scheduled_at = models.DateTimeField(db_comment="计划触发点（UTC）；同一计划每个触发点只决定一次")
    outcome = models.CharField(
        max_length=16, choices=TriggerOutcome.choices, db_comment="结果：CREATED 已生成任务，SKIPPED 按漏跑策略跳过"
    )
    task_id = IdField(blank=True, default="", db_comment="生成的任务ID；跳过时为空")
    reason = models.CharField(max_length=255, blank=True, default="", db_comment="跳过原因；生成时为空")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="决定时间（UTC）")

    class Meta:
        db_table = "orbit_plan_trigger"
        db_table_comment = "计划触发记录：每个触发点一行，与生成的任务同事务写入"
        # A plan's triggers are read in the order they were decided, paged by their point
        # (ids are a cell's own: a move gives them new ones).
        constraints = [models.UniqueConstraint(fields=["plan_id", "scheduled_at"], name="uniq_plan_trigger_point")]
        # orbit_prune removes a plan's finished task with the trigger that names it.
        indexes = [models.Index(fields=["task_id"], name="idx_plan_trigger_task")]
