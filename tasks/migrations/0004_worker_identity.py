# The worker identity model moves from the workers app to tasks (the verbs that
# grant leases lock it); its table stays as it is: a change of state only.

import orbit.fields
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("tasks", "0003_queue_minute"),
        ("workers", "0003_identity_handlers"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="WorkerIdentity",
                    fields=[
                        ("id", models.BigAutoField(db_comment="自增主键", primary_key=True, serialize=False)),
                        ("namespace_id", orbit.fields.IdField(db_comment="命名空间ID", max_length=32)),
                        ("worker_id", models.CharField(db_comment="Worker 进程的稳定身份", max_length=128)),
                        ("concurrency_keys", models.BooleanField(db_comment="是否声明支持资源键；同一身份固定不变")),
                        ("credential_id", orbit.fields.IdField(db_comment="最近一次连接使用的凭据ID", max_length=32)),
                        ("session_id", orbit.fields.IdField(db_comment="最近一次会话ID", max_length=32)),
                        ("connected_at", models.DateTimeField(db_comment="最近一次握手时间（UTC）")),
                        (
                            "queue_ids",
                            models.JSONField(db_comment="当前会话 hello 声明消费的队列ID列表", default=list),
                        ),
                        (
                            "seen_at",
                            models.DateTimeField(
                                db_comment="当前会话连接最近一次心跳时间（UTC）；连接关闭后为空", null=True
                            ),
                        ),
                        (
                            "handlers",
                            models.JSONField(
                                db_comment="当前会话 hello 声明的处理器列表 [[handler, handler_version], ...]；空表示任意",
                                default=list,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "orbit_worker_identity",
                        "db_table_comment": "Worker 身份：注册属性（资源键支持）按进程身份固定",
                        "constraints": [
                            models.UniqueConstraint(fields=("namespace_id", "worker_id"), name="uniq_worker_ns_identity")
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
