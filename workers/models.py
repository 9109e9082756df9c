"""Worker identities: the registration properties fixed per worker_id."""

from __future__ import annotations

from django.db import models

from orbit.fields import IdField


class WorkerIdentity(models.Model):
    id = models.BigAutoField(primary_key=True, db_comment="自增主键")
    namespace_id = IdField(db_comment="命名空间ID")
    worker_id = models.CharField(max_length=128, db_comment="Worker 进程的稳定身份")
    concurrency_keys = models.BooleanField(db_comment="是否声明支持资源键；同一身份固定不变")
    credential_id = IdField(db_comment="最近一次连接使用的凭据ID")
    session_id = IdField(db_comment="最近一次会话ID")
    connected_at = models.DateTimeField(db_comment="最近一次握手时间（UTC）")
    queue_ids = models.JSONField(default=list, db_comment="当前会话 hello 声明消费的队列ID列表")
    seen_at = models.DateTimeField(null=True, db_comment="当前会话连接最近一次心跳时间（UTC）；连接关闭后为空")

    class Meta:
        db_table = "orbit_worker_identity"
        db_table_comment = "Worker 身份：注册属性（资源键支持）按进程身份固定"
        constraints = [models.UniqueConstraint(fields=["namespace_id", "worker_id"], name="uniq_worker_ns_identity")]
