"""Metrics across processes: each service snapshots its prometheus-client registry into a
MetricsReport (report.py) and publishes it (publisher.py); a gateway keeps the latest report of each
live instance (book.py) and re-exports them all on /metrics."""
