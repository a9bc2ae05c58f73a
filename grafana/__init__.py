"""Grafana dashboards and provisioning for attn-otel (see grafana/README.md); ``python -m grafana.generate``."""
