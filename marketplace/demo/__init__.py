"""Demo only: the seeded fleet, tenants and prices, and the simulated traffic. Production settings do
not load this package: `manage.py demo` sets TESSERA_DEMO_TRAFFIC=1, which installs it as an app so that
its Celery tasks (marketplace.demo.tasks) are registered and scheduled."""
