"""Speculative decoding on the batch lane (``--spec lookup | --draft-model D``).

The engine enters through ``mlxb.spec.verify``: ``setup`` (config, why it cannot run, proposer),
``row_spec`` (a new row's state), ``decode`` (one decode step: a verify step where some row drafts,
else the plain one) and ``off_reason``. Inside:

* ``config``: ``SpecConfig``, the flags;
* ``lookup``, ``draft``: the proposers (prompt lookup; a draft model batched over the target's rows);
* ``control``: when a verify step pays (acceptance, measured step costs, per-row draft length);
* ``rows``: acceptance, rollback of rejected tails, settling rows after a verify step;
* ``ahead``: a lone greedy row's next verify step launched before the current one is read.
"""
