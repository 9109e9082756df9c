# The deadline sweep's indexes on columns the database computes, a task's
# deadlines only while it can still miss them (tasks.models.Task): a state
# change of a task without deadlines no longer rewrites their entries.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0004_worker_identity"),
    ]

    # The new indexes before the old ones go: a server not yet upgraded sweeps
    # with the old ones until its successor's columns are indexed.
    operations = [
        migrations.AddField(
            model_name="task",
            name="deadline_due_at",
            field=models.GeneratedField(
                db_comment="总截止时间（仅 WAITING/LEASED 时，供截止扫描索引；其余为空）",
                db_persist=False,
                expression=models.Case(models.When(state__in=["WAITING", "LEASED"], then=models.F("deadline_at"))),
                output_field=models.DateTimeField(null=True),
            ),
        ),
        migrations.AddField(
            model_name="task",
            name="start_deadline_due_at",
            field=models.GeneratedField(
                db_comment="开始截止时间（仅未开始过的 WAITING/LEASED 任务，供截止扫描索引；其余为空）",
                db_persist=False,
                expression=models.Case(
                    models.When(attempts=0, state__in=["WAITING", "LEASED"], then=models.F("start_deadline_at"))
                ),
                output_field=models.DateTimeField(null=True),
            ),
        ),
        migrations.AddIndex(
            model_name="task",
            index=models.Index(fields=["start_deadline_due_at"], name="idx_task_start_deadline_due"),
        ),
        migrations.AddIndex(
            model_name="task",
            index=models.Index(fields=["deadline_due_at"], name="idx_task_deadline_due"),
        ),
        migrations.RemoveIndex(
            model_name="task",
            name="idx_task_start_deadline",
        ),
        migrations.RemoveIndex(
            model_name="task",
            name="idx_task_deadline",
        ),
    ]
