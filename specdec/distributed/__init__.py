"""Running one model over several processes (pipeline parallel: pipeline.py, docs/distributed.md)."""
