"""Tools built on the engine: `specdec bench` (bench.py), the losslessness audit behind `specdec
verify` (audit.py, distribution.py), prompt sets (prompts.py) and their command-line glue
(commands.py)."""
