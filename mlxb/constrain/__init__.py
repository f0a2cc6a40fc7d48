"""Constrained decoding and the agent API's input side.

The gateway enters through ``mlxb.constrain.tools`` (messages, declared tools, the grammar a request
needs) and ``mlxb.constrain.grammar.Grammars.compile``; the runner only applies each row's
``Constraint`` mask before sampling (``mlxb.constrain.grammar``, llguidance matchers).
"""
