from django.apps import AppConfig


class OrbitConfig(AppConfig):
    name = "orbit"
    verbose_name = "Orbit tenancy"
