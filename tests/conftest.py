"""Shared pytest options and fixtures.

``--fcp-e2e-metrics PATH``: tests/test_gpt_e2e.py writes the losses and grad norms of its runs
there (the version matrix, tests/compat/matrix.py, reads the max relative loss difference from it).
``gloo_attention_world``: the one gloo world the attention tests' process-group cases share.
``megatron_e2e_world``: the one gloo world the Megatron end-to-end trainings share
(tests/_megatron_world.py); it trains only the parts the selected tests name in ``E2E_PARTS``.

Tiers: ``slow`` marks the multi-process and end-to-end tests (pyproject.toml); developers may run
``python3 -m pytest -q -m "not slow" tests``, CI and the README's command run every test.
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


@pytest.fixture(scope="session")
def megatron_e2e_world(request, tmp_path_factory):
    """Per rank: part -> run name -> the example's training report (tests/_megatron_world.py), for
    the parts (``E2E_PARTS`` of their modules) of the selected tests that use this fixture, trained
    once per session by one gloo world of 4 processes: ``{"ranks": [per rank], "metrics_path": the
    file the dense part's cp = 4 run writes with --metrics-json}``."""
    sys.path.insert(0, os.path.dirname(__file__))
    import _megatron_world

    parts = sorted({part for item in request.session.items if "megatron_e2e_world" in getattr(item, "fixturenames", ())
                    for part in getattr(item.module, "E2E_PARTS", ())})
    metrics = str(tmp_path_factory.mktemp("e2e") / "metrics.json")
    return {"ranks": _megatron_world.run(parts, metrics), "metrics_path": metrics}
