"""The cost model: alpha-beta timelines of plans and backward programs, Transformer Engine's
schedules (zigzag and THD), lower bounds, and the schedule choice (``choose_schedule``). Pure.
"""
