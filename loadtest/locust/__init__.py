"""Locust load tests: the user, its ledger of tokens, and the smoke harness."""
