"""The planner: topology + CP group -> verified Plan (graph builders, compile to rounds, Megatron's
rank layout, head-parallel plans). Pure; chooses among candidates with :mod:`megatron_fcp.cost`.
"""
