# The worker identity model now belongs to tasks (tasks.0004): the table stays.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("workers", "0003_identity_handlers"),
        ("tasks", "0004_worker_identity"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="WorkerIdentity")],
            database_operations=[],
        ),
    ]
