"""Subcommands of the ``megatron-fcp`` console script (one module each; see ``cli.py``)."""
