"""Experiment configs (ml_collections), one per paper experiment, each with a smoke variant."""
