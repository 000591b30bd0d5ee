"""Shared pytest options and fixtures.

``--fcp-e2e-metrics PATH``: tests/test_gpt_e2e.py writes the losses and grad norms of its runs
there (the version matrix, tests/compat/matrix.py, reads the max relative loss difference from it).
``gloo_attention_world``: the one gloo world the attention tests' process-group cases share.
"""

from __future__ import annotations

import os
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption("--fcp-e2e-metrics", metavar="PATH", default=None,
                     help="write the end-to-end runs' losses and grad norms to PATH (JSON)")


@pytest.fixture(scope="session")
def gloo_attention_world():
    """Per rank: the reports of the attention tests' gloo cases (tests/_gloo_world.py), computed
    once per session by one gloo world of 4 processes."""
    sys.path.insert(0, os.path.dirname(__file__))
    import _gloo_world

    return _gloo_world.run()
