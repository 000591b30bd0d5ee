"""Testing support, never imported by a training step: the in-process multi-rank harness and group,
and the launcher of local gloo worlds (tests, ``megatron-fcp demo``, benchmarks).
"""
