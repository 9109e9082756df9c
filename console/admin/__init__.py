"""Every app's admin pages, registered when Django's admin autodiscovers this
package (console is an installed app), in the apps' order."""

from console.admin import core, keys, plans, queues, tasks, workers

__all__ = ["core", "keys", "plans", "queues", "tasks", "workers"]
