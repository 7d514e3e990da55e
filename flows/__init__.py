"""Prefect flows and deployments: wiring only; DVC runs and caches the stages."""
