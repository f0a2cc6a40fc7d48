"""The words of ``--tp``: what rank 0 tells the other ranks, one opcode and its operands per call.
Rank 0 (``mlxb.distributed.leader``) writes them; the followers (``mlxb.distributed.follower``) and
each rank's prompt-cache shard (``mlxb.distributed.cache``) read them."""

NEW, CHUNK, FIRST, COHORT, JOIN_COHORT, JOIN, DECODE, FILTER, DROP, FORGET, PING, STOP, ENGINE = range(1, 14)
SEED, PUT, FREE, EXTRACT = range(14, 18)  # the prompt cache's entries on every rank (mlxb.distributed.cache)
VERIFY, SETTLE, COMPACT = range(18, 21)  # --spec: rank 0's drafts, what each row kept, holes compacted (mlxb.spec.verify)
SPILL, RESTORE, DISK_DROP = range(21, 24)  # the prompt cache's SSD tier on every rank (mlxb.distributed.cache)
JOIN_MODES = ("extend", "merge")
EXIT_CODE = 70  # the process exits with this when a rank stopped answering
SRC_ROW, SRC_COHORT, SRC_EXTRACT = range(3)  # where a PUT's snapshot comes from (mlxb.distributed.cache)
