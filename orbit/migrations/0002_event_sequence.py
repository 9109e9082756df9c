"""Event cursors that follow the commit order: `orbit_event.seq`, numbered per
namespace under the namespace's `orbit_event_sequence` row.

Existing events keep their id as their cursor (a reader's saved cursor still
points where it did) and each namespace's sequence starts after its largest."""

import orbit.fields
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("orbit", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="EventSequence",
            fields=[
                (
                    "namespace_id",
                    orbit.fields.IdField(db_comment="命名空间ID", max_length=32, primary_key=True, serialize=False),
                ),
                ("last_seq", models.PositiveBigIntegerField(db_comment="已分配的最大事件游标", default=0)),
            ],
            options={
                "db_table": "orbit_event_sequence",
                "db_table_comment": "事件游标序列：写事件的事务最后锁定本行并递增，持锁至提交，游标因此按提交顺序连续",
            },
        ),
        migrations.AddField(
            model_name="event",
            name="seq",
            field=models.PositiveBigIntegerField(db_comment="事件游标：命名空间内按提交顺序连续递增", default=0),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="event",
            name="id",
            field=models.BigAutoField(db_comment="自增主键", primary_key=True, serialize=False),
        ),
        migrations.RunSQL(
            sql=[
                "UPDATE orbit_event SET seq = id",
                "INSERT INTO orbit_event_sequence (namespace_id, last_seq) "
                "SELECT namespace_id, MAX(seq) FROM orbit_event GROUP BY namespace_id",
            ],
            reverse_sql=migrations.RunSQL.noop,
        ),
        migrations.RemoveIndex(model_name="event", name="idx_event_ns_id"),
        migrations.AddConstraint(
            model_name="event",
            constraint=models.UniqueConstraint(fields=("namespace_id", "seq"), name="uniq_event_ns_seq"),
        ),
    ]
