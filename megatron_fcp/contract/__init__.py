"""The plan contract: blocks, need rules, placements, the Plan and its proofs (pure data, no torch).

What the planner produces and the engine executes: a :class:`~megatron_fcp.contract.plan.Plan`
(rounds of block transfers over one CP group, verified), the causal and document need rules, packed
placements and the head-parallel stage's contract. Modules are imported where used; this package
imports nothing itself.
"""
