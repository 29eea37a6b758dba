"""Benchmarks (make bench, bench-load, bench-serve, bench-dropin): each prints ratios measured
side by side in one run, and the HTTP client (dash_client.py) the load runs and the security
tests speak Dash's callback protocol with."""
