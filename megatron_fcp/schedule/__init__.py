"""The backward schedule: the BackwardProgram that makes every backward decision once (keep or
re-send, chain or waves, what the forward keeps, each rank's posts), and the waves and chains it is
made of. Pure: the engine runs a program, the cost model prices it.
"""
