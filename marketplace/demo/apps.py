from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "marketplace.demo"
    label = "tessera_demo"
    verbose_name = "Tessera demo traffic"
