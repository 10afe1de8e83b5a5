"""Integrations with other trainers, each an optional extra (``pip install -e ".[trl]"``)."""
