"""Queue configuration and, in a row of its own, the queue's running counters."""

from __future__ import annotations

from django.db import models

from orbit.fields import BinaryCharField, IdField, id_primary_key, uint32, uint64

DEFAULT_MAX_UNFINISHED_TASKS = 100_000


class Queue(models.Model):
    id = id_primary_key("队列ID，32位小写十六进制")
    namespace_id = IdField(db_comment="所属命名空间ID")
    application_id = IdField(db_comment="所属应用ID（冗余，按固定顺序加锁时使用）")
    name = BinaryCharField(max_length=128, db_comment="队列名称，命名空间内唯一，按字节精确比较；退役后仍占用")
    paused = models.BooleanField(default=False, db_comment="是否暂停：暂停阻止新的领取和 Start，不阻止受理")
    max_concurrency = uint32("有效执行许可上限（LEASED+RUNNING），1–100000")
    rate_per_second = uint32("每个一秒数据库计数窗口内最多批准的 Start 数，1–1000000")
    max_unfinished_tasks = uint32("未终结任务上限（含待核查），1–1000000", default=DEFAULT_MAX_UNFINISHED_TASKS)
    revision = uint64("配置版本，只在配置变化时加一", default=1)
    retired_at = models.DateTimeField(null=True, blank=True, db_comment="永久退役时间；非空后禁止新工作")
    created_at = models.DateTimeField(auto_now_add=True, db_comment="创建时间（UTC）")
    updated_at = models.DateTimeField(auto_now=True, db_comment="最后配置时间（UTC）")

    class Meta:
        db_table = "orbit_queue"
        db_table_comment = "队列配置：名称、暂停、并发、开始速率与积压上限"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "name"], name="uniq_queue_ns_name")]

    def __str__(self) -> str:
        return self.name


class QueueState(models.Model):
    """Counters that dispatch, Start and results change on every task.

    Kept apart from Queue so a configuration read never waits on a lease
    transaction holding this row.
    """

    queue_id = IdField(primary_key=True, db_comment="队列ID，与队列表一一对应")
    application_id = IdField(db_comment="所属应用ID（冗余）")
    unfinished_tasks = uint64("未终结任务数：WAITING、LEASED、RUNNING、NEEDS_REVIEW", default=0)
    active_permits = uint64("有效执行许可数：LEASED 与 RUNNING 的尝试", default=0)
    reserved_starts = uint64("已领取尚未 Start 的尝试数，为其预留速率窗口空间", default=0)
    window_started_at = models.DateTimeField(
        null=True, blank=True, db_comment="当前开始速率窗口的起点，由窗口内第一次成功 Start 建立"
    )
    window_count = uint64("当前窗口内已批准的 Start 数", default=0)
    fair_shares = models.BooleanField(
        default=False, db_comment="是否受理过带公平分组键的任务：为真后领取按分组轮转（无分组键的队列保持原顺序）"
    )
    accepting = models.BooleanField(
        default=True, db_comment="是否受理新任务：退役事务在持有本行锁时置为假，提交事务在同一锁下检查"
    )

    class Meta:
        db_table = "orbit_queue_state"
        db_table_comment = "队列运行计数：积压、许可与开始速率窗口，领取事务按队列ID升序加锁"
