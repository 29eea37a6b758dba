"""Attacks replayed over HTTP against a real server: hostile files, oversized and idle
requests, other tabs' keys; test_hostile_costs.py measures what each costs (psutil)."""
