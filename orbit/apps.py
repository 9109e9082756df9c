from django.apps import AppConfig


class OrbitConfig(AppConfig):
    name = "orbit"
    verbose_name = "Orbit tenancy"

    def ready(self) -> None:
        from orbit import cells

        cells.install()
