"""Tensor parallelism (``--tp N``) over ``mx.distributed``, one process per shard.

The engine enters through ``mlxb.distributed.leader.TPRunner`` (rank 0's runner: each call is sent to the
other ranks first) and ``mlxb.distributed.follower.run_follower`` (the other ranks replay it). Inside:
``protocol`` (the words), ``link`` (groups, sharding, messages), ``cache`` (each rank's prompt-cache shard).
"""
