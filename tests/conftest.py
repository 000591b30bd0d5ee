"""Shared pytest options.

``--fcp-e2e-metrics PATH``: tests/test_gpt_e2e.py writes the losses and grad norms of its runs
there (the version matrix, tests/compat/matrix.py, reads the max relative loss difference from it).
"""

from __future__ import annotations


def pytest_addoption(parser):
    parser.addoption("--fcp-e2e-metrics", metavar="PATH", default=None,
                     help="write the end-to-end runs' losses and grad norms to PATH (JSON)")
