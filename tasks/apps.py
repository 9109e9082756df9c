from django.apps import AppConfig


class TasksConfig(AppConfig):
    name = "tasks"

    def ready(self) -> None:
        # The app's OpenAPI objects join the document (orbit.api.openapi_registry);
        # imported here, once the models are loaded, and before any view is.
        from tasks import openapi, policy_openapi

        openapi.register()
        policy_openapi.register()
