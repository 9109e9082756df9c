"""The worker protocol keeps no rows of its own: worker identities are tasks.models.WorkerIdentity."""
